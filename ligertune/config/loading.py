"""Reading a recipe: YAML → command-line overrides → pydantic schema → rules, with errors a user can act on.

Loading goes: YAML (`RecipeLoader`: safe, duplicate keys refused) → command-line overrides (``training.lr=2e-5``) applied to the
raw mapping → pydantic validation → the recipe rules of `ligertune.config.rules`. Every failure
raises `RecipeError` with one line per problem, each naming the dotted key, before any model,
data or GPU work starts. The CLI prints those lines and exits with status 2.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ligertune.config.rules import recipe_problems
from ligertune.config.schema import KernelsSection, Recipe
from ligertune.errors import RecipeError
from ligertune.paths import RECIPES_DIR, shipped_recipes


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice. Plain YAML keeps the last value silently, so a second
    ``training:`` block would replace the first and the recipe would still validate."""

    def __init__(self, dotted: str, first_line: int, second_line: int):
        super().__init__(dotted)
        self.dotted, self.first_line, self.second_line = dotted, first_line, second_line

    def __str__(self) -> str:
        return (
            f"{self.dotted}: key given twice (lines {self.first_line} and {self.second_line}); "
            "the second would replace the first: keep one"
        )


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with two changes for recipes.

    - Duplicate keys are errors (`DuplicateKeyError`, naming the dotted key and both lines),
      checked on the composed node tree before construction, where the parent keys are known.
    - ``2e-5`` and ``1e3`` are floats, as in YAML 1.2 and as people write learning rates. YAML 1.1
      (PyYAML) wants a dot and a signed exponent (``2.0e-5``) and reads ``2e-5`` as a string, which
      the strict schema would then refuse.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _check_duplicates(node, [], set())
        return super().construct_document(node)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _check_duplicates(node: yaml.Node, path: list[str], seen: set[int]) -> None:
    if id(node) in seen:  # an alias: the anchored node was checked where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                if key in lines:
                    dotted = ".".join([*path, str(key)])
                    raise DuplicateKeyError(dotted, lines[key], key_node.start_mark.line + 1)
                lines[key] = key_node.start_mark.line + 1
            _check_duplicates(value_node, [*path, str(key)], seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_duplicates(item, [*path, str(index)], seen)


def load_yaml(text: str) -> Any:
    """Parse recipe YAML (or an override's value) with `RecipeLoader`."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - RecipeLoader is a SafeLoader


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``training.lr=2e-5`` → (["training", "lr"], 2e-05). Values are parsed as YAML."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError([f"{item}: an override is written section.key=value, e.g. training.lr=2e-5"])
        try:
            value = load_yaml(raw) if raw else None
        except yaml.YAMLError as e:
            raise RecipeError([f"{key}: cannot parse value {raw!r} as YAML ({e.problem})"]) from None
        parsed.append((key.split("."), value))
    return parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for keys, value in parse_overrides(overrides):
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None or isinstance(child, str) and key == "kernels":
                # `kernels: all` followed by `kernels.rope=false`: expand the preset first.
                child = {} if child is None else KernelsSection.preset(child).model_dump()
                node[key] = child
            if not isinstance(child, dict):
                path = ".".join(keys[: depth + 1])
                raise RecipeError([f"{'.'.join(keys)}: {path} is {child!r}, not a section with keys"])
            node = child
        node[keys[-1]] = value
    return raw


def _model_at(loc: tuple, root: type[BaseModel] = Recipe) -> type[BaseModel] | None:
    """The pydantic model class whose fields live at `loc` (a ValidationError location)."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = next(
            (
                a
                for a in getattr(annotation, "__args__", (annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            annotation,
        )
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _union_tag_index(loc: tuple) -> int | None:
    """Where pydantic put a union member's tag in `loc` (``model.config.str``), if it did: the
    position right after a field whose type is a union of several types."""
    model: Any = Recipe
    for i, part in enumerate(loc[:-1]):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) > 1:
            return i + 1
        model = annotation
    return None


_TYPE_WORDS = {str: "a string", dict: "a mapping", list: "a list", int: "an integer", float: "a number"}


def _describe_union(loc: tuple, given: Any) -> str:
    """One line for a value that fits no member of a union, instead of one line per member."""
    model = _model_at(loc[:-1])
    annotation = model.model_fields[loc[-1]].annotation if model else None
    words = [
        "null"
        if a is type(None)
        else _TYPE_WORDS.get(typing.get_origin(a) or a, getattr(a, "__name__", str(a)))
        for a in typing.get_args(annotation)
    ]
    return f"{'.'.join(str(p) for p in loc)}: got {given!r}; expected {', '.join(words[:-1])} or {words[-1]}"


def describe_errors(errors: list[dict]) -> list[str]:
    """One line per problem of a pydantic ValidationError, each starting with the dotted key."""
    lines, located = [], []
    for err in errors:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
        tag = _union_tag_index(loc)
        located.append((err, loc, tag))
    # Union members whose type matched but whose content did not (a mapping with a bad key):
    # those errors say more than "fits no member".
    inner = {loc[:tag] for _, loc, tag in located if tag is not None and tag < len(loc) - 1}
    for err, loc, tag in located:
        if tag is not None and tag == len(loc) - 1:
            if loc[:tag] in inner:
                continue
            line = _describe_union(loc[:tag], err.get("input"))
        else:
            line = _describe_error({**err, "loc": loc if tag is None else loc[:tag] + loc[tag + 1 :]})
        if line not in lines:
            lines.append(line)
    return lines


def _describe_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
    dotted = ".".join(str(p) for p in loc) or "recipe"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        prefix = ".".join(str(p) for p in loc[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
        return f"{dotted}: unknown key{hint} (valid keys here: {', '.join(valid)})"
    if kind == "missing":
        return f"{dotted}: required key is missing"
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        return f"{dotted}: got {given!r}; allowed: {allowed}"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{dotted}: {msg}"
    return f"{dotted}: got {given!r}; {err['msg'].lower()}"


def validate_recipe(
    raw: Any, source: str | None = None, base_dir: Path | None = None, source_file: Path | None = None
) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(
            [f"the recipe must be a YAML mapping of sections, got {type(raw).__name__}"], source
        )
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(describe_errors(e.errors()), source) from None
    recipe._base_dir, recipe._source_file = base_dir, source_file
    problems = recipe_problems(recipe)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def resolve_recipe_path(path: str | Path) -> Path:
    """The file a recipe argument names: the path itself when it exists or has a folder in it;
    else, for a bare name that a shipped recipe has (``quickstart``, ``llama3-8b-alpaca.yaml``),
    that recipe. A local file always wins, so a shipped name never hides the user's own file."""
    path = Path(path)
    if path.exists() or len(path.parts) != 1:
        return path
    return shipped_recipes().get(path.name.removesuffix(".yaml"), path)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file (or a shipped recipe, by name). Raises RecipeError
    with every problem found."""
    path = resolve_recipe_path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.yaml"))
        hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        raise RecipeError([f"{path} is a folder; name a recipe file{hint}"])
    if not path.exists():
        shipped = RECIPES_DIR / path.name
        raise RecipeError(
            [f"recipe file not found: {path}"]
            + (
                [f"a shipped recipe has that name: {shipped}"]
                if shipped.exists() and shipped != path.resolve()
                else []
            )
        )
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise RecipeError(["the file is not UTF-8 text"], str(path)) from None
    except OSError as e:
        raise RecipeError([f"cannot read the recipe file: {e.strerror}"], str(path)) from None
    except DuplicateKeyError as e:
        raise RecipeError([str(e)], str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError([f"not valid YAML{where}: {getattr(e, 'problem', e)}"], str(path)) from None
    if raw is None:
        raw = {}
    if isinstance(raw, dict) and overrides:
        raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, str(path), path.resolve().parent, path.resolve())


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
