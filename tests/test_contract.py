"""The contract a method is written against: scoped hyperparameters, declared state, the typed channel and the
in-place rule (fedflat/core, fedflat/algorithms/compose.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
import yaml

import fedflat
from fedflat.algorithms import PARTS, RECIPES, ROLES, AlgorithmError, build_algorithm, register_part, register_recipe
from fedflat.config import load_config, resolve
from fedflat.core import (ConfigError, ContractError, Correction, Direction, PartParams, Perturbation, Recipe, Slot,
                          init)
from fedflat.core.contract import CHECK_ENV
from fedflat.engine.simulation import Simulation


def _values(algorithm) -> dict[str, tuple[str, dict]]:
    return {role: (part.name, part.p.model_dump()) for role, part in algorithm.parts.items()}


# -- scoped hyperparameters ---------------------------------------------------------------------------------------

def test_a_swapped_in_part_keeps_its_own_defaults_and_config_yaml_records_each_parts_values(tiny):
    """The audit's two cases: FedSCAM's weighting swapped into FedACG keeps its beta 0.8 (not FedACG's 0.002), and
    FedACG's pull swapped into FedSCAM keeps 0.002; config.yaml records both, and rerunning it gives the same run."""
    acg_scam = build_algorithm({"name": "fedacg", "aggregation": "scam"})
    assert (acg_scam.parts["correction"].p.beta, acg_scam.parts["aggregation"].p.beta) == (0.002, 0.8)
    scam_acg = resolve(load_config(None, ["algo=fedscam", "algo.correction=acg"]))["algo"]
    assert scam_acg["correction"] == {"name": "acg", "beta": 0.002}
    assert scam_acg["aggregation"]["name"] == "scam" and scam_acg["aggregation"]["beta"] == 0.8


def test_recipe_defaults_apply_only_to_the_recipes_own_parts():
    """fedlesam-s runs its perturbation at rho 0.1; a SAM perturbation swapped in starts from SAM's own 0.01."""
    assert build_algorithm({"name": "fedlesam-s"}).parts["perturbation"].p.rho == 0.1
    assert build_algorithm({"name": "fedlesam-s", "perturbation": "sam"}).parts["perturbation"].p.rho == 0.01
    assert build_algorithm({"name": "fedacg", "correction": "prox"}).parts["server"].p.lam == 0.85  # kept: acg's


def test_a_flat_key_two_parts_own_separately_is_an_error_naming_both():
    with pytest.raises(AlgorithmError, match=r"algo.beta: correction 'acg' and aggregation 'scam' each have a 'beta'; "
                                             r"say whose: algo.correction.beta or algo.aggregation.beta"):
        build_algorithm({"name": "fedacg", "aggregation": "scam", "beta": 0.5})
    scoped = build_algorithm({"name": "fedacg", "aggregation": {"name": "scam", "beta": 0.5}})
    assert (scoped.parts["correction"].p.beta, scoped.parts["aggregation"].p.beta) == (0.002, 0.5)
    cli = load_config(None, ["algo=fedacg", "algo.aggregation=scam", "algo.aggregation.beta=0.5"])
    assert _values(build_algorithm(cli.algo)) == _values(scoped)


def test_a_shared_hyperparameter_is_one_value_for_every_part_that_holds_it():
    """FedDyn's alpha lives on its client and its server; FedSCAM's score settings in its radius and its weights."""
    dyn = build_algorithm({"name": "feddyn", "alpha": 0.05})
    assert dyn.parts["correction"].p.alpha == dyn.parts["server"].p.alpha == 0.05
    scam = build_algorithm({"name": "fedscam", "kappa": 2.0})
    assert scam.parts["perturbation"].p.kappa == scam.parts["aggregation"].p.kappa == 2.0
    with pytest.raises(AlgorithmError, match=r"algo.alpha: correction 'dyn' and server 'dyn' share it.*set algo.alpha"):
        build_algorithm({"name": "feddyn", "correction": {"alpha": 0.05}})


def test_a_hyperparameter_of_no_part_names_the_valid_ones():
    with pytest.raises(AlgorithmError, match=r"algo.perturbation.rhoo: not a hyperparameter of perturbation 'sam' "
                                             r"\(did you mean 'rho'\?\)"):
        build_algorithm({"name": "fedsam", "perturbation": {"rhoo": 0.1}})
    with pytest.raises(ConfigError, match=r"algo.rhoo: not a hyperparameter of 'fedsam' \(did you mean 'rho'\?\)"):
        load_config(None, ["algo=fedsam", "algo.rhoo=0.1"])


def _swaps() -> list[tuple[str, str, str]]:
    """Every recipe, and every recipe with one role swapped for every other part of that role."""
    cases = [(name, "", "") for name in sorted(RECIPES)]
    for name, role in itertools.product(sorted(RECIPES), ROLES):
        cases += [(name, role, part) for part in sorted(PARTS[role]) if part != RECIPES[name].part_names()[role]]
    return cases


def test_building_from_the_resolved_section_gives_the_same_parts_and_values_for_every_recipe_and_swap():
    """The round-trip property over every recipe and every single-role swap (compositions the parts refuse, such as
    a momentum-guided perturbation without a momentum, are skipped): resolved() read back builds the same method."""
    built = 0
    for name, role, part in _swaps():
        section = {"name": name, **({role: part} if role else {})}
        try:
            algorithm = build_algorithm(section)
        except AlgorithmError as err:
            assert "needs" in str(err) or "share it" in str(err), (section, err)
            continue
        resolved = algorithm.resolved()
        again = build_algorithm(yaml.safe_load(yaml.safe_dump(resolved)))  # as config.yaml stores it
        assert _values(again) == _values(algorithm) and again.resolved() == resolved, section
        built += 1
    assert built > 1000


@pytest.mark.parametrize("overrides", [["algo=fedscam", "algo.correction=acg"],
                                       ["algo=fedacg", "algo.aggregation=scam"],
                                       ["algo=fedlesam-s", "algo.perturbation=sam", "algo.filter=fft"],
                                       ["algo=fedgloss", "algo.warmup_rounds=2"], ["algo=fedwmsam"], ["algo=feddyn"]])
def test_a_run_from_its_config_yaml_equals_the_original_bit_for_bit(tiny, tmp_path, overrides):
    first = fedflat.run(tiny(*overrides), run_dir=tmp_path / "first", progress=False)
    again = fedflat.run(tmp_path / "first" / "config.yaml", run_dir=tmp_path / "again", progress=False)
    assert torch.equal(first.final_parameters, again.final_parameters)
    assert (tmp_path / "first" / "config.yaml").read_text() == (tmp_path / "again" / "config.yaml").read_text()


def test_a_legacy_flat_section_reads_as_it_ran(tiny, tmp_path):
    """A config.yaml written before scoping held one value per key, which set every part owning it: read back, the
    old section builds exactly that (FedSCAM + FedACG's pull both at 0.8), and resuming or reporting it works."""
    legacy = {"name": "fedscam", "perturbation": "scam", "filter": "none", "correction": "acg", "aggregation": "scam",
              "server": "avg", "beta": 0.8, "rho_max": 0.05, "kappa": 1.0}
    algorithm = build_algorithm(legacy)
    assert algorithm.parts["correction"].p.beta == algorithm.parts["aggregation"].p.beta == 0.8
    run = fedflat.run(tiny("algo=fedavgm", "rounds=2"), run_dir=tmp_path / "old", progress=False)
    config = tmp_path / "old" / "config.yaml"
    tree = yaml.safe_load(config.read_text())
    tree["algo"] = {"name": "fedavgm", "perturbation": "none", "filter": "none", "correction": "none",
                    "aggregation": "mean", "server": "avgm", "weighting": "uniform", "beta": 0.9}
    config.write_text(yaml.safe_dump(tree))
    from fedflat.experiments.report import find_runs, group_runs
    from fedflat.experiments.resume import resume

    resumed = resume(tmp_path / "old", overrides=["rounds=3"], progress=False)
    fresh = fedflat.run(tiny("algo=fedavgm", "rounds=3"), save=False, progress=False)
    assert resumed.summary["rounds"] == 3 and torch.equal(resumed.final_parameters, fresh.final_parameters)
    assert [g.method for g in group_runs(find_runs([tmp_path]))] == ["FedAvgM"]  # (the report names the method as its paper does)
    assert run.summary["algorithm"] == "fedavgm"


# -- declared state, the channel, the in-place rule -----------------------------------------------------------------

SEEN = Slot("memo.seen", "test only: what the correction saw")


class Memo(Correction):
    """Test only: declares a server entry and a slot, keeps a client vector."""

    name = "memo"
    summary = "test only"
    server_state = {"memo.count": init.scalar("start"), "memo.sum": init.zeros}
    keeps = ("memo.last",)
    provides = frozenset({SEEN})

    class Params(PartParams):
        start: float = 2.0

    def begin(self, ctx, cohort):
        cohort.shared.put(SEEN, ctx.w_start.expand(cohort.size, -1))

    def end(self, ctx, cohort, W):
        cohort.new_state["memo.last"] = W

    def after_step(self, ctx, w_new):
        ctx.server["memo.count"] = ctx.server["memo.count"] + 1


class Reader(Perturbation):
    """Test only: requires the slot, reads it (a perturbation begins before the correction that provides it)."""

    name = "reader"
    summary = "test only"
    requires = frozenset({SEEN})

    def perturb(self, ctx, cohort, k, W, batch):
        return torch.zeros_like(W) + 0 * cohort.shared[SEEN]


@pytest.fixture
def test_parts():
    register_part(Memo)
    register_part(Reader)
    register_recipe(Recipe(name="test_memo", summary="test only", source="test", correction="memo"))
    yield
    PARTS["correction"].pop("memo", None)
    PARTS["perturbation"].pop("reader", None)
    RECIPES.pop("test_memo", None)


def test_declared_server_state_is_created_with_its_initial_values_and_checkpointed(tiny, test_parts, tmp_path):
    sim = Simulation(tiny("algo=test_memo", "algo.start=5"))
    state = sim.server.state
    assert float(state["memo.count"]) == 5.0 and torch.equal(state["memo.sum"], torch.zeros_like(sim.server.w))
    history = fedflat.run(tiny("algo=test_memo", "algo.start=5", "rounds=2"), run_dir=tmp_path / "r", progress=False)
    from fedflat.engine.checkpoint import read_checkpoint

    assert float(read_checkpoint(tmp_path / "r")["state"]["server"]["memo.count"]) == 7.0
    assert history.summary["client_state_vectors"] == 1


def test_a_slot_read_before_its_provider_wrote_it_is_an_error_naming_it(tiny, test_parts):
    """Hooks run in role order: a perturbation reading in its steps what a correction puts in begin works; a slot
    no part provides is refused when the method is assembled."""
    fedflat.run(tiny("algo=test_memo", "algo.perturbation=reader", "rounds=1"), save=False, progress=False)
    with pytest.raises(AlgorithmError, match=r"perturbation 'reader' needs \['memo.seen'\], which no part of this "
                                             r"combination provides; use correction 'memo'"):
        build_algorithm({"name": "fedavg", "perturbation": "reader"})


def test_two_parts_declaring_one_entry_with_different_initial_values_are_refused(test_parts):
    class Other(Perturbation):
        name = "other_memo"
        server_state = {"memo.count": init.zeros}
    register_part(Other)
    try:
        with pytest.raises(AlgorithmError, match="server state 'memo.count': .* declare it with different initial"):
            build_algorithm({"name": "test_memo", "perturbation": "other_memo"})
    finally:
        PARTS["perturbation"].pop("other_memo")


def test_state_names_follow_the_part_symbol_convention():
    class Unscoped(Correction):
        name = "unscoped"
        keeps = ("c_i",)
    with pytest.raises(AlgorithmError, match=r"state and slot names read '<part>.<symbol>'.*rename \['c_i'\]"):
        register_part(Unscoped)
    assert "unscoped" not in PARTS["correction"]


def test_a_part_that_modifies_a_tensor_it_does_not_own_in_place_is_named(tiny, test_parts, monkeypatch):
    """The debug mode (on in the tests) names the part, the hook and the tensor; off, nothing is watched."""
    monkeypatch.setattr(Memo, "direction", lambda self, ctx, cohort, k, W, grad: Direction(grad + W.add_(1.0), 0.0))
    with pytest.raises(ContractError, match=r"correction 'memo'.direction modified W in place"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)
    monkeypatch.setattr(Memo, "direction", Correction.direction)
    monkeypatch.setattr(Memo, "after_step", lambda self, ctx, w_new: ctx.server["memo.sum"].add_(w_new))
    with pytest.raises(ContractError, match=r"correction 'memo'.after_step modified ctx.server\['memo.sum'\] in place"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)
    monkeypatch.setenv(CHECK_ENV, "0")
    fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)  # not watched: it runs


