"""The project's import graph: no cycle among its modules, not even through imports made for type hints
only, and the one-way dependency direction ``simulator <- heterog <- envs <- agents <- experiments``
(docs/design.md, "2. Layout").

Every module under the five packages is parsed with ``ast``; an edge is an ``import``, a ``from ... import``
or an ``importlib.import_module("literal")`` anywhere in the file (inside functions too). The runtime graph
leaves out what is imported under ``if TYPE_CHECKING:``; the full graph counts it, since a cycle of types
is a cycle of design. ``from a import b`` is an edge to ``a.b`` when that is a module of the project, else
to ``a``. Importing ``a.b`` also runs ``a/__init__``; that implicit edge is not counted (a package may
re-export its submodules). Plugins named in metadata (the ``heterog.planners`` entry point) are not imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("simulator", "heterog", "envs", "agents", "experiments")
LAYER = {name: i for i, name in enumerate(PACKAGES)}         # a package may import only layers below it


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, type_imports: bool = False):
    """(candidate names, line) for every imported name in ``tree``, TYPE_CHECKING blocks left out unless
    ``type_imports``: the first candidate that is a project module is the edge (``from a import b``:
    ``a.b``, else ``a``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not type_imports and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield [alias.name], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                yield [f"{prefix}.{alias.name}", prefix], node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield [node.args[0].value], node.lineno
        stack.extend(ast.iter_child_nodes(node))


def module_imports(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path],
                   type_imports: bool = False) -> dict[str, int]:
    """Project modules imported by ``module`` (parsed as ``tree``) -> line of the first such import
    (``type_imports``: count those under ``if TYPE_CHECKING:`` too)."""
    edges: dict[str, int] = {}
    for candidates, line in _imports(tree, module, is_package, type_imports):
        target = next((c for c in candidates if c in modules), None)
        if target is not None and target != module:
            edges[target] = min(line, edges.get(target, line))
    return edges


