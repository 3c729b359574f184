"""The upload path runs its stages in the order the config gives them (fedflat.core.upload): an order across kinds
that makes no sense is refused with its reason, stages of one kind keep the order given, and a config's named
sections (attack, compression, privacy, robust) run in the one order that means something."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_tree

import fedflat
from fedflat.algorithms.compose import build_stages
from fedflat.config import load_config
from fedflat.core import MODEL, AlgorithmError, ConfigError
from fedflat.core.upload import MUST_PRECEDE, STAGE_ORDER

# one real stage of each kind
OF_KIND = {"attack": {"name": "sign_flip"}, "compress": {"name": "topk", "ratio": 0.5},
           "clip": {"name": "dp", "mode": "central"}, "robust": {"name": "median"}}


def test_the_refused_orders_are_exactly_the_inversions_of_the_kinds_order():
    inversions = {(a, b) for a, b in itertools.permutations(STAGE_ORDER, 2) if STAGE_ORDER[a] < STAGE_ORDER[b]}
    assert set(MUST_PRECEDE) == inversions


@pytest.mark.parametrize(("first", "then"), sorted(MUST_PRECEDE))
def test_a_stage_after_one_it_must_precede_is_refused_with_the_reason(first, then):
    right = build_stages([OF_KIND[first], OF_KIND[then]])
    assert [s.kind for s in right] == [first, then]
    with pytest.raises(AlgorithmError) as refused:
        build_stages([OF_KIND[then], OF_KIND[first]])
    message = str(refused.value)
    assert message.startswith(f"upload stage {first} '{OF_KIND[first]['name']}' comes after {then} "
                              f"'{OF_KIND[then]['name']}', but must run before it: {MUST_PRECEDE[first, then]}")


def test_stages_of_one_kind_run_in_the_order_given():
    """Norm bounding then the mean is not the mean then norm bounding: rows (4, 0), 0, 0 with bound 1 give (1/3, 0)
    one way and (1, 0) the other, so the path must not re-sort them."""
    release = {MODEL: torch.tensor([[4.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)}
    bound, mean = {"name": "norm_bound", "bound": 1.0}, {"name": "trimmed_mean", "beta": 0.0}

    def through(specs):
        out, ctx = release, SimpleNamespace(log={})
        for stage in build_stages(specs):
            out = stage.server(ctx, out)
        return out[MODEL][0]

    assert torch.equal(through([bound, mean]), torch.tensor([1 / 3, 0.0], dtype=torch.float64))
    assert torch.equal(through([mean, bound]), torch.tensor([1.0, 0.0], dtype=torch.float64))


def _config(**sections):
    return load_config(None, [], base=tiny_tree(**sections))


def test_the_named_sections_run_in_order_and_the_upload_list_as_listed():
    attack = {"name": "sign_flip", "fraction": 0.3}
    cfg = _config(compression={"name": "topk", "ratio": 0.5}, attack=attack,
                  privacy={"mode": "central", "clip": 1.0, "noise_multiplier": 0.5})
    assert [s["name"] for s in cfg.stage_specs()] == ["sign_flip", "topk", "dp"]
    assert [s.name for s in cfg.algo.build(cfg.stage_specs()).path.stages] == ["sign_flip", "topk", "dp"]
    listed = _config(upload=[{"name": "norm_bound", "bound": 0.5}, {"name": "median"}], attack=attack)
    assert [s["name"] for s in listed.stage_specs()] == ["sign_flip", "norm_bound", "median"]


def test_the_same_stages_named_in_sections_or_listed_in_that_order_give_the_same_run():
    sections = _config(attack={"name": "sign_flip", "fraction": 0.3}, compression={"name": "topk", "ratio": 0.5})
    listed = _config(upload=[{"name": "sign_flip", "fraction": 0.3}, {"name": "topk", "ratio": 0.5}])
    a = fedflat.run(sections, save=False, progress=False).final_parameters
    b = fedflat.run(listed, save=False, progress=False).final_parameters
    assert torch.equal(a, b)


def test_a_config_whose_upload_list_breaks_the_order_is_refused():
    with pytest.raises(ConfigError, match="upload stage attack 'sign_flip' comes after compress 'topk', but must run "
                                          "before it: the compressor sends the entries"):
        _config(compression={"name": "topk", "ratio": 0.5}, upload=[{"name": "sign_flip"}])
    with pytest.raises(ConfigError, match="upload stage compress 'qsgd' comes after clip 'dp'"):
        _config(privacy={"mode": "central", "clip": 1.0, "noise_multiplier": 0.5}, upload=[{"name": "qsgd"}])
    with pytest.raises(ConfigError, match="upload stage attack 'sign_flip' comes after robust 'median'"):
        _config(upload=[{"name": "median"}, {"name": "sign_flip"}])
