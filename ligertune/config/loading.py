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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ligertune.catalog.objectives import OBJECTIVES
from ligertune.catalog.strategies import STRATEGIES
from ligertune.config.rules import recipe_problems
from ligertune.config.schema import KernelsSection, Recipe
from ligertune.errors import RecipeError, shown
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


class DocumentTooLarge(yaml.YAMLError):
    """A document that aliases expand into more values than any recipe has (an "alias bomb":
    a few hundred bytes of nested ``&anchors`` and ``*aliases`` standing for billions of values),
    or that refers to itself."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem

    def __str__(self) -> str:
        return self.problem


# What a recipe may expand to: far above a real one (a few hundred values with a model.config
# mapping), far below what would take noticeable time or memory to validate, dump or train on.
MAX_VALUES = 100_000
# A recipe file is a few KB (a chat template included); a bigger one is not a recipe.
MAX_RECIPE_BYTES = 1 << 20


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with three changes for recipes.

    - Duplicate keys are errors (`DuplicateKeyError`, naming the dotted key and both lines),
      checked on the composed node tree before construction, where the parent keys are known.
    - ``2e-5`` and ``1e3`` are floats, as in YAML 1.2 and as people write learning rates. YAML 1.1
      (PyYAML) wants a dot and a signed exponent (``2.0e-5``) and reads ``2e-5`` as a string, which
      the strict schema would then refuse.
    - The document's size with its aliases expanded is bounded (`MAX_VALUES`; a long string
      counts once per KiB), and an alias inside what it names is refused (`DocumentTooLarge`).
      PyYAML builds an alias as a second reference to one object, so loading costs nothing; but
      everything after it walks the expanded tree (validation, ``validate -f yaml``, the saved
      recipe.yaml), and 819 bytes of nested anchors made that unbounded. The size is counted on
      the node graph before construction, each node once (linear in the file's size).
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _check_duplicates(node, [], set())
        if _expanded_size(node, {}, set()) > MAX_VALUES:
            raise DocumentTooLarge(
                f"the document expands to more than {MAX_VALUES:,} values through its aliases (*name repeats "
                "what &name anchors); write the values out, without nested aliases"
            )
        return super().construct_document(node)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """Values in `node` with every alias expanded, each distinct node counted once (`sizes`)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise DocumentTooLarge("an alias refers to a mapping or list that contains it; write the values out")
    open_.add(key)
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(
            _expanded_size(k, sizes, open_) + _expanded_size(v, sizes, open_) for k, v in node.value
        )
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(item, sizes, open_) for item in node.value)
    else:
        size = 1 + len(str(node.value)) // 1024
    open_.discard(key)
    sizes[key] = min(size, MAX_VALUES + 1)  # enough to know it is too big; keeps the numbers small
    return sizes[key]


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


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's complaint in one line (a reader error's message spans several, with its position)."""
    text = str(getattr(error, "problem", None) or error).strip()
    return (text.splitlines() or [type(error).__name__])[0]


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
            raise RecipeError(
                [f"{key}: cannot parse value {raw[:100]!r} as YAML ({_yaml_problem(e)})"]
            ) from None
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


def _members(annotation: Any) -> list[Any]:
    """The types a field's annotation allows: a union's members (None left out), else itself."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tagged(model: type[BaseModel], tag: Any) -> bool:
    """Whether `tag` is the value of `model`'s discriminator (a one-value Literal field): how a
    component's options (``objective: {name: dpo}``) are told apart."""
    return any(
        typing.get_origin(f.annotation) is typing.Literal and typing.get_args(f.annotation) == (tag,)
        for f in model.model_fields.values()
    )


@dataclass
class _Location:
    """A ValidationError location read against the schema: the key as the user writes it (union
    tags left out), the model that holds its last key, and whether the location ends at a union's
    tag (the value fits none of the union's types)."""

    shown: tuple
    parent: type[BaseModel] | None
    union_field: tuple | None = None  # the key of a union the value fits no member of


def _locate(loc: tuple) -> _Location:
    shown: list = []
    model: Any = Recipe
    parent = None
    parts = [p for p in loc if not (isinstance(p, str) and p.startswith("function-after"))]
    i = 0
    while i < len(parts):
        part = parts[i]
        shown.append(part)
        parent = model if _is_model(model) else None
        if parent is None or part not in parent.model_fields:
            shown.extend(parts[i + 1 :])
            return _Location(tuple(shown), parent if i + 1 == len(parts) else None)
        members = _members(model.model_fields[part].annotation)
        if len(members) > 1 and i + 1 < len(parts):
            # pydantic names the member it tried next: a discriminator's value, or a type's name
            tag = parts[i + 1]
            if i + 2 == len(parts):
                return _Location(tuple(shown), parent, tuple(shown))
            model = next((m for m in members if _is_model(m) and _tagged(m, tag)), None)
            i += 2
            continue
        model = next((m for m in members if _is_model(m)), members[0] if members else None)
        i += 1
    return _Location(tuple(shown), parent)