# -- a correction's one hook: the direction with its decay -------------------------------------------------------

def _direction_inputs():
    """A tiny step of 2 clients on 3 parameters with numbers easy to follow by hand."""
    from types import SimpleNamespace

    from fedflat.core import Cohort, Shared

    W = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 4.0]])
    grad = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, -3.0]])
    w_start = torch.tensor([1.0, 1.0, 1.0])
    cohort = Cohort(ids=torch.arange(2), num_samples=torch.tensor([4, 4]), steps=torch.tensor([2, 2]),
                    active=torch.ones(2, dtype=torch.bool))
    cohort.shared = Shared({})
    settings = SimpleNamespace(weight_decay=0.25)
    return SimpleNamespace(settings=settings, w_start=w_start, server={}), cohort, W, grad


@pytest.mark.parametrize("recipe, loss_of, decay", [
    # FedAvg: (g, wd); FedProx: (g - mu w^t, wd + mu); FedDyn: (g - h_i - alpha w^t, wd + alpha) with h_i = 0;
    # FedCM with a = 0.5, m = 2: (a g + (1 - a) m, wd) ("outside": the decay unscaled), ("inside": a wd)
    ("fedavg", lambda g, ws, m: g, 0.25),
    ("fedprox", lambda g, ws, m: g - 0.5 * ws, 0.75),
    ("feddyn", lambda g, ws, m: g - 0.5 * ws, 0.75),
    ("fedcm", lambda g, ws, m: 0.5 * g + 0.5 * m, 0.25),
    ("fedcm-inside", lambda g, ws, m: 0.5 * g + 0.5 * m, 0.125),
])
def test_a_correction_gives_its_loss_direction_and_its_decay(recipe, loss_of, decay):
    """``Correction.direction`` returns ``(L, c)`` with ``d = L + c w``, computed by hand on a tiny step."""
    from fedflat.algorithms.fedcm import MOMENTUM
    from fedflat.algorithms.feddyn import CLIENT_DUAL

    algo = {"fedavg": {"name": "fedavg"}, "fedprox": {"name": "fedprox", "mu": 0.5},
            "feddyn": {"name": "feddyn", "alpha": 0.5}, "fedcm": {"name": "fedcm", "a": 0.5},
            "fedcm-inside": {"name": "fedcm", "correction": {"a": 0.5, "decay": "inside"}}}[recipe]
    correction = build_algorithm(algo).parts["correction"]
    ctx, cohort, W, grad = _direction_inputs()
    m = torch.full((3,), 2.0)
    ctx.server[MOMENTUM] = m
    cohort.state[CLIENT_DUAL] = torch.zeros(2, 3)
    expected = loss_of(grad.clone(), ctx.w_start, m)
    loss, c = correction.direction(ctx, cohort, 0, W, grad.clone())
    assert torch.equal(loss, expected) and c == decay


