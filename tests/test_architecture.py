"""The layout's promises (docs/architecture.md), checked: each package imports only the layers
its row of the table allows, reading a recipe and planning memory import no torch, kernels/
stands alone, no objective or strategy is named outside its own package (and the catalog), and
every kernel of the catalog is wired everywhere its name is used."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ligertune.catalog.kernels import KERNEL_NAMES
from ligertune.catalog.objectives import OBJECTIVES
from ligertune.catalog.strategies import STRATEGIES
from ligertune.config import KernelsSection
from ligertune.patching.common import PATCHES
from ligertune.tools.bench.cases import SPECS
from tests.helpers import ROOT

PACKAGE = ROOT / "ligertune"

# The layer table of docs/architecture.md: what each package may import from the others at
# module level (besides itself). cli imports the rest lazily, inside its commands.
_UNDER_TRAINING = {
    "objectives", "distributed", "data", "lora", "patching", "models", "plan", "run", "config", "catalog",
    "errors", "paths", "files", "kernels",
}  # fmt: skip
LAYERS: dict[str, set[str]] = {
    "__main__": {"cli"},
    "cli": {"config", "catalog", "errors", "paths", "files", "run"},
    "tools": {"training", *_UNDER_TRAINING},
    "training": _UNDER_TRAINING,
    "objectives": {"lora", "patching", "data", "models", "catalog", "errors", "kernels"},
    "distributed": {"models", "data", "run", "config", "catalog", "errors"},
    "lora": {"patching", "models", "errors"},
    "patching": {"models", "catalog", "errors", "kernels"},
    "data": {"config", "catalog", "errors", "paths", "files"},
    "models": {"catalog", "errors", "paths"},
    "run": {"catalog", "errors", "files"},
    "config": {"catalog", "models", "errors", "paths"},
    "plan": {"catalog", "kernels"},
    "catalog": {"errors", "paths"},
    "errors": set(),
    "paths": set(),
    "files": set(),
    "__init__": set(),
}


def _imports(path: Path, nested: bool) -> set[str]:
    """The modules `path` imports: at module level, and with `nested` inside functions too.
    Imports under ``if TYPE_CHECKING:`` are for annotations and are not counted."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree) if nested else tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    if nested:  # ast.walk reaches TYPE_CHECKING blocks through the tree: take them out again
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                names -= _imports_of(node.body)
    return names


def _imports_of(body: list[ast.stmt]) -> set[str]:
    found = set()
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _package(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_each_package_imports_only_the_layers_below_it():
    """Module-level imports everywhere, and function-local ones too outside cli (where laziness
    is the point): a function-local import must not hide an upward dependency."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        source = _package(path)
        assert source in LAYERS, f"{source} is not in the layer table (docs/architecture.md and LAYERS)"
        for module in _imports(path, nested=source != "cli"):
            parts = module.split(".")
            if (
                parts[0] == "ligertune"
                and len(parts) > 1
                and parts[1] != source
                and parts[1] not in LAYERS[source]
            ):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)


def test_the_plan_imports_only_the_kernels_chunking_rules():
    """The memory plan is arithmetic: of kernels/ it reads the torch-free chunking rules only."""
    for path in (PACKAGE / "plan").rglob("*.py"):
        for module in _imports(path, nested=True):
            if module.startswith("ligertune.kernels"):
                assert module == "ligertune.kernels.chunking", (path.name, module)


@pytest.mark.parametrize(
    "code",
    [
        "from ligertune.config import load_recipe; load_recipe('recipes/quickstart-dpo.yaml')",
        "import ligertune.catalog.objectives, ligertune.catalog.strategies, ligertune.catalog.families",
        "from ligertune.plan.choose import choose; from ligertune.plan.recipe import base_setting",
    ],
    ids=["reading a recipe", "the catalog", "the memory plan"],
)
def test_imports_neither_torch_nor_transformers(code):
    check = f"import sys; {code}; print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_kernels_import_only_torch_and_triton():
    allowed_roots = {"torch", "triton", "__future__", "ligertune"}  # ligertune.kernels itself
    for path in (ROOT / "kernels").glob("*.py"):
        for module in _imports(path, nested=False):
            root = module.split(".")[0]
            assert root in allowed_roots or root in sys.stdlib_module_names, (path.name, module)
            if root == "ligertune":
                assert module.startswith("ligertune.kernels"), (path.name, module)


# Names that are also ordinary values elsewhere: "none" (quantize, fp8, a reference) and "kto"
# (a data format). A literal of them is a problem only where it is compared with the section.
_SHARED_WORDS = {"none", "kto"}
_OWNERS = {"objectives", "distributed", "catalog"}


def _component_literals(path: Path, root: Path = ROOT) -> list[str]:
    """Where `path` names an objective or a strategy: a string literal equal to one of their
    names, or (for the shared words) one compared with ``.name``/``.strategy``/``objective``."""
    names = set(OBJECTIVES.names) | set(STRATEGIES.names)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in names - _SHARED_WORDS:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            literals = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            chooser = any(k in text for k in (".strategy", "objective", ".name"))
            if chooser and literals & _SHARED_WORDS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_no_objective_or_strategy_is_named_outside_its_package():
    """Nothing outside objectives/, distributed/ and the catalog branches on an objective's or
    a strategy's name: they ask what the component declares instead (docs/architecture.md)."""
    found = [
        hit
        for path in PACKAGE.rglob("*.py")
        if _package(path) not in _OWNERS
        for hit in _component_literals(path)
    ]
    assert not found, "objective or strategy names outside their packages:\n" + "\n".join(found)


def test_the_name_check_finds_a_branch_on_a_name(tmp_path):
    """The check above can fail: a branch on a strategy's name and one on a shared word."""
    module = tmp_path / "ligertune" / "tools" / "bad.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def f(recipe):\n"
        "    if recipe.parallel.strategy == 'fsdp':\n"
        "        return 1\n"
        "    return recipe.parallel.strategy != 'none'\n"
    )
    hits = _component_literals(module, tmp_path)
    assert len(hits) == 2, hits  # the literal 'fsdp', and the comparison with the shared word 'none'


def test_every_catalog_kernel_is_a_recipe_key_a_patch_and_a_bench_case():
    assert tuple(KernelsSection.model_fields) == KERNEL_NAMES
    assert set(PATCHES) == set(KERNEL_NAMES), "every kernel of the catalog has a @patches function"
    for name in KERNEL_NAMES:
        assert name in SPECS, f"add a bench case named {name!r} to ligertune/tools/bench/cases.py"


def test_what_another_module_imports_has_a_public_name():
    """A helper another module imports is part of its module's interface: no leading underscore."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ligertune"):
                private += [
                    f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert not private, "private names imported from another module:\n" + "\n".join(private)
