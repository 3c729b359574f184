"""docs/architecture.md against the code: its layer table is tests/test_layers.py's, its anchors still point at the
names they cite, its size limits hold; and docs/extending.md's hand-check recipe gives one round's per-client
updates."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def test_the_layer_table_is_the_one_tests_check():
    rows = re.findall(r"^\| (\d+) \| (.+?) \| .+ \|$", PAGE, flags=re.M)
    table = [tuple(re.findall(r"`([\w.]+)`", packages)) for _, packages in rows]
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS)))
    assert table == [tuple(layer) for layer in LAYERS]


def test_every_anchor_names_a_symbol_that_exists():
    anchors = re.findall(r"^- (A\d+) `([\w.]+):([\w.]+)`(?: calls `([^`]+)`)?$", PAGE, flags=re.M)
    assert anchors and [a for a, *_ in anchors] == [f"A{i}" for i in range(1, len(anchors) + 1)]
    cited = set(re.findall(r"\[(A\d+)\]", PAGE))
    assert cited == {a for a, *_ in anchors}, "every anchor is cited, and every citation listed"
    stale, unchecked = [], []
    for label, module, qualname, call in anchors:
        try:
            target = importlib.import_module(module)
            for name in qualname.split("."):
                target = getattr(target, name)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] != "fedflat":  # fedflat's module is there: an extra's is not
                unchecked.append(f"{label} {module}:{qualname} needs {err.name}, which is not installed")
            else:
                stale.append(f"{label} {module}:{qualname}: {err}")
            continue
        except (ImportError, AttributeError) as err:
            stale.append(f"{label} {module}:{qualname}: {err}")
            continue
        if call and call not in inspect.getsource(target):
            stale.append(f"{label} {module}:{qualname} no longer calls {call!r}")
    assert not stale, "docs/architecture.md's anchors name code that moved or went; update them:\n" + "\n".join(stale)
    if unchecked:
        pytest.skip("; ".join(unchecked) + " (an optional dependency: `make setup` installs the dev extra)")


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
    assert deltas.shape == (3, sim.server.w.numel()) and torch.equal(scope["result"].ids, opened.ctx.sampled.cpu())
    expected = w_before + deltas.mean(0)
    assert torch.allclose(sim.server.w, expected, rtol=0, atol=8 * 2.0 ** -24 * float(w_before.abs().max() + 1))
    assert not torch.equal(sim.server.w, w_before)


STAGES = {"none": [], "attack": ["attack.name=sign_flip", "attack.fraction=0.5"],
          "dp": ["privacy.clip=1e6", "privacy.noise_multiplier=0"],
          "robust": ["robust.name=norm_bound", "robust.bound=1e6"],
          "topk": ["compression.name=topk", "compression.ratio=1.0"]}


def _hand_check(*overrides: str) -> dict:
    """docs/extending.md's recipe, as written, with ``overrides`` after its ``algo=fedavg``."""
    extending = (ROOT / "docs" / "extending.md").read_text()
    recipe = re.search(r"## Checking a round by hand.*?```python\n(.*?)```", extending, flags=re.S).group(1)
    assert '["algo=fedavg"]' in recipe
    scope: dict = {}
    exec(recipe.replace('["algo=fedavg"]', repr(["algo=fedavg", *overrides])), scope)
    return scope


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_hand_check_reads_delta_i_under_every_upload_stage(stage):
    """With a stage that leaves the updates as they are (a DP clip at 1e6 without noise, norm bounding at 1e6,
    top-k keeping every entry) the recipe's deltas are the plain run's bit for bit (the same subtraction
    ``w_{i,E} - w^t`` in float32, then multiplications by exactly 1 or a gather of every entry), and FedAvg moves by
    their mean; under a sign-flip attack the malicious rows are exactly minus the plain run's. ``upload["model"]``
    alone is ``w_{i,E}`` without stages and the release with them: the recipe must not depend on it."""
    from fedflat.algorithms.attacks import attackers

    plain, run = _hand_check(), _hand_check(*STAGES[stage])
    deltas, expected = run["deltas"], plain["deltas"].clone()
    assert torch.equal(run["result"].ids, plain["result"].ids)
    if stage == "attack":
        sim = run["sim"]
        chosen = attackers(sim.settings.seed, sim.settings.num_clients, 0.5)
        bad = torch.isin(run["result"].ids, torch.as_tensor(chosen))
        assert bool(bad.any())
        expected[bad] = -expected[bad]
    assert torch.equal(deltas, expected)
    w_before = run["w_before"]
    assert torch.allclose(run["sim"].server.w, w_before + deltas.mean(0), rtol=0,
                          atol=8 * 2.0 ** -24 * float(w_before.abs().max() + 1))