@pytest.mark.parametrize("scope", ["loss", "step"])
def test_the_engine_applies_the_clip_scope_and_the_decay_in_one_place(scope):
    """``clip(L) + c w`` under ``clip_scope=loss``, ``clip(L + c w)`` under ``step``: rows [3, 4] and [0.3, 0.4]
    with max norm 1 and c = 0.5, w = [2, 2]."""
    from fedflat.core import Direction
    from fedflat.engine.client import local_direction

    class Fixed(Correction):
        def direction(self, ctx, cohort, k, W, grad):
            return Direction(grad, 0.5)

    W = torch.full((2, 2), 2.0)
    grad = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    d = local_direction(Fixed(), None, None, 0, W, grad.clone(), 1.0, scope)
    if scope == "loss":  # [3, 4] / 5 + 1; the small row within the bound: itself + 1
        expected = torch.tensor([[0.6 + 1, 0.8 + 1], [1.3, 1.4]])
    else:  # [4, 5] / sqrt(41); [1.3, 1.4] / sqrt(3.65)
        expected = torch.tensor([[4.0, 5.0], [1.3, 1.4]]) / torch.tensor([[41 ** 0.5], [3.65 ** 0.5]])
    assert torch.allclose(d, expected, rtol=1e-6, atol=0)  # a few float32 operations (1e-6 >> 2^-24 of each)


