"""The layers of DESIGN.md as a test: no import cycles, and every import points down.

The checker reads the source (`ast`; nothing is imported or run) of every module
of the library's packages. Module-level, function-level (lazy) and
`TYPE_CHECKING` imports all count: each is a dependency a reader must follow.
`importlib.import_module(name)` calls are not import statements and do not
count (the plugin loader finds the built-in policies by name that way).

The rules are data (`MAY_IMPORT`, `JAX_IMPORTERS`, `JAX_FREE_ONLY`, `FACE`),
and the checker takes any tree: the last tests plant a cycle and upward imports
in a small fake tree, and in a copy of the real one, and see it report exactly
those.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import shutil
import textwrap
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orca_jax", "policies", "pallas_kernels", "experiments")  # what is checked
REPOSITORY = PACKAGES + ("benchmarks", "tests")  # top-level names of this repository's code
JAX_FAMILY = ("jax", "jaxlib", "flax", "optax", "orbax")


def _tree(*packages: str) -> tuple[str, ...]:
    """Patterns of each package and every module under it."""
    return tuple(p for package in packages for p in (package, package + ".*"))


# The package face and the old-path aliases re-export every part: no layer rule for them
# (the cycle rule and the jax rule still hold).
FACE = ("orca_jax", "orca_jax._legacy")
_BOTTOM = _tree("orca_jax.core", "orca_jax.specs")
# Each part -> patterns of this repository's modules it may import (besides its own).
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "orca_jax.core": (),
    # The core's own folders, in layers that only look down (docs/architecture.md):
    # requests and the step contract at the bottom, then KV memory, the plans and the
    # view, the policy API, and the loop on top.
    "orca_jax.core.requests": (),
    "orca_jax.core.step": (),
    "orca_jax.core.kv": _tree("orca_jax.core.requests"),
    "orca_jax.core.plans": _tree("orca_jax.core.requests", "orca_jax.core.step",
                                 "orca_jax.core.kv"),
    "orca_jax.core.api": _tree("orca_jax.core.requests", "orca_jax.core.step",
                               "orca_jax.core.kv", "orca_jax.core.plans"),
    "orca_jax.core.loop": _tree("orca_jax.core.requests", "orca_jax.core.step",
                                "orca_jax.core.kv", "orca_jax.core.plans", "orca_jax.core.api"),
    "orca_jax.specs": (),
    "orca_jax.workloads": _BOTTOM,
    "orca_jax.sim": _BOTTOM + _tree("pallas_kernels"),  # jax-free ones only: JAX_FREE_ONLY
    "orca_jax.model": _BOTTOM + _tree("pallas_kernels"),
    "orca_jax.learned": _BOTTOM,
    "orca_jax.cluster": _BOTTOM,
    "orca_jax.results": _BOTTOM,
    "orca_jax.runner": _tree("orca_jax"),
    "orca_jax.serving": _tree("orca_jax"),  # beside the runner, at the top
    "policies": ("orca_jax", *_tree("orca_jax.core"), "orca_jax.learned.length_predictor",
                 "orca_jax.cluster.routing", "orca_jax.cluster.rebalancing",
                 "orca_jax.cluster.planning"),
    "pallas_kernels": (),
    "experiments": _tree("orca_jax", "policies", "pallas_kernels"),
}
# The modules that may import jax, flax, optax or orbax.
JAX_IMPORTERS = (_tree("orca_jax.model", "pallas_kernels", "orca_jax.runner", "experiments")
                 + ("orca_jax.learned.ranker",))
# Part -> patterns of modules it may import only where those import nothing of JAX_FAMILY.
JAX_FREE_ONLY: dict[str, tuple[str, ...]] = {"orca_jax.sim": _tree("pallas_kernels")}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` loads `imported` (at `line`)."""

    importer: str
    imported: str  # a module of the checked tree, or the dotted name as written
    line: int = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Violation:
    """An import that breaks a rule."""

    importer: str
    imported: str
    rule: str = dataclasses.field(compare=False)
    line: int = dataclasses.field(compare=False)

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.imported}: {self.rule}"


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> source file, for every module of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def read_imports(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    """Every import statement of every module, anywhere in its source, as edges."""
    modules = module_files(root, packages)
    edges: dict[Import, Import] = {}
    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([node.module] if node.module else []))
                # `from pkg import name` loads the module pkg.name when there is one.
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            else:
                continue
            for name in names:
                edge = Import(module, name, node.lineno)
                edges.setdefault(edge, edge)
    return list(edges.values())


