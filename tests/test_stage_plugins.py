"""The upload-stage plugin contract (docs/extending.md, "Your own robust rule or attack"): the worked plugins of
examples/stages/ — a robust rule (the geometric median) and a colluding attack (mimic) — compute what they say, are
checked by the config like built-in stages (a robust rule that reads only the sum runs under central DP, one that
declares ``individual`` does not), and give the same run on the local, threads and Ray executors."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import tiny_tree

import fedflat
from fedflat import plugins
from fedflat.algorithms.attacks import attackers, is_malicious
from fedflat.config import load_config
from fedflat.core import ConfigError, RoundContext, TrainSettings, contract, register_part
from fedflat.core.upload import UploadStage

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "stages"
N, SEED = 10, 3
SETTINGS = TrainSettings(weight_decay=0.0, clip=None, batch_size=4, global_lr=1.0, num_clients=N, seed=SEED)


def _load_examples() -> None:
    plugins.load([str(EXAMPLES / "geomed.py"), str(EXAMPLES / "mimic.py")])


def _stage(spec: dict):
    from fedflat.algorithms.compose import build_stages

    _load_examples()
    return contract.checked(build_stages([spec])[0])  # also: nothing it was given is modified in place


def _ctx() -> RoundContext:
    return RoundContext(round=1, lr=0.1, w=torch.zeros(4), sampled=torch.arange(N), num_samples=torch.ones(N),
                        steps=torch.ones(N), server={}, settings=SETTINGS)


RNG = np.random.default_rng(11)
RELEASE = {"model": torch.tensor(RNG.normal(size=(N, 4))), "scaffold.dc": torch.tensor(RNG.normal(size=(N, 2)))}


def test_geomed_converges_to_scipys_minimizer_of_the_summed_distances():
    """Many Weiszfeld iterations reach the geometric median, ``argmin_v sum_i ||v - x_i||``, as SciPy's optimizer
    finds it (to its tolerance); every row is that one aggregate."""
    from scipy.optimize import minimize

    X = np.concatenate([RELEASE["model"].numpy(), RELEASE["scaffold.dc"].numpy()], axis=1)
    X[2] += 50.0  # an outlier the median resists
    release = {"model": torch.tensor(X[:, :4]), "scaffold.dc": torch.tensor(X[:, 4:])}
    out = _stage({"name": "geomed", "iterations": 500, "nu": 1e-12}).server(_ctx(), release)
    best = minimize(lambda v: np.linalg.norm(X - v, axis=1).sum(), np.median(X, 0), method="Nelder-Mead",
                    options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 40000, "maxfev": 40000}).x
    got = np.concatenate([out["model"].numpy(), out["scaffold.dc"].numpy()], axis=1)
    assert np.allclose(got, got[0]) and np.abs(got[0] - best).max() < 1e-5
    assert np.abs(got[0] - X.mean(0)).max() > 1.0  # the mean moved with the outlier; the median did not


def test_mimic_copies_the_benign_update_farthest_from_the_benign_mean_on_malicious_rows():
    stage = _stage({"name": "mimic", "fraction": 0.3})
    ctx = _ctx()
    out = stage.server(ctx, RELEASE)
    bad = torch.isin(torch.arange(N), torch.as_tensor(attackers(SEED, N, 0.3)))
    assert torch.equal(is_malicious(SETTINGS, torch.arange(N), 0.3), bad) and int(bad.sum()) == 3
    benign = RELEASE["model"].numpy()[~bad.numpy()]
    far = benign[np.argmax(np.linalg.norm(benign - benign.mean(0), axis=1))]
    assert np.array_equal(out["model"].numpy()[bad.numpy()], np.broadcast_to(far, (3, 4)))
    assert torch.equal(out["model"][~bad], RELEASE["model"][~bad])
    assert torch.equal(out["scaffold.dc"], RELEASE["scaffold.dc"]) and ctx.log["attackers"] == 3


class SumOnly(UploadStage):
    """A plugin robust stage that reads only what the sum gives (it rescales every row alike) and declares nothing
    individual and no min_clients of its own (the base class's)."""

    name = "test_sum_only"
    summary = "test robust stage: every row halved"
    kind = "robust"

    def server(self, ctx, release):
        return {name: rows * 0.5 for name, rows in release.items()}


register_part(SumOnly)


def _config(tmp_path: Path, *overrides: str):
    for name in ("geomed.py", "mimic.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)  # "your own folder": copies beside the config
    tree = {**tiny_tree(rounds=2, threads=1), "plugins": ["geomed.py", "mimic.py"],
            "attack": {"name": "mimic", "fraction": 0.34}, "robust": {"name": "geomed"}}
    path = tmp_path / "stages.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path, ["engine=sequential", *overrides])


def test_a_plugin_robust_stage_is_checked_by_what_it_declares(tmp_path):
    dp = ("privacy.noise_multiplier=0.5", "privacy.clip=1.0")
    cfg = load_config(None, ["robust.name=test_sum_only", *dp], base=tiny_tree())  # no AttributeError, allowed
    assert cfg.robust == {"name": "test_sum_only"}
    with pytest.raises(ConfigError, match="robust=geomed with privacy.mode=central"):
        _config(tmp_path, *dp)


def test_the_plugins_give_the_same_run_on_local_and_threads(tmp_path):
    local = fedflat.run(_config(tmp_path), save=False, progress=False)
    assert local.summary["status"] == "completed"
    assert any(m.get("attackers", 0) > 0 for m in local.metrics)  # the attack took part
    threads = fedflat.run(_config(tmp_path, "executor=threads", "executor.workers=2"), save=False, progress=False)
    assert torch.equal(threads.final_parameters, local.final_parameters)
    plain = fedflat.run(_config(tmp_path), overrides=["attack=null", "robust=null"], save=False, progress=False)
    assert not torch.equal(plain.final_parameters, local.final_parameters)


@pytest.mark.slow  # Ray's start: ~20 s
def test_the_plugins_give_the_same_run_on_ray_workers(tmp_path):
    """Two Ray workers (fresh interpreters on 127.0.0.1, shut down with the run) import the plugins from the config
    and give the local run bit for bit."""
    pytest.importorskip("ray")
    local = fedflat.run(_config(tmp_path), save=False, progress=False)
    on_ray = fedflat.run(_config(tmp_path, "executor=ray", "executor.workers=2", "executor.cpus_per_worker=1"),
                         save=False, progress=False)
    assert torch.equal(on_ray.final_parameters, local.final_parameters)