def test_a_direction_returning_state_is_named(tiny, test_parts, monkeypatch):
    """The debug mode refuses a direction that hands the engine a tensor it would then overwrite."""
    monkeypatch.setattr(Memo, "direction", lambda self, ctx, cohort, k, W, grad: Direction(cohort.state["memo.last"],
                                                                                          0.0))
    with pytest.raises(ContractError, match=r"correction 'memo'.direction returned cohort.state\['memo.last'\]"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)


def test_a_direction_that_returns_a_bare_tensor_says_what_to_return(tiny, test_parts, monkeypatch):
    monkeypatch.setattr(Memo, "direction", lambda self, ctx, cohort, k, W, grad: grad)
    with pytest.raises(ContractError, match=r"correction 'memo'.direction returned Tensor; it returns "
                                            r"fedflat.core.Direction\(loss, decay\)"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)


# -- mistakes are loud ---------------------------------------------------------------------------------------------

def test_a_part_that_keeps_state_on_itself_is_refused_naming_the_rule_and_the_declarations(tiny, test_parts,
                                                                                           monkeypatch):
    """Rule 4: assigning an attribute after construction is an error in every run (not only in the debug mode); a
    constructor, the part's own or a subclass's calling its parent's, may set attributes."""
    monkeypatch.setenv(CHECK_ENV, "0")

    def count(self, ctx, w_new):
        self.rounds = 1

    monkeypatch.setattr(Memo, "after_step", count)
    with pytest.raises(ContractError, match=r"^correction 'memo' set self.rounds after construction: a part keeps no "
                                            r"state on itself \(the contract's rule 4.*declare what evolves: "
                                            r"server_state .*keeps .*holds .*cohort.own\(self\)"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)

    class Built(Memo):
        def __init__(self, params=None):
            super().__init__(params)
            self.table = torch.arange(3)  # set while constructing: allowed

    class Subclassed(Built):
        def __init__(self, params=None):
            super().__init__(params)
            self.more = 1

    part = Subclassed()
    assert part.more == 1 and part.table.tolist() == [0, 1, 2]
    with pytest.raises(ContractError, match="set self.table after construction"):
        part.table = None


