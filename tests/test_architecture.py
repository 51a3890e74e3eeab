"""The layout's promises (docs/architecture.md), checked: the packages import in one direction,
reading a recipe imports no torch, kernels/ stands alone, and every kernel of the registry is
wired everywhere its name is used."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ligertune.config import KernelsSection
from ligertune.patching.registry import KERNEL_NAMES, KERNELS
from ligertune.tools.bench.cases import SPECS
from tests.helpers import ROOT

PACKAGE = ROOT / "ligertune"


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported by `path` at module level. Imports under ``if TYPE_CHECKING:`` are not
    statements of the module body and are not counted: they exist for annotations only."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            names.add(".")  # relative: a module of the same package
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "ligertune" and len(parts) > 1 else None


def test_packages_import_each_other_without_cycles():
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in _top_level_imports(path):
            target = _package_of(module)
            if target is not None and target != source:
                edges[source].add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    cycles = sorted(p for p in list(edges) if reaches(p, p, {p}))
    assert not cycles, f"packages on an import cycle: {cycles}; edges: {dict(edges)}"


def test_reading_a_recipe_imports_neither_torch_nor_transformers():
    code = (
        "import sys; from ligertune.config import load_recipe; "
        "load_recipe('recipes/quickstart.yaml'); "
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_kernels_import_only_torch_and_triton():
    allowed_roots = {"torch", "triton", "__future__", "ligertune"}  # ligertune.kernels itself
    for path in (ROOT / "kernels").glob("*.py"):
        for module in _top_level_imports(path):
            if module == ".":
                continue
            root = module.split(".")[0]
            assert root in allowed_roots or root in sys.stdlib_module_names, (path.name, module)
            if root == "ligertune":
                assert module.startswith("ligertune.kernels"), (path.name, module)


def test_every_registry_kernel_is_a_recipe_key_a_patch_and_a_bench_case():
    assert tuple(KernelsSection.model_fields) == KERNEL_NAMES
    for entry in KERNELS:
        assert callable(entry.patch_function()), entry.name
        assert entry.name in SPECS, f"add a bench case named {entry.name!r} to ligertune/tools/bench/cases.py"
