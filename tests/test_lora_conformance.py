"""fedflat's LoRA path against FedSWA's code with ``--lora 1`` (github.com/junkangLiu0/FedSWA at f725be9,
main_FedSWA.py; the functions transcribed unmodified in tests/authors/fedswa.py), three rounds on a tiny ViT.

The problem: 4 clients of unequal sizes (10, 14, 18, 22 samples of 1x4x4 inputs, 3 classes, from a fixed seed),
fedflat's ViT (patch 2, width 16, one block) with fixed initial weights, the code's ``LoraConfig`` (rank 2,
``lora_alpha = 2r``, ``attn.qkv`` and ``attn.proj``, no bias) on both sides, full participation, one full batch a
local step, 3 steps, ``eta_l`` 0.1 decaying by 0.9 a round, the code's weight decay 1e-3 and clip 10. Two
substitutions, named: ``lora_dropout`` is 0 on both sides (the code draws its masks from torch's global generator,
fedflat from each client's keyed stream, so with dropout the two runs see different masks by design); and the code's
``task_type="IMAGE_CLASSIFICATION"``, which peft 0.21 refuses (older releases took any string and built the plain
``PeftModel``), is None, that plain ``PeftModel``.

What the code trains: its FedAvg sets ``requires_grad`` on the head and trains it with the adapters (fedflat's default
``modules_to_save``: the head), its FedSWA trains the adapters alone (``adapter.modules_to_save=[]``); both average the
clients' changes uniformly (``apply_weights_avg``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedflat.config import load_config
from fedflat.data import Dataset
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.models import build_model

peft = pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parent / "authors"))
import fedswa as code  # noqa: E402

SIZES, ROUNDS, STEPS, LR, LR_DECAY, RANK = (10, 14, 18, 22), 3, 3, 0.1, 0.9, 2
VIT = {"patch": 2, "dim": 16, "depth": 1, "heads": 2}


def problem():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES), 1, 4, 4, generator=gen)
    y = torch.randint(0, 3, (sum(SIZES),), generator=gen)
    torch.manual_seed(1)
    initial = build_model("vit", (1, 4, 4), 3, **VIT).state_dict()

    def model_fn():
        module = build_model("vit", (1, 4, 4), 3, **VIT)
        module.load_state_dict(initial)
        return module
    return x, y, model_fn


def code_lora_config():
    """main_FedSWA.py's ``lora_config`` for its transformers (l.91-98), ``lora_dropout`` 0 and no task type (the
    module docstring)."""
    return peft.LoraConfig(r=RANK, lora_alpha=RANK * 2, lora_dropout=0.0, bias="none", task_type=None,
                           target_modules=["attn.qkv", "attn.proj"])


class Worker(code.DataWorker):
    """The code's worker with one full batch of its client per epoch (its ``get_data_loader`` reads CIFAR)."""

    def __init__(self, model, x, y):
        self.model, self.x, self.y = model, x, y
        self.criterion = torch.nn.CrossEntropyLoss()

    def data_id_loader(self, index):
        self.data_iterator = [(self.x, self.y)]


def code_key(name: str) -> str:
    """The code's state-dict key of a fedflat parameter: the same, but the head is trained itself, not as peft's
    ``modules_to_save`` copy."""
    return name.replace("modules_to_save.default.", "")


def code_run(method: str, x, y, model_fn, start: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The code's rounds from the adapters ``start`` (fedflat's seeded initial ``A``; ``B`` and the head as built)."""
    code.args = SimpleNamespace(K=10 ** 6, lora=1, lg=1.0)
    server = peft.get_peft_model(model_fn(), code_lora_config())
    server.load_state_dict(start, strict=False)
    bounds = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    workers = [Worker(peft.get_peft_model(model_fn(), code_lora_config()), x[lo:hi], y[lo:hi])
               for lo, hi in zip(bounds, bounds[1:])]
    models = []
    current = {k: v.clone() for k, v in server.state_dict().items()}
    for t in range(ROUNDS):
        lr = LR * LR_DECAY ** t
        update = Worker.update_fedavg if method == "fedavg" else Worker.update_FedSWA
        deltas = [update(w, current, STEPS, i, lr) for i, w in enumerate(workers)]
        current = code.apply_weights_avg(len(workers), deltas, server)
        models.append({k: v.clone() for k, v in current.items()})  # (the dict holds the model's own tensors)
    return models


def fedflat_run(overrides: list[str], x, y, model_fn):
    tree = {"seed": 0, "rounds": ROUNDS, "data": {"name": "synthetic", "num_clients": len(SIZES)},
            "model": {"name": "mlp"}, "algo": {"name": "fedavg"}, "sampling": {"clients_per_round": len(SIZES)},
            "adapter": {"r": RANK, "dropout": 0.0},
            "train": {"local_epochs": STEPS, "batch_size": max(SIZES), "lr": LR, "lr_decay": LR_DECAY,
                      "weight_decay": 1e-3, "clip": 10.0}, "threads": 1}
    cfg = load_config(None, overrides, base=tree)
    bounds = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    clients = [list(range(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    sim = Simulation(cfg, UserInputs(dataset=Dataset("conformance", x, y, x, y, 3), model_fn=model_fn,
                                     clients=clients))
    names = [code_key(n) for n in sim.model.layout.names]
    start = dict(zip(names, (v.clone() for v in sim.model.layout.views(sim.server.w))))
    models = []
    for t in range(ROUNDS):
        sim.run_round(t)
        models.append(sim.server.w.to("cpu", copy=True))
    return names, start, models


@pytest.mark.parametrize("method, overrides", [
    ("fedavg", ["algo=fedavg"]),
    ("fedswa", ["algo=fedswa", "algo.scale=2", "adapter.modules_to_save=[]"]),
])
def test_lora_runs_equal_fedswas_code(method, overrides):
    """Every round's global adapters (and head) of the code and of fedflat agree to float32 rounding: the same
    operations in another grouping (fedflat's flat vector, the code's tensors), about 1e-7 of values of order 0.1."""
    x, y, model_fn = problem()
    names, start, ours = fedflat_run(overrides, x, y, model_fn)
    theirs = code_run(method, x, y, model_fn, start)
    for round_, (state, w) in enumerate(zip(theirs, ours)):
        flat = torch.cat([state[n].reshape(-1) for n in names])
        torch.testing.assert_close(w, flat, rtol=0, atol=5e-7, msg=f"{method}, round {round_ + 1}")
    moved = [n for n in names if "lora_B" in n]
    assert moved and not torch.equal(ours[-1], ours[0])  # the adapters trained (B left zero)
