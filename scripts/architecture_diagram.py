"""docs/architecture.md's two diagrams, drawn from the code and the page, never by hand.

- ``docs/figures/layers.svg``: the layers of the page's table, bottom up, and an arrow for every pair of layers one
  imports the other at (read from the package's source with ``ast``; a lower layer never imports a higher one, which
  tests/test_layers.py checks).
- ``docs/figures/round.svg``: one round's journey, the page's numbered steps in order, each with the functions its
  anchors cite (``[A11]`` -> ``run_round``, ``fedflat/engine/simulation.py``; an anchor citing a call names the call).

    python scripts/architecture_diagram.py            # (re)write both files
    python scripts/architecture_diagram.py --check    # exit 1 if either differs from what the code gives now

tests/test_architecture.py runs the check, so the pictures stay as true as the tables.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "fedflat"
FIGURES = ROOT / "docs" / "figures"
FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'


def layers(page: str) -> list[tuple[str, ...]]:
    """The page's layer table: the packages of each layer, bottom (0) up."""
    rows = re.findall(r"^\| (\d+) \| (.+?) \| .+ \|$", page, flags=re.M)
    return [tuple(re.findall(r"`([\w.]+)`", packages)) for _, packages in rows]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, known: set[str]) -> set[str]:
    """The fedflat modules (or packages) a source file imports, relative imports resolved (``from pkg import mod``
    imports ``pkg.mod`` where that is one of the ``known`` modules)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fedflat")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            if base.split(".")[0] == "fedflat":
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return found - {name}


def layer_of(module: str, table: list[tuple[str, ...]]) -> int | None:
    """The layer of the longest table entry that is ``module`` or a package above it."""
    best = max(((len(p), i) for i, group in enumerate(table) for p in group
                if module == p or module.startswith(p + ".")), default=None)
    return None if best is None else best[1]


def layer_imports(table: list[tuple[str, ...]]) -> dict[tuple[int, int], int]:
    """``(importing layer, imported layer) -> number of modules`` of the importing layer that import the other."""
    edges: dict[tuple[int, int], set[str]] = {}
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    for path in paths:
        source = layer_of(module_name(path), table)
        for target in imported(path, known):
            dest = layer_of(target, table)
            if source is not None and dest is not None and dest != source:
                edges.setdefault((source, dest), set()).add(module_name(path))
    return {pair: len(mods) for pair, mods in sorted(edges.items())}


def _text(x: float, y: float, text: str, size: int = 13, weight: str = "normal", anchor: str = "start",
          fill: str = "#1f2328") -> str:
    return (f'<text x="{x:g}" y="{y:g}" {FONT} font-size="{size}" font-weight="{weight}" text-anchor="{anchor}" '
            f'fill="{fill}">{escape(text)}</text>')


ARROW = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
         'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#57606a"/></marker></defs>')


def layers_svg(page: str) -> str:
    table = layers(page)
    edges = layer_imports(table)
    row, gap, left, width = 34, 8, 20, 650
    top = 74
    y_of = {i: top + (len(table) - 1 - i) * (row + gap) for i in range(len(table))}  # layer 0 at the bottom
    grid, cell = left + width + 30, 26
    total_w = grid + cell * len(table) + 20
    total_h = top + len(table) * (row + gap) + 16
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
           f'viewBox="0 0 {total_w} {total_h}" role="img" aria-label="fedflat layers and the imports between them">',
           f'<rect width="{total_w}" height="{total_h}" fill="#ffffff"/>',
           _text(left, 24, "fedflat's layers (docs/architecture.md) and the imports between them", 15, "bold"),
           _text(left, 42, "a dot: modules of the row's layer import the column's (read from the source); a module "
                 "imports only its own layer and those below", 11, fill="#57606a"),
           _text(grid + cell * len(table) / 2, top - 22, "imports layer", 11, anchor="middle", fill="#57606a")]
    for j in range(len(table)):
        out.append(_text(grid + cell * j + cell / 2, top - 6, f"{j}", 12, "bold", anchor="middle"))
    for i, group in enumerate(table):
        y = y_of[i]
        shade = "#ddf4ff" if i % 2 == 0 else "#f6f8fa"
        out.append(f'<rect class="layer" x="{left}" y="{y}" width="{width}" height="{row}" rx="6" fill="{shade}" '
                   f'stroke="#57606a"/>')
        out.append(_text(left + 10, y + 22, f"{i}", 14, "bold"))
        out.append(_text(left + 34, y + 22, ", ".join(group), 12))
        for j in range(len(table)):
            cx, cy = grid + cell * j + cell / 2, y + row / 2
            if (i, j) in edges:
                out.append(f'<circle class="import" cx="{cx:g}" cy="{cy:g}" r="7" fill="#0969da">'
                           f'<title>layer {i} imports layer {j}: {edges[i, j]} modules</title></circle>')
            else:
                out.append(f'<circle cx="{cx:g}" cy="{cy:g}" r="2" fill="#d0d7de"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def journey(page: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The page's steps of one round: ``(title, [(name, file)])`` in order, the names its anchors cite."""
    anchors = {a: (call or qualname.split(".")[-1], module.replace(".", "/") + ".py") for a, module, qualname, call in
               re.findall(r"^- (A\d+) `([\w.]+):([\w.]+)`(?: calls `([^`]+)`)?$", page, flags=re.M)}
    section = page.split("## One round's journey", 1)[1].split("\n## ", 1)[0]
    steps = re.split(r"^\d+\. ", section, flags=re.M)[1:]
    found = []
    for step in steps:
        title = re.match(r"\*\*(.+?)\*\*", step).group(1)
        cited = list(dict.fromkeys(re.findall(r"\[(A\d+)\]", step)))
        found.append((title, [(anchors[a][0], anchors[a][1].removeprefix("fedflat/")) for a in cited]))
    return found