def test_an_undeclared_kept_or_held_vector_is_a_one_line_error_naming_the_declaration(tmp_path, capsys, monkeypatch):
    """Reading ``cohort.state`` / ``ctx.held`` under a name no part declares names ``keeps`` / ``holds``; the CLI prints
    it as one line with the place in the part's code (not a KeyError's traceback)."""
    from fedflat.cli import main
    from fedflat.core.round import Held, Kept
    from fedflat.testing import TINY

    with pytest.raises(ContractError, match=r"^cohort.state\['mine.m'\]: no part of this method declares it; add it "
                                            r"to the part's `keeps` \(keeps = \('mine.m',\)\)"):
        Kept({"scaffold.c_i": torch.zeros(1)})["mine.m"]
    with pytest.raises(ContractError, match=r"^ctx.held\['mine.c_i'\]: .*the part's `holds` \(holds = \('mine.c_i',\)"):
        Held()["mine.c_i"]
    (tmp_path / "forgot.py").write_text(
        "from fedflat.core import Correction, Direction, Recipe, register_part, register_recipe\n\n\n"
        "@register_part\nclass Forgot(Correction):\n    name = 'forgot'\n\n"
        "    def direction(self, ctx, cohort, k, W, grad):\n"
        "        return Direction(grad + cohort.state['forgot.m'], 0.0)\n\n\n"
        "register_recipe(Recipe(name='forgot', summary='test only', source='test', correction='forgot'))\n")
    (tmp_path / "forgot.yaml").write_text(yaml.safe_dump({**TINY, "rounds": 1, "plugins": ["forgot.py"],
                                                          "algo": {"name": "forgot"}}))
    try:
        code = main(["run", str(tmp_path / "forgot.yaml"), "--no-progress", "--out", str(tmp_path / "runs")])
    finally:
        PARTS["correction"].pop("forgot", None)
        RECIPES.pop("forgot", None)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if not line.startswith("run folder:")]
    assert code == 2 and len(errors) == 1, err  # one line: no traceback
    assert errors[0].startswith("fedflat: cohort.state['forgot.m']: no part of this method declares it")
    assert errors[0].endswith(f"(at {tmp_path / 'forgot.py'}:9 in direction)")


