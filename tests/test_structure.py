"""The package's structure (docs/design/DESIGN.md, "Layers"): imports point down only, no import cycles.

Read statically from the sources (``ast``), so a lazy import inside a function counts like a top-level one: a
cycle hidden in a function body is still a cycle for the next reader.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "python"
TECHNIQUES = ("verification", "estimator", "budget", "tts", "kernels", "sampling", "timing")
FORBIDDEN_IN_TECHNIQUES = ("transformers", "sglang")


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is_package_init) for every module of ``specadapt``."""
    out = {}
    for path in sorted((SRC / "specadapt").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _imports(name: str, path: pathlib.Path, is_pkg: bool) -> set[str]:
    """Every absolute module name ``name``'s file imports (any depth in the file, relative imports resolved,
    ``importlib.import_module`` of a string constant included)."""
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = {  # module-level NAME = "string", for importlib.import_module(NAME)
        target.id: node.value.value
        for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets if isinstance(target, ast.Name) and isinstance(node.value.value, str)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and getattr(node.func, "attr",
                                                                getattr(node.func, "id", None)) == "import_module":
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in constants:
                found.add(constants[arg.id])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, tuple[pathlib.Path, bool]]]:
    mods = _modules()
    graph = {m: {t for t in _imports(m, *mods[m]) if t in mods and t != m} for m in mods}
    return graph, mods


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_import_cycle():
    """No two modules import each other, directly or through others (imports of a package's ``__init__``,
    which re-exports its submodules, are left out: they are not a dependency between two modules' code)."""
    graph, mods = _graph()
    modules_only = {m: {t for t in targets if not mods[t][1]} for m, targets in graph.items()}
    assert _cycles(modules_only) == []


def test_no_subpackage_import_cycle():
    """Between the top-level parts of the package (``specadapt.kernels``, ``specadapt.estimator``, ...) the
    imports point one way only."""
    graph, _ = _graph()

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    collapsed: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "specadapt":
            continue
        node = collapsed.setdefault(top(module), set())
        node.update(top(t) for t in targets if t != "specadapt" and top(t) != top(module))
    for targets in list(collapsed.values()):
        for target in targets:
            collapsed.setdefault(target, set())
    assert _cycles(collapsed) == []


@pytest.mark.parametrize("part", TECHNIQUES)
def test_techniques_import_neither_transformers_nor_sglang(part):
    mods = _modules()
    for module, (path, is_pkg) in mods.items():
        if module != f"specadapt.{part}" and not module.startswith(f"specadapt.{part}."):
            continue
        imported = _imports(module, path, is_pkg)
        bad = sorted(i for i in imported if i.split(".")[0] in FORBIDDEN_IN_TECHNIQUES)
        bad += sorted(i for i in imported if i.startswith(("specadapt.engine", "specadapt.sglang", "specadapt.cli")))
        assert not bad, f"{module} imports {bad}"


def test_sglang_is_imported_only_by_the_plugin():
    for module, (path, is_pkg) in _modules().items():
        if module.startswith("specadapt.sglang"):
            continue
        bad = sorted(i for i in _imports(module, path, is_pkg) if i.split(".")[0] == "sglang")
        assert not bad, f"{module} imports {bad} (only specadapt.sglang may import sglang)"
