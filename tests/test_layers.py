"""The package's layers: no import runs up them, and no import cycle exists, in fedflat's own source.

Read from the source with ``ast`` (every import statement, those inside functions and under ``TYPE_CHECKING``
included), so a lazy import that would close a cycle at run time is caught too.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import fedflat

ROOT = Path(fedflat.__file__).parent

# From the bottom up; a module may import its own layer and those below. The contract a method is written
# against (fedflat.core) imports nothing else of fedflat.
LAYERS: list[tuple[str, ...]] = [
    ("fedflat.core",),
    ("fedflat._version", "fedflat.files", "fedflat.progress", "fedflat.params", "fedflat.cliutil", "fedflat.privacy"),
    ("fedflat.data", "fedflat.models"),
    ("fedflat.algorithms",),
    ("fedflat.config", "fedflat.plugins"),
    ("fedflat.engine",),
    ("fedflat.metrics",),
    ("fedflat.experiments", "fedflat.bench", "fedflat.testing"),
    ("fedflat.api",),
    ("fedflat.flower", "fedflat.cli", "fedflat.__main__", "fedflat"),
]


# How a source file's imports are read is scripts/architecture_diagram.py's (its layer picture is drawn from them):
# one reader for the picture and for this check.
_spec = importlib.util.spec_from_file_location("architecture_diagram",
                                               ROOT.parent / "scripts" / "architecture_diagram.py")
diagram = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diagram)
module_name, imports = diagram.module_name, diagram.imported


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def layer_of(module: str) -> int:
    best = max(((i, prefix) for i, group in enumerate(LAYERS) for prefix in group
                if module == prefix or module.startswith(prefix + ".")), key=lambda ip: len(ip[1]), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) for name, path in found.items()}


def test_no_import_runs_up_the_layers():
    upward = [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
              for m, deps in graph().items() for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_contract_and_the_methods_import_only_the_contract():
    """fedflat.core imports nothing else of fedflat; the privacy package only fedflat.core; the methods only
    fedflat.core, the privacy package (the upload path's `dp` stage) and each other."""
    wrong = [f"{m} imports {d}" for m, deps in graph().items() for d in sorted(deps)
             if (m.startswith("fedflat.core") and not d.startswith("fedflat.core"))
             or (m.startswith("fedflat.privacy") and not d.startswith(("fedflat.core", "fedflat.privacy")))
             or (m.startswith("fedflat.algorithms")
                 and not d.startswith(("fedflat.core", "fedflat.privacy", "fedflat.algorithms")))]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt in edges and not state.get(nxt):
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if not state.get(start):
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_what_it_checks():
    """The graph holds the imports it must judge (a checker that reads nothing would pass everything)."""
    edges = graph()
    assert "fedflat.core" in edges["fedflat.algorithms.scaffold"]
    assert "fedflat.engine.simulation" in edges["fedflat.experiments.runner"]
    assert len(edges) > 100 and sum(map(len, edges.values())) > 250