def find_cycles(imports: list[Import]) -> list[tuple[str, ...]]:
    """One ring `(a, b, ..., a)` for each set of modules that import each other.

    A set is a strongly connected component of the import graph; its ring is
    the shortest one through its first module by name.
    """
    graph: dict[str, list[str]] = {}
    for edge in imports:
        graph.setdefault(edge.importer, [])
    for edge in imports:
        if edge.imported in graph:
            graph[edge.importer].append(edge.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    rings = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        paths = {start: (start,)}  # breadth-first inside the component, back to `start`
        frontier = [start]
        ring: Optional[tuple[str, ...]] = None
        while ring is None:
            following = []
            for module in frontier:
                for other in sorted(graph[module]):
                    if other == start and ring is None:
                        ring = paths[module] + (start,)
                    elif other in component and other not in paths:
                        paths[other] = paths[module] + (other,)
                        following.append(other)
            frontier = following
        rings.append(ring)
    return sorted(rings)


def _within(module: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns)


def _part_of(module: str) -> Optional[str]:
    parts = [part for part in MAY_IMPORT if _within(module, _tree(part))]
    return max(parts, key=len) if parts else None


def layer_violations(imports: list[Import]) -> list[Violation]:
    """The imports that break the rules at the top of this file."""
    jax_users = {edge.importer for edge in imports
                 if edge.imported.split(".")[0] in JAX_FAMILY}
    found = []
    for edge in imports:
        importer, imported, top = edge.importer, edge.imported, edge.imported.split(".")[0]
        part = _part_of(importer)
        if top in JAX_FAMILY:
            rule = None if _within(importer, JAX_IMPORTERS) else (
                f"jax, flax, optax and orbax only in {', '.join(JAX_IMPORTERS)}")
        elif top not in REPOSITORY or importer in FACE:
            rule = None
        elif part is None:
            rule = f"{importer} is in no layer (one of {', '.join(MAY_IMPORT)})"
        elif _within(imported, _tree(part)):
            rule = None
        elif not _within(imported, MAY_IMPORT[part]):
            rule = (f"{part} may import only "
                    f"{', '.join(MAY_IMPORT[part]) or 'itself'} of this repository")
        elif _within(imported, JAX_FREE_ONLY.get(part, ())) and imported in jax_users:
            rule = (f"{part} may import only the modules of {', '.join(JAX_FREE_ONLY[part])} "
                    "that import no jax")
        else:
            rule = None
        if rule is not None:
            found.append(Violation(importer, imported, rule, edge.line))
    return found


# ------------------------------------------------------------------ the real tree

def test_no_import_cycles():
    rings = find_cycles(read_imports(ROOT))
    assert not rings, "import cycles (each module imports the next):\n" + "\n".join(
        " -> ".join(ring) for ring in rings)


def test_every_import_points_down_the_layers():
    bad = layer_violations(read_imports(ROOT))
    assert not bad, "imports against the layers:\n" + "\n".join(map(str, bad))


def test_every_library_module_lives_in_a_subpackage():
    flat = sorted(path.name for path in (ROOT / "orca_jax").glob("*.py"))
    assert flat == ["__init__.py", "_legacy.py"]
    subpackages = {path.parent.name for path in (ROOT / "orca_jax").glob("*/__init__.py")}
    assert {part.split(".")[1] for part in MAY_IMPORT if part.startswith("orca_jax.")} == (
        subpackages)  # every subpackage has its rule, and every rule its subpackage


def test_every_subpackage_says_what_it_may_import():
    for init in sorted((ROOT / "orca_jax").glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in docstring, (
            f"{init.relative_to(ROOT)}: its docstring does not say what it may import")


def test_the_checker_sees_every_module_and_every_import_form():
    modules = module_files(ROOT)
    assert {"orca_jax", "orca_jax.core.loop.scheduler", "policies.orca",
            "pallas_kernels.ragged_paged_attention", "experiments.reproduce.common"} <= set(modules)
    edges = {(edge.importer, edge.imported) for edge in read_imports(ROOT)}
    # lazy (inside a function), from a package's module, and plain module-level imports
    assert ("orca_jax.learned.length_predictor", "orca_jax.learned.ranker") in edges
    assert ("orca_jax.model.llama", "pallas_kernels.ragged_paged_attention") in edges
    assert ("orca_jax.core.loop.scheduler", "orca_jax.core.plans.view") in edges


# ------------------------------------------------------------ planted violations

def _write(root: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_a_planted_cycle_and_upward_imports_are_reported_exactly(tmp_path):
    _write(tmp_path, {
        "orca_jax/__init__.py": "from orca_jax.core.a import thing\n",
        "orca_jax/core/__init__.py": '"""May import: itself."""\n',
        "orca_jax/core/a.py": "from orca_jax.core.b import other\n",
        "orca_jax/core/b.py": """
            def other():
                from orca_jax.core import a  # lazy, and it closes a ring
            """,
        "orca_jax/core/c.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from orca_jax.results.metrics import summarize  # upward
            """,
        "orca_jax/results/__init__.py": "",
        "orca_jax/results/metrics.py": "import numpy as np\nfrom orca_jax.core.a import thing\n",
        "orca_jax/results/summary.py": "from . import metrics\nfrom .metrics import np\n",
        "orca_jax/sim/__init__.py": "import pallas_kernels\n",
        "orca_jax/sim/engine.py": "from pallas_kernels import kernel\n",
        "pallas_kernels/__init__.py": "",
        "pallas_kernels/kernel.py": "import jax\n",
        "policies/__init__.py": "from orca_jax import thing\n",
        "policies/bad.py": "def f():\n    import jax.numpy as jnp\n",
        "experiments/__init__.py": "",
    })
    imports = read_imports(tmp_path)
    assert ("orca_jax.results.summary", "orca_jax.results.metrics") in {
        (edge.importer, edge.imported) for edge in imports}  # relative imports resolve
    assert find_cycles(imports) == [("orca_jax.core.a", "orca_jax.core.b", "orca_jax.core.a")]
    bad = layer_violations(imports)
    assert bad == [Violation("orca_jax.core.c", "orca_jax.results.metrics", "", 0),
                   Violation("orca_jax.sim.engine", "pallas_kernels.kernel", "", 0),
                   Violation("policies.bad", "jax.numpy", "", 0)]
    assert [str(v) for v in bad] == [
        "orca_jax.core.c (line 4) imports orca_jax.results.metrics: orca_jax.core may import "
        "only itself of this repository",
        "orca_jax.sim.engine (line 1) imports pallas_kernels.kernel: orca_jax.sim may import "
        "only the modules of pallas_kernels, pallas_kernels.* that import no jax",
        f"policies.bad (line 2) imports jax.numpy: jax, flax, optax and orbax only in "
        f"{', '.join(JAX_IMPORTERS)}",
    ]


def test_an_upward_import_planted_in_a_copy_of_the_library_is_reported(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    before = read_imports(tmp_path)
    planted = tmp_path / "orca_jax" / "core" / "requests" / "request.py"
    planted.write_text(planted.read_text()
                       + "\n\ndef _planted():\n    from orca_jax.results import summary\n")
    after = read_imports(tmp_path)

    new = set(layer_violations(after)) - set(layer_violations(before))
    assert new == {Violation("orca_jax.core.requests.request", "orca_jax.results.summary", "", 0)}
    # summary reads requests, so the planted import also closes a ring through both.
    new_rings = set(find_cycles(after)) - set(find_cycles(before))
    ring_members = {"orca_jax.core.requests.request", "orca_jax.results.summary"}
    assert new_rings and all(ring_members <= set(ring) for ring in new_rings)


@pytest.mark.parametrize("planted_in, imported, part", [
    ("kv/pool.py", "orca_jax.core.plans.plan_checks", "orca_jax.core.kv"),
    ("plans/view.py", "orca_jax.core.loop.scheduler", "orca_jax.core.plans"),
    ("requests/request_table.py", "orca_jax.core.kv.pool", "orca_jax.core.requests"),
])
def test_an_upward_import_between_the_core_s_folders_is_reported(tmp_path, planted_in, imported,
                                                                  part):
    shutil.copytree(ROOT / "orca_jax", tmp_path / "orca_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = set(layer_violations(read_imports(tmp_path, ("orca_jax",))))
    planted = tmp_path / "orca_jax" / "core" / planted_in
    module, name = imported.rsplit(".", 1)
    planted.write_text(planted.read_text()
                       + f"\n\ndef _planted():\n    from {module} import {name}\n")
    new = set(layer_violations(read_imports(tmp_path, ("orca_jax",)))) - before
    importer = "orca_jax.core." + planted_in.removesuffix(".py").replace("/", ".")
    assert new == {Violation(importer, imported, "", 0)}
    assert next(iter(new)).rule.startswith(f"{part} may import only ")