def import_graph(type_imports: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {imported project module: line of the first such import} (``type_imports``: the full
    graph, imports under ``if TYPE_CHECKING:`` counted)."""
    modules = project_modules()
    return {name: module_imports(ast.parse(path.read_text(), filename=str(path)), name,
                                 path.name == "__init__.py", modules, type_imports)
            for name, path in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}          # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"



def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + describe(cycle, graph)


def test_no_import_cycle_through_type_imports():
    """A cycle of types is a cycle of design: imports under ``if TYPE_CHECKING:`` count too."""
    graph = import_graph(type_imports=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (imports under TYPE_CHECKING counted): " + describe(cycle, graph)


def test_dependency_direction():
    graph = import_graph()
    upward = [f"{a} imports {b} (line {line})" for a, deps in sorted(graph.items()) for b, line in sorted(deps.items())
              if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert not upward, "imports against simulator <- heterog <- envs <- agents <- experiments:\n" + "\n".join(upward)


def test_find_cycle_names_the_cycle():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    cycle = find_cycle(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert describe(cycle, graph) == "a (line 3) -> b (line 5) -> c (line 7) -> a"
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_graph_sees_function_level_imports_and_type_imports_on_request():
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import heterog.cli\n"
           "def f():\n    from heterog import errors\n    import heterog.compare\n"
           "    from . import strategy\n    importlib.import_module('heterog.planners')\n")
    tree = ast.parse(src)
    modules = {name: Path() for name in ("heterog", "heterog.errors", "heterog.compare", "heterog.cli", "heterog.x",
                                         "heterog.strategy", "heterog.planners")}
    assert module_imports(tree, "heterog.x", False, modules) == {
        "heterog.errors": 5, "heterog.compare": 6, "heterog.strategy": 7, "heterog.planners": 8}
    assert module_imports(tree, "heterog.x", False, modules, type_imports=True) == {
        "heterog.cli": 3, "heterog.errors": 5, "heterog.compare": 6, "heterog.strategy": 7, "heterog.planners": 8}


def test_a_cycle_through_a_type_import_is_found():
    src = {"p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n",
           "p.b": "import p.a\n"}
    modules = {name: Path() for name in src}
    graph = {name: module_imports(ast.parse(text), name, False, modules, type_imports=True)
             for name, text in src.items()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]
    runtime = {name: module_imports(ast.parse(text), name, False, modules) for name, text in src.items()}
    assert find_cycle(runtime) is None


# what the baselines build on: none of it reaches up into heterog.baselines, not even for a type
BELOW_BASELINES = ("heterog.parallel", "heterog.strategy", "heterog.shares", "heterog.actions", "heterog.errors",
                   "heterog.atomic", "heterog.graph", "heterog.cluster", "heterog.cost", "heterog.compiler",
                   "heterog.scheduler")
# the search chains' machinery: run by heterog.baselines (mcmc, and ray_search on pool workers) alone;
# others may use chains.py's analyses of a graph (coupled_blocks, block_weights, group_loads)
CHAIN_RUNNERS = {"ActionSearch", "Chain", "ChainResult", "ChainState", "run_chain"}


def _below_baselines(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in BELOW_BASELINES)


def test_what_the_baselines_build_on_imports_no_baseline():
    graph = import_graph(type_imports=True)
    upward = [f"{a} imports {b} (line {line})" for a, deps in sorted(graph.items()) if _below_baselines(a)
              for b, line in sorted(deps.items()) if b == "heterog.baselines" or b.startswith("heterog.baselines.")]
    assert not upward, "modules below heterog.baselines import it:\n" + "\n".join(upward)


def chain_runner_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every import of the search chains' machinery in ``tree``: a chain runner taken from
    ``heterog.baselines.chains``, or ``heterog.baselines.ray_search`` itself."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "heterog.baselines.chains":
            found += [(alias.name, node.lineno) for alias in node.names if alias.name in CHAIN_RUNNERS]
        elif isinstance(node, ast.ImportFrom) and node.module == "heterog.baselines":
            found += [(alias.name, node.lineno) for alias in node.names if alias.name == "ray_search"]
        elif isinstance(node, ast.ImportFrom) and node.module == "heterog.baselines.ray_search":
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names
                      if alias.name in ("heterog.baselines.chains", "heterog.baselines.ray_search")]
    return found


def test_only_the_baselines_run_search_chains():
    offenders = [f"{name} imports {what} (line {line})" for name, path in sorted(project_modules().items())
                 if not name.startswith("heterog.baselines")
                 for what, line in chain_runner_imports(ast.parse(path.read_text(), filename=str(path)))]
    assert not offenders, "search chains run outside heterog.baselines:\n" + "\n".join(offenders)


def test_chain_runner_imports_are_found():
    src = ("from heterog.baselines.chains import coupled_blocks, run_chain\n"
           "def f():\n    from heterog.baselines.ray_search import SearchWorker\n"
           "import heterog.baselines.chains\nfrom heterog.baselines import ray_search\n")
    assert sorted(chain_runner_imports(ast.parse(src)), key=lambda hit: hit[1]) == [
        ("run_chain", 1), ("SearchWorker", 3), ("heterog.baselines.chains", 4), ("ray_search", 5)]


MAX_MODULE_LINES = 600
PACKAGES = ("heterog", "simulator", "envs", "agents", "experiments")


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Modules of the project's packages under ``root`` longer than ``limit`` lines, with their lengths."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                out[str(path.relative_to(root))] = n
    return out


def test_no_module_is_over_600_lines():
    assert long_modules(ROOT) == {}


def test_a_long_module_is_found(tmp_path):
    (tmp_path / "heterog").mkdir()
    (tmp_path / "heterog" / "big.py").write_text("x = 1\n" * 601)
    (tmp_path / "heterog" / "small.py").write_text("x = 1\n" * 600)
    assert long_modules(tmp_path) == {"heterog/big.py": 601}
