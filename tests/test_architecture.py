"""docs/architecture.md against the code: its layer table is tests/test_layers.py's, its anchors still point at the
names they cite; and docs/extending.md's hand-check recipe gives one round's per-client updates."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def test_the_layer_table_is_the_one_tests_check():
    rows = re.findall(r"^\| (\d+) \| (.+?) \| .+ \|$", PAGE, flags=re.M)
    table = [tuple(re.findall(r"`([\w.]+)`", packages)) for _, packages in rows]
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS)))
    assert table == [tuple(layer) for layer in LAYERS]


def test_every_anchor_points_at_the_name_it_cites():
    anchors = re.findall(r"^- (A\d+) `([\w/.]+):(\d+)` `([^`]+)`$", PAGE, flags=re.M)
    assert anchors and [a for a, *_ in anchors] == [f"A{i}" for i in range(1, len(anchors) + 1)]
    cited = set(re.findall(r"\[(A\d+)\]", PAGE))
    assert cited == {a for a, *_ in anchors}, "every anchor is cited, and every citation listed"
    stale = []
    for label, path, line, name in anchors:
        text = (ROOT / path).read_text().splitlines()[int(line) - 1]
        if name not in text:
            stale.append(f"{label} {path}:{line} does not hold {name!r}: {text.strip()!r}")
    assert not stale, "docs/architecture.md's anchors moved; update them:\n" + "\n".join(stale)


def test_the_hand_check_recipe_gives_the_rounds_per_client_updates():
    """The recipe of docs/extending.md ("Checking a round by hand"): FedAvg with uniform weights moves the model by
    the clients' mean update, to float32 rounding of one mean of three rows."""
    from fedflat.core import MODEL
    from fedflat.engine.simulation import Simulation
    from fedflat.testing import TINY

    extending = (ROOT / "docs" / "extending.md").read_text()
    recipe = re.search(r"## Checking a round by hand.*?```python\n(.*?)```", extending, flags=re.S).group(1)
    scope: dict = {}
    exec(recipe, scope)  # the documented code, as written
    sim, deltas, w_before, opened = scope["sim"], scope["deltas"], scope["w_before"], scope["opened"]
    assert isinstance(sim, Simulation) and scope["MODEL"] == MODEL and scope["TINY"] is TINY
    assert deltas.shape == (3, sim.w.numel()) and torch.equal(scope["result"].ids, opened.ctx.sampled.cpu())
    expected = w_before + deltas.mean(0)
    assert torch.allclose(sim.w, expected, rtol=0, atol=8 * 2.0 ** -24 * float(w_before.abs().max() + 1))
    assert not torch.equal(sim.w, w_before)