def round_svg(page: str) -> str:
    steps = journey(page)
    left, width, line, pad, gap = 20, 640, 17, 10, 26
    y, boxes = 50, []
    for title, names in steps:
        height = pad * 2 + 20 + line * len(names)
        boxes.append((y, height, title, names))
        y += height + gap
    total_w, total_h = left + width + 120, y + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
           f'viewBox="0 0 {total_w} {total_h}" role="img" aria-label="one round of fedflat, step by step">',
           ARROW, f'<rect width="{total_w}" height="{total_h}" fill="#ffffff"/>',
           _text(left, 24, "One round's journey (the steps and anchors of docs/architecture.md)", 15, "bold"),
           _text(left, 40, "each step: the functions it runs, and where they live under fedflat/", 11,
                 fill="#57606a")]
    for k, (top, height, title, names) in enumerate(boxes):
        out.append(f'<rect class="step" x="{left}" y="{top}" width="{width}" height="{height}" rx="6" '
                   f'fill="{"#ddf4ff" if k % 2 == 0 else "#f6f8fa"}" stroke="#57606a"/>')
        out.append(_text(left + 12, top + pad + 14, f"{k + 1}. {title}", 14, "bold"))
        for j, (name, path) in enumerate(names):
            base = top + pad + 20 + line * (j + 1) - 3
            out.append(_text(left + 28, base, name, 12, "bold", fill="#0550ae"))
            out.append(_text(left + 330, base, path, 11, fill="#57606a"))
        if k + 1 < len(boxes):
            x = left + width / 2
            out.append(f'<path d="M {x:g} {top + height} V {boxes[k + 1][0] - 2}" stroke="#57606a" '
                       f'stroke-width="1.5" marker-end="url(#arrow)"/>')
    if len(boxes) > 1:  # the next round starts where this one committed
        first, last = boxes[1], boxes[-1]
        x = left + width + 40
        out.append(f'<path d="M {left + width} {last[0] + last[1] / 2:g} H {x} V {first[0] + first[1] / 2:g} '
                   f'H {left + width + 2}" fill="none" stroke="#57606a" stroke-width="1.5" stroke-dasharray="5 3" '
                   f'marker-end="url(#arrow)"/>')
        out.append(_text(x + 6, (last[0] + first[0]) / 2 + 40, "round", 11, fill="#57606a"))
        out.append(_text(x + 6, (last[0] + first[0]) / 2 + 54, "t + 1", 11, fill="#57606a"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render() -> dict[Path, str]:
    page = PAGE.read_text()
    return {FIGURES / "layers.svg": layers_svg(page), FIGURES / "round.svg": round_svg(page)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs from what the code gives")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} is stale: run python scripts/architecture_diagram.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
