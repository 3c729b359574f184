"""fedflat against the methods' public code on one tiny problem, round by round (docs/algorithms.md, "Conformance").

The problem: 4 clients of unequal sizes, 26, 14, 18 and 22 samples (8 features, 3 classes, drawn from a fixed seed;
unequal, so that a code weighting its clients by their samples and one averaging them uniformly give different
models), an 8-6-3 tanh MLP with fixed initial weights, full participation, full-batch local steps (3 per round: a
batch of 26 holds every client's data), ``eta_l`` 0.1 decaying by 0.9 per round, coupled weight decay 0.01, 3 rounds.
Client 0 is the largest: FL-Simulator and the codes built on it take client 0's step count (its samples over the
batch size, times the epochs) as every client's, which is then every client's real one. Each method runs in its
authors' code and in fedflat with the overrides of the conformance table, and the global models are compared after
every round (the largest absolute difference).

    python scripts/conformance.py --fl-simulator PATH --fedlesam PATH --fedwmsam PATH [--clip 0.3]

Each ``PATH`` is a checkout of github.com/woodenchild95/FL-Simulator, MediaBrain-SJTU/FedLESAM or
Huang-Yongzhi/NeurlPS_FedWMSAM (any subset). Their code is imported as it is, with two replacements, both named in
the output: their ``dataset.Dataset`` (it reads image files through torchvision) by one over tensors, and, for
FedLESAM's and FedWMSAM's optimizers, ``first_step``, which reads a flat vector per parameter tensor
(``g_update[idx]``: one scalar shift per tensor, and a norm over those scalars), by the same step on the whole
vector with one L2 norm, as both papers write. ``--clip`` sets every code's ``max_norm`` (10 in all of them; the
clip binds on this problem below about 1) and fedflat's ``train.clip``; ``--clip-scope`` fedflat's.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import types
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils import data

from fedflat.config import load_config
from fedflat.data import Dataset
from fedflat.engine.simulation import Simulation, UserInputs

SIZES = (26, 14, 18, 22)  # each client's samples (module docstring)
CLIENTS, SAMPLES, BATCH = len(SIZES), sum(SIZES), max(SIZES)
FEATURES, CLASSES, ROUNDS, STEPS = 8, 3, 3, 3
LR, LR_DECAY, WD = 0.1, 0.9, 0.01
# The codes' hyperparameters (their argparse names) and the same values under fedflat's names.
CODE_ARGS = {"alpha": 0.1, "lamb": 0.1, "rho": 0.05, "beta1": 0.9, "beta2": 0.99, "epsilon": 0.01,
             "global_learning_rate": 1.0}

# (repository, the code's method, its server class, fedflat's overrides reproducing it, the code's own changes)
FL_SIMULATOR = [
    ("FedAvg", "FedAvg", ["algo=fedavg"]),
    ("FedProx", "FedProx", ["algo=fedprox", "algo.mu=0.1"]),
    ("SCAFFOLD", "SCAFFOLD", ["algo=scaffold"]),
    ("FedDyn", "FedDyn", ["algo=feddyn", "algo.alpha=0.1"]),
    ("FedCM", "FedCM", ["algo=fedcm", "algo.a=0.1"]),
    ("FedAdam", "FedAdam", ["algo=fedadam", "algo.server_lr=1.0", "algo.b1=0.9", "algo.b2=0.99", "algo.tau=0.01"]),
    ("FedSAM", "FedSAM", ["algo=fedsam", "algo.rho=0.05"]),
    ("MoFedSAM", "MoFedSAM", ["algo=mofedsam", "algo.rho=0.05", "algo.a=0.1"]),
    ("FedGamma", "FedGamma", ["algo=fedgamma", "algo.rho=0.05"]),
    ("FedSMOO", "FedSMOO", ["algo=fedsmoo", "algo.rho=0.05", "algo.alpha=0.1"]),
    ("FedSpeed", "FedSpeed", ["algo=fedspeed", "algo.rho=0.05", "algo.alpha=0.1"]),
]
LESAM = ["algo.rho=0.05", "algo.reference=previous_round"]
FEDLESAM = [
    ("FedLESAM", "FedLESAM", ["algo=fedlesam", *LESAM]),
    ("FedLESAM_S", "FedLESAM_S", ["algo=fedlesam-s", *LESAM, "algo.lamb=0.1"]),
    ("FedLESAM_D", "FedLESAM_D", ["algo=fedlesam-d", *LESAM, "algo.alpha=0.1"]),
]
FEDWMSAM = [
    ("FedWMSAM", "FedWMSAM", ["algo=fedwmsam", "algo.rho=0.05", "algo.a=0.1", "algo.sign=code"]),
    ("FedLESAM_S", "FedLESAM_S", ["algo=fedlesam-s", *LESAM, "algo.lamb=0.1"]),
]
CODE_MODULES = ("client", "server", "optimizer", "utils", "dataset", "models")


def problem() -> tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    torch.manual_seed(1)
    initial = nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, CLASSES)).state_dict()

    def model_fn() -> nn.Module:
        module = nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, CLASSES))
        module.load_state_dict(initial)
        return module
    return x, y, model_fn


def client_indices() -> list[list[int]]:
    """Each client's samples of the problem's ``x``, ``y``: consecutive runs of :data:`SIZES`."""
    ends = np.cumsum(SIZES)
    return [list(range(end - size, end)) for size, end in zip(SIZES, ends)]


def shares(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each client's ``(x_i, y_i)``."""
    return [(x[idx], y[idx]) for idx in client_indices()]