_TYPE_WORDS = {str: "a string", dict: "a mapping", list: "a list", int: "an integer", float: "a number"}


def _describe_union(location: _Location, given: Any) -> str:
    """One line for a value that fits no member of a union, instead of one line per member."""
    annotation = location.parent.model_fields[location.shown[-1]].annotation
    words = [
        "null"
        if a is type(None)
        else _TYPE_WORDS.get(typing.get_origin(a) or a, getattr(a, "__name__", str(a)))
        for a in typing.get_args(annotation)
    ]
    dotted = ".".join(shown(p) for p in location.shown)
    return f"{dotted}: got {given!r}; expected {', '.join(words[:-1])} or {words[-1]}"


def describe_errors(errors: list[dict]) -> list[str]:
    """One line per problem of a pydantic ValidationError, each starting with the dotted key."""
    located = [(err, _locate(tuple(err["loc"]))) for err in errors]
    # Union members whose type matched but whose content did not (a mapping with a bad key):
    # those errors say more than "fits no member".
    inner = {loc.shown for _, loc in located if loc.union_field is None}
    lines = []
    for err, location in located:
        if location.union_field is not None:
            if any(shown[: len(location.shown)] == location.shown for shown in inner):
                continue
            line = _describe_union(location, err.get("input"))
        else:
            line = _describe_error(err, location)
        if line not in lines:
            lines.append(line)
    return lines


def _component_key(location: _Location) -> str | None:
    """For a key that another objective or strategy has (``objective.reference`` with orpo), the
    line that says so; None for any other unknown key."""
    choice = next((c for c in (OBJECTIVES, STRATEGIES) if location.shown[:-1] == (c.section,)), None)
    key = str(location.shown[-1])
    owners = choice.owners(key) if choice is not None else []
    if not owners:
        return None
    chooser, chosen = f"{choice.section}.{choice.key}", choice.name_of(location.parent)
    listed = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
    to = owners[0] if len(owners) == 1 else f"one of {', '.join(owners)}"
    return (
        f"{'.'.join(shown(p) for p in location.shown)}: {chooser} {chosen} has no option {key} (an option of "
        f"{listed}); remove it, or set {chooser} to {to}"
    )


def _describe_error(err: dict, location: _Location) -> str:
    dotted = ".".join(shown(p) for p in location.shown) or "recipe"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        component = _component_key(location)
        if component is not None:
            return component
        valid = list(location.parent.model_fields) if location.parent else []
        key = str(location.shown[-1])
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6) if key.isprintable() else []
        prefix = ".".join(shown(p) for p in location.shown[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
        return f"{dotted}: unknown key{hint} (valid keys here: {', '.join(valid)})"
    if kind == "union_tag_invalid":  # an objective or strategy name that is none of them
        ctx = err.get("ctx", {})
        key = f"{dotted}.{ctx.get('discriminator', '').strip(chr(39))}"
        tags = [t.strip(" '") for t in ctx.get("expected_tags", "").split(",")]
        close = difflib.get_close_matches(str(ctx.get("tag")), tags, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{key}: got {ctx.get('tag')!r}{hint} (allowed: {', '.join(tags)})"
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
        raw = load_yaml(_read_recipe_text(path))
    except UnicodeDecodeError:
        raise RecipeError(["the file is not UTF-8 text"], str(path)) from None
    except OSError as e:
        raise RecipeError([f"cannot read the recipe file: {e.strerror}"], str(path)) from None
    except (DuplicateKeyError, DocumentTooLarge) as e:
        raise RecipeError([str(e)], str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError([f"not valid YAML{where}: {_yaml_problem(e)}"], str(path)) from None
    if raw is None:
        raw = {}
    if isinstance(raw, dict) and overrides:
        raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, str(path), path.resolve().parent, path.resolve())


def _read_recipe_text(path: Path) -> str:
    """The recipe file's text, at most `MAX_RECIPE_BYTES` read (a device or a huge file named by
    mistake is refused, not read to its end)."""
    with open(path, "rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise OSError(0, f"it is larger than {MAX_RECIPE_BYTES // 1024} KiB; a recipe is a few KB of YAML")
    return data.decode("utf-8")


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