def test_a_plugins_part_is_watched_in_every_run_and_fedflats_own_with_the_debug_mode(tiny, test_parts, monkeypatch):
    """Unset, FEDFLAT_CHECK_CONTRACT watches a part defined outside fedflat (here the test's Memo), not fedflat's own
    (their watched cost, 15-20% of a tiny run, is over the 2% a default may cost); 1 watches every part, 0 none."""
    from fedflat.core.contract import Checked

    monkeypatch.delenv(CHECK_ENV, raising=False)
    plain = build_algorithm({"name": "test_memo"})
    assert isinstance(plain.parts["correction"], Checked) and not isinstance(plain.parts["server"], Checked)
    monkeypatch.setattr(Memo, "after_step", lambda self, ctx, w_new: ctx.server["memo.sum"].add_(w_new))
    with pytest.raises(ContractError, match=r"correction 'memo'.after_step modified ctx.server\['memo.sum'\] in place"):
        fedflat.run(tiny("algo=test_memo", "rounds=1"), save=False, progress=False)
    monkeypatch.setenv(CHECK_ENV, "1")
    assert all(isinstance(p, Checked) for p in build_algorithm({"name": "test_memo"}).parts.values())
    monkeypatch.setenv(CHECK_ENV, "0")
    assert not any(isinstance(p, Checked) for p in build_algorithm({"name": "test_memo"}).parts.values())


def test_a_watched_part_is_what_it_is(monkeypatch):
    """Watching keeps isinstance: a watched stage is an instance of its own class (the engine picks data attacks and
    the backdoor by class), has its options, pickles back to a watched part, and the part itself is left unwatched."""
    import pickle

    from fedflat.algorithms.attacks import Attack, Backdoor, DataAttack, backdoor_of
    from fedflat.algorithms.compose import assemble, build_parts
    from fedflat.core.contract import Checked, checked

    monkeypatch.setenv(CHECK_ENV, "1")
    parts = build_parts({"name": "fedntd"})
    algorithm = assemble(*parts, [{"name": "backdoor", "boost": 2.0}, {"name": "median"}])
    backdoor, median = algorithm.path.stages
    assert isinstance(backdoor, Checked) and isinstance(backdoor, Backdoor) and isinstance(backdoor, DataAttack)
    assert type(backdoor).__qualname__ == "Backdoor" and backdoor.p.boost == 2.0
    assert backdoor_of(algorithm.path.stages) is backdoor
    assert not isinstance(median, Attack) and not any(isinstance(p, Checked) for p in parts[1].values())
    assert isinstance(algorithm.parts["correction"], type(parts[1]["correction"]))
    again = pickle.loads(pickle.dumps(backdoor))
    assert isinstance(again, Checked) and isinstance(again, Backdoor) and again.p == backdoor.p
    assert checked(backdoor) is backdoor  # watched once


def test_a_stage_that_poisons_must_be_a_data_attack():
    """The engine calls poison on the stages that are data attacks (isinstance): a stage with a poison method outside
    DataAttack would be silently skipped, so building it is refused."""
    from fedflat.algorithms.attacks import Attack
    from fedflat.algorithms.compose import build_stages
    from fedflat.core import STAGES

    class Loose(Attack):
        name = "test_loose_poison"

        def poison(self, ctx, cohort, batch):
            return batch

    STAGES[Loose.name] = Loose
    try:
        with pytest.raises(AlgorithmError, match="defines poison but is no data attack: subclass .*DataAttack"):
            build_stages([{"name": Loose.name}])
    finally:
        STAGES.pop(Loose.name)