def sample_weights() -> torch.Tensor:
    """``n_i / n``: the weights of a code that averages its clients by their samples."""
    sizes = torch.tensor(SIZES, dtype=torch.float32)
    return sizes / sizes.sum()


def code_rounds(x: torch.Tensor, y: torch.Tensor, model_fn: Callable[[], nn.Module],
                train: Callable[[nn.Module, nn.Module, torch.Tensor, torch.Tensor, int], None],
                weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The global model after each of :data:`ROUNDS` rounds of a code's round loop as a test writes it out: each
    client starts from the server's model and ``train(model, server, x_i, y_i, t)`` trains ``model`` in place (the
    code's client), then the server averages the clients' parameters with ``weights`` (None: uniformly; a code
    weighting by samples: :func:`sample_weights`)."""
    server, models = model_fn(), []
    for t in range(ROUNDS):
        finals = []
        for xi, yi in shares(x, y):
            model = model_fn()
            model.load_state_dict(server.state_dict())
            train(model, server, xi, yi, t)
            finals.append(nn.utils.parameters_to_vector(model.parameters()).detach())
        stacked = torch.stack(finals)
        mean = stacked.mean(0) if weights is None else (weights[:, None] * stacked).sum(0)
        nn.utils.vector_to_parameters(mean, server.parameters())
        models.append(mean)
    return models


class TensorSamples(data.Dataset):
    """The codes' ``dataset.Dataset(x, y, train, dataset_name)`` over tensors (theirs reads images)."""

    def __init__(self, x, y, train: bool = True, dataset_name: str = ""):
        self.x, self.y = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@torch.no_grad()
def whole_vector_first_step(self, g_update) -> None:
    """FedLESAM's/FedWMSAM's ``first_step`` on the whole flat vector: ``e = -rho g / ||g||`` (one L2 norm), each
    tensor shifted by its own slice (the codes shift tensor ``idx`` by the scalar ``g_update[idx]``)."""
    params = [p for group in self.param_groups for p in group["params"]]
    if g_update is None:
        return
    scale = self.param_groups[0]["rho"] / (g_update.norm() + 1e-7)
    offset = 0
    for p in params:
        e_w = -g_update[offset: offset + p.numel()].view_as(p) * scale
        offset += p.numel()
        p.add_(e_w)
        self.state[p]["e_w"] = e_w


def code_run(repo: Path, method: str, server_class: str, x, y, model_fn, clip: float) -> list[torch.Tensor]:
    """The global model after each round, computed by the code in ``repo``."""
    for name in list(sys.modules):
        if name.split(".")[0] in CODE_MODULES:
            del sys.modules[name]
    sys.path.insert(0, str(repo))
    try:
        sys.modules["dataset"] = types.SimpleNamespace(Dataset=TensorSamples)
        # the server package without its __init__ (FedLESAM's imports two servers the repository lacks)
        sys.modules["server"] = types.ModuleType("server")
        sys.modules["server"].__path__ = [str(repo / "server")]
        import optimizer
        for name in ("LESAM", "LESAM_S", "LESAM_D", "WMSAM"):
            if hasattr(optimizer, name):
                getattr(optimizer, name).first_step = whole_vector_first_step
        from utils import get_mdl_params
        server_type = getattr(importlib.import_module(f"server.{server_class}"), server_class)
        args = types.SimpleNamespace(
            seed=0, total_client=CLIENTS, active_ratio=1.0, comm_rounds=ROUNDS, local_epochs=STEPS, batchsize=BATCH,
            weight_decay=WD, local_learning_rate=LR, lr_decay=LR_DECAY, use_RI=False, beta=0.1, gamma=1.0,
            method=method, dataset="CIFAR10", model="", non_iid=False, split_rule="", split_coef=0.0, mode="",
            out_file="/tmp/fedflat-conformance", cuda=0, **CODE_ARGS)
        split = types.SimpleNamespace(client_x=[xi.numpy() for xi, _ in shares(x, y)],
                                      client_y=[yi.numpy() for _, yi in shares(x, y)],
                                      test_x=x.numpy(), test_y=y.numpy())
        init = model_fn()
        with contextlib.redirect_stdout(io.StringIO()):
            srv = server_type(device=torch.device("cpu"), model_func=model_fn, init_model=init,
                                                init_par_list=get_mdl_params(init), datasets=split, method=method,
                                                args=args)
            models: list[torch.Tensor] = []
            srv._test_ = lambda t, selected: models.append(srv.server_model_params_list.clone())
            srv._save_results_ = srv._summary_ = lambda: None
            client_class = srv.Client
            srv.Client = lambda *a, **k: _with_clip(client_class(*a, **k), clip)
            srv.train()
        return models
    finally:
        sys.path.remove(str(repo))


def _with_clip(client, clip: float):
    client.max_norm = clip
    return client


def fedflat_run(overrides: list[str], x, y, model_fn, clip: float, scope: str) -> list[torch.Tensor]:
    """The global model after each round of fedflat's run of the problem, on the CPU where the codes' models are
    (fedflat's run on its configured device: ``pytest --device cuda`` compares a GPU run with the codes)."""
    tree = {"seed": 0, "rounds": ROUNDS, "data": {"name": "synthetic", "num_clients": CLIENTS},
            "model": {"name": "mlp"}, "algo": {"name": "fedavg"}, "sampling": {"clients_per_round": CLIENTS},
            "train": {"local_epochs": STEPS, "batch_size": BATCH, "lr": LR, "lr_decay": LR_DECAY,
                      "weight_decay": WD, "clip": clip, "clip_scope": scope}, "threads": 1}
    cfg = load_config(None, overrides, base=tree)
    dataset = Dataset("conformance", x, y, x, y, CLASSES)
    sim = Simulation(cfg, UserInputs(dataset=dataset, model_fn=model_fn, clients=client_indices()))
    models = []
    for t in range(ROUNDS):
        sim.run_round(t)
        models.append(sim.server.w.to("cpu", copy=True))
    return models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fl-simulator", type=Path, help="a checkout of github.com/woodenchild95/FL-Simulator")
    parser.add_argument("--fedlesam", type=Path, help="a checkout of github.com/MediaBrain-SJTU/FedLESAM")
    parser.add_argument("--fedwmsam", type=Path, help="a checkout of github.com/Huang-Yongzhi/NeurlPS_FedWMSAM")
    parser.add_argument("--clip", type=float, default=10.0, help="the codes' max_norm and fedflat's train.clip")
    parser.add_argument("--clip-scope", default="loss", choices=["loss", "step"], help="fedflat's train.clip_scope")
    parser.add_argument("--also", nargs="*", default=[], help="further fedflat overrides for every method")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y, model_fn = problem()
    scale = float(model_fn()[0].weight.detach().abs().mean())
    print(f"clip {args.clip}, fedflat clip_scope {args.clip_scope}; the largest |difference| of the global model "
          f"after rounds 1..{ROUNDS} (its entries are of order {scale:.2f}):")
    for repo, methods in ((args.fl_simulator, FL_SIMULATOR), (args.fedlesam, FEDLESAM), (args.fedwmsam, FEDWMSAM)):
        if repo is None:
            continue
        for method, server_class, overrides in methods:
            theirs = code_run(repo, method, server_class, x, y, model_fn, args.clip)
            ours = fedflat_run(overrides + args.also, x, y, model_fn, args.clip, args.clip_scope)
            gaps = [float((a - b).abs().max()) for a, b in zip(theirs, ours)]
            print(f"  {repo.name}:{method:<11} {' '.join(f'{g:.1e}' for g in gaps)}   fedflat {' '.join(overrides)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
