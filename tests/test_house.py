"""The house rules (CONTRIBUTING.md, rules 2, 5, 6, 12) that code can check: imports point one
way (no cycles, lazy imports inside functions included; packages in layers, ARCHITECTURE.md),
modules stay small and functions short, rewrite/ parses no labels (no regular expressions)
and uses the ONNX libraries' public APIs only, the delivery packages edit graphs through
onnx-ir alone."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "mha_onnx"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """mha_onnx modules that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles_lazy_imports_included():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        stack, seen = list(graph[start]), set()
        while stack:
            current = stack.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                stack.extend(graph[current])
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, cycles


# The packages in layers, the lowest first (ARCHITECTURE.md): a package imports its own layer
# and the ones below, never one above, and no two packages import each other.
LAYERS = (
    {"mha_onnx", "errors", "config", "stats", "table"},
    {"runtime"},
    {"graph"},
    {"rewrite", "reference"},
    {"generate", "quantize", "package", "serve", "profile"},
    {"parity", "tune"},
    {"export"},
    {"cli"},
)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_import_down_their_layers_and_never_both_ways():
    modules = _modules()
    layer = {name: n for n, names in enumerate(LAYERS) for name in names}
    edges = {(_package(name), _package(target)) for name, path in modules.items()
             for target in _imports(name, path, modules) if _package(name) != _package(target)}
    assert {p for edge in edges for p in edge} <= set(layer), "a package is in no layer"
    upward = sorted(f"{a} -> {b}" for a, b in edges if layer[b] > layer[a])
    both = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not upward, upward
    assert not both, both


def test_modules_stay_small_and_functions_short():
    long_modules = {p.name: n for p in PACKAGE.rglob("*.py")
                    if (n := len(p.read_text().splitlines())) > 400}
    long_functions = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.end_lineno - node.lineno + 1 > 60:
                long_functions.append(f"{path.name}:{node.name}")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_rewrite_parses_no_labels_and_uses_public_onnxscript():
    for path in (PACKAGE / "rewrite").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module or "" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)}
        assert "re" not in modules, f"{path.name} uses regular expressions"
        private = [m for m in modules if m.startswith("onnxscript") and "._" in m]
        assert not private, f"{path.name} imports onnxscript's private {private}"


def test_no_private_api_of_onnx_runtime_or_the_onnx_libraries():
    """Nothing imports a private module of onnx, onnx-ir, onnxscript or ONNX Runtime, nor
    ONNX Runtime's scripts (``onnxruntime.tools``: shapes.py drove the private internals of
    its SymbolicShapeInference until graph/symbolic/ replaced it)."""
    libraries = ("onnx", "onnx_ir", "onnxscript", "onnxruntime")
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module or "" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)}
        ours = [m for m in modules if m.split(".")[0] in libraries]
        private = [m for m in ours if "._" in m or m.startswith("onnxruntime.tools")]
        assert not private, f"{path.relative_to(PACKAGE)} imports {private}"


def test_delivery_edits_graphs_through_onnx_ir_only():
    """quantize/, tune/ and generate/ edit graphs with onnx-ir, never onnx.helper's
    NodeProto builders (one graph API; numpy_helper's tensor conversions are fine)."""
    for package in ("quantize", "tune", "generate"):
        for path in (PACKAGE / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            helper = [node.lineno for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module == "onnx"
                      and any(alias.name == "helper" for alias in node.names)]
            helper += [node.lineno for node in ast.walk(tree)
                       if isinstance(node, ast.Attribute) and node.attr == "helper"
                       and isinstance(node.value, ast.Name) and node.value.id == "onnx"]
            assert not helper, f"{path.relative_to(PACKAGE)} uses onnx.helper (line {helper})"


# Tests of more than one stage (a KV cache from export to profile; property tests over
# graphs nobody here wrote) and of the house itself stay at the top of tests/.
ACROSS_STAGES = {"test_house.py", "test_properties.py", "test_cache.py",
                 "test_export_memo.py"}  # (the suite's own remembered exports)


def test_tests_mirror_the_packages():
    """A test module sits in the folder of the package it tests (tests/rewrite/ for
    mha_onnx/rewrite/, tests/tools/ for tools/), so that a change's tests are found by
    where the change is."""
    tests = Path(__file__).parent
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"tools"}
    top = {p.name for p in tests.glob("test_*.py")}
    assert top <= ACROSS_STAGES, f"move {sorted(top - ACROSS_STAGES)} into tests/<package>/"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= packages, f"tests/{sorted(folders - packages)} mirror no package"