class _Net(torch.nn.Module):
    """A user's model: one linear layer on the flattened input."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


def _user_model():
    return _Net()


def _calls_before_the_first_round(monkeypatch, **extra) -> list[tuple[bool, list[int]]]:
    """Every call of the user's ``model_fn`` or of its module's ``forward`` that ``fedflat.run`` makes before its first
    round: whether it builds a model (``model_fn``), and the layers of the fedflat frames on the stack, outermost
    (``fedflat.api``) first."""
    import sys

    import fedflat
    from conftest import tiny_tree
    from fedflat.engine.simulation import Simulation
    from test_layers import layer_of

    targets, calls = {_user_model.__code__, _Net.forward.__code__}, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in targets:
            chain, caller = [], frame.f_back
            while caller is not None:
                module = caller.f_globals.get("__name__", "")
                if module.split(".")[0] == "fedflat":
                    chain.append(layer_of(module))
                caller = caller.f_back
            calls.append((frame.f_code is _user_model.__code__, chain[::-1]))

    first_round = Simulation.run_round

    def untraced(self, t):
        sys.setprofile(None)
        return first_round(self, t)

    monkeypatch.setattr(Simulation, "run_round", untraced)
    sys.setprofile(profile)
    try:
        fedflat.run(tiny_tree(rounds=1, **extra), model_fn=_user_model, save=False, progress=False)
    finally:
        sys.setprofile(None)
    return calls


def _ups(layers: list[int]) -> int:
    return sum(later > earlier for earlier, later in zip(layers, layers[1:]))


@pytest.mark.parametrize("extra", [{"engine": "sequential"}, {"engine": "vectorized"},
                                   {"executor": {"name": "threads", "workers": 2}}], ids=["sequential", "vectorized",
                                                                                          "threads"])
def test_a_users_model_fn_goes_back_up_the_layers_at_most_once(monkeypatch, extra):
    """Issue 46: from ``fedflat.run`` to each call of the user's ``model_fn`` and of its ``forward`` (the probes of one
    model report), the calling chain runs down the layers (api 8, experiments 7, engine 5, params 1) and goes back up
    at most once; and so does the sequence of the layers that build a model and probe it, in the order they do (for
    each model built: the driver's, and a thread worker's own where it probes its model, as the vectorized engine's
    memory estimate does on a GPU)."""
    calls = _calls_before_the_first_round(monkeypatch, **extra)
    assert len(calls) >= 2 and all(chain[0] == 8 for _, chain in calls)  # model_fn, then its forward, from fedflat.run
    assert calls[0][0], "the first call builds the model"
    assert max(_ups(chain) for _, chain in calls) <= 1, calls
    builds = [i for i, (building, _) in enumerate(calls) if building] + [len(calls)]
    for start, end in zip(builds, builds[1:]):
        callers = [chain[-1] for _, chain in calls[start:end]]
        assert _ups([layer for i, layer in enumerate(callers) if i == 0 or layer != callers[i - 1]]) <= 1, callers


def test_the_pages_diagrams_are_drawn_from_the_current_code():
    """docs/figures/layers.svg and round.svg are what scripts/architecture_diagram.py draws from the source's imports
    and the page's steps and anchors now; the layers' dots never point up (tests/test_layers.py's rule)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "architecture_diagram.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    svg = (ROOT / "docs" / "figures" / "layers.svg").read_text()
    pairs = [tuple(map(int, p)) for p in re.findall(r"<title>layer (\d+) imports layer (\d+):", svg)]
    assert pairs and all(dest < source for source, dest in pairs)
    assert (3, 0) in pairs and (5, 3) in pairs  # the algorithms read the contract; the engine runs the algorithms
    assert "figures/layers.svg" in PAGE and "figures/round.svg" in PAGE
    steps = re.findall(r"^\d+\. \*\*(.+?)\*\*", PAGE, flags=re.M)
    journey = (ROOT / "docs" / "figures" / "round.svg").read_text()
    assert steps and all(f"{k + 1}. {title}" in journey for k, title in enumerate(steps))


def test_no_class_over_250_lines_or_25_methods_and_no_module_over_600_lines():
    """The sizes docs/architecture.md sets (issue 58): a module over 600 lines says why in its docstring."""
    import ast

    too_big = []
    for path in sorted((ROOT / "fedflat").rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        name = path.relative_to(ROOT).as_posix()
        docstring = (ast.get_docstring(tree) or "").splitlines()
        reason = any(line.strip().startswith("Over 600 lines:") for line in docstring)
        if source.count("\n") > 600 and not reason:
            too_big.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if lines > 250 or methods > 25:
                    too_big.append(f"{name}: class {node.name}, {lines} lines, {methods} methods")
    assert not too_big, too_big
