"""A Flower simulation of a user's own model (``model_fn``, as ``fedflat.run`` takes it): the server and every
virtual SuperNode build the same module, and the run equals ``fedflat.run(..., model_fn=...)`` number for number."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("flwr")

import fedflat  # noqa: E402
from fedflat.flower import simulate  # noqa: E402

NOT_COMPARED = {"seconds", "eval_seconds", "train_seconds", "store", "wire_up_bytes", "wire_down_bytes"}


class Bilinear(nn.Module):
    """No built-in model: a bilinear layer between two linear maps of the flattened 1x4x4 image."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 5), nn.Linear(16, 5)
        self.mix = nn.Bilinear(5, 5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = x.flatten(1)
        return self.head(torch.tanh(self.mix(self.a(x), self.b(x))))


def bilinear() -> nn.Module:
    return Bilinear()


@pytest.mark.slow  # a Flower simulation (Ray workers): about a minute on 2 busy cores
@pytest.mark.parametrize("algo", ["fedavg", "ditto"])
def test_a_flower_simulation_of_a_model_fn_equals_fedflat_run(tiny, tmp_path, algo):
    """Ditto's personal models stay on the nodes, which evaluate them (the server pools the counts)."""
    cfg = tiny(f"algo={algo}", "rounds=2", "eval.every=1", "threads=1")
    ours = fedflat.run(cfg, model_fn=bilinear, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False, model_fn=bilinear)
    assert ours.summary["parameters"] == sum(p.numel() for p in Bilinear().parameters()) == \
        theirs.summary["parameters"]
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert len(ours.metrics) == len(theirs.metrics) == 2
    for a, b in zip(ours.metrics, theirs.metrics):
        for key in set(a) - NOT_COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
    assert theirs.config["model"]["name"] == "user:bilinear"


@pytest.mark.slow  # a fresh interpreter that imports torch and trains: 10-30 s on 2 busy cores
def test_a_deployment_builds_a_plugins_model_on_every_node(tmp_path):
    """The deployment route (docs/flower.md): examples/flower_model/bilinear.py registers the model, the config names
    it, and `fedflat flower-app` carries the module in the app's package; a fresh process with only the app folder
    on its path (a SuperNode with fedflat installed) reads the app's config and trains a round of that model."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from conftest import tiny_tree

    from fedflat.config import load_config
    from fedflat.flower.apps import write_app

    example = Path(__file__).resolve().parents[1] / "examples" / "flower_model"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "bilinear.py").write_text((example / "bilinear.py").read_text())
    tree = {**tiny_tree(rounds=1, threads=1), "plugins": ["bilinear.py"], "model": {"name": "bilinear", "width": 4}}
    (mine / "bilinear.yaml").write_text(yaml.safe_dump(tree))
    app = write_app(load_config(mine / "bilinear.yaml"), tmp_path / "app")
    assert (app / "fedflat_app" / "plugins" / "bilinear.py").is_file()
    node = ("import yaml, tomli, fedflat\n"
            "from fedflat.config import as_config\n"
            f"text = tomli.loads(open({str(app / 'pyproject.toml')!r}).read())['tool']['flwr']['app']['config']"
            "['fedflat-config']\n"
            "h = fedflat.run(as_config(yaml.safe_load(text)), save=False, progress=False)\n"
            "print(h.config['model']['name'], h.summary['parameters'])\n")
    done = subprocess.run([sys.executable, "-c", node], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(app)})
    assert done.returncode == 0, done.stderr
    here = fedflat.run(mine / "bilinear.yaml", save=False, progress=False)
    width = 4  # a, b: 16 -> 4; mix: 4 x 4 -> 4; head: 4 -> 3
    assert here.summary["parameters"] == 2 * (16 * width + width) + (width * width * width + width) + (width * 3 + 3)
    assert done.stdout.split() == ["bilinear", str(here.summary["parameters"])]
