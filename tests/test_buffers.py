"""Models with buffers, BatchNorm and dropout: federated correctly, or refused before round 0 with a reason.

The BatchNorm + dropout CNN (``model.norm=batch model.dropout=0.3``) trains with five methods on both engines;
the accuracy a run reports is the accuracy of its ``model.pt`` loaded strictly into a fresh module in eval mode;
the server's running statistics are the clients' averaged with the round's weights, checked by hand; dropout
masks come from each client's keyed stream; FedBN keeps every client's BatchNorm on it. The executors (Ray,
Flower) and resuming have their tests in test_ray.py, test_flower.py and test_resume.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from agreement import bitwise
from conftest import BN_DROPOUT_CNN, tiny_tree
from numerics import U32, U64, assert_close_normwise
from torch import nn

import fedflat
from fedflat.algorithms.fedper import PERSONAL_MODEL
from fedflat.config import load_config
from fedflat.core import BUFFERS, ConfigError, stream_seed, torch_stream
from fedflat.engine.client import local_schedule
from fedflat.engine.checkpoint import CHECKPOINT, load_run
from fedflat.engine.modes import inspect_module
from fedflat.engine.problem import choose_engine, vmap_problem
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.models import build_model
from fedflat.params import FlatModel

# clients of 7 to 60 samples in batches of 7: unequal step counts and short last batches (the vectorized engine's
# padding and masking), two rounds
UNEQUAL = ("rounds=2", "train.batch_size=7", "threads=1")
METHODS = ["fedavg", "scaffold", "fedsam", "fedlesam", "feddyn"]


def _cfg(*overrides: str):
    return load_config(None, list(overrides), base=tiny_tree())


def _fresh_cnn() -> nn.Module:
    return build_model("cnn", (1, 8, 8), 3, padding=2, norm="batch", dropout=0.3)


@torch.no_grad()
def _eval_mode_scores(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, float]:
    """Correct predictions and mean cross-entropy of a plain module in eval mode (no fedflat code involved), on the
    data's device (the run's)."""
    module.to(x.device).eval()
    logits = module(x)
    return int((logits.argmax(1) == y).sum()), float(F.cross_entropy(logits.double(), y))


# -- the reported accuracy is the saved model's, on both engines, which agree ------------------------------------
@pytest.mark.parametrize("algo", [*METHODS[:3], *(pytest.param(a, marks=pytest.mark.slow) for a in METHODS[3:])])
def test_reported_accuracy_is_model_pt_in_eval_mode_and_the_engines_agree(algo, tmp_path):
    runs = {}
    for engine in ("sequential", "vectorized"):
        folder = tmp_path / engine
        runs[engine] = history = fedflat.run(_cfg(f"algo={algo}", *BN_DROPOUT_CNN, *UNEQUAL, f"engine={engine}"),
                                             run_dir=folder, progress=False)
        module = _fresh_cnn()
        module.load_state_dict(torch.load(folder / "model.pt", weights_only=True), strict=True)
        data = Simulation(_cfg(*BN_DROPOUT_CNN)).dataset
        correct, loss = _eval_mode_scores(module, data.x_test, data.y_test)
        assert history.summary["final_test_acc"] == correct / len(data.y_test)
        # the run sums per-sample losses of eval batches in float64: 60 float32 terms, relative u32 each
        assert history.summary["final_test_loss"] == pytest.approx(loss, rel=60 * U32)
        assert history.summary["buffers"] == 2 * (2 * 64 + 1)  # two BatchNorm2d(64): mean, var, count
        assert module.conv[1].num_batches_tracked > 0 and not torch.equal(module.conv[1].running_var.cpu(),
                                                                          torch.ones(64))
    seq, vec = runs["sequential"], runs["vectorized"]
    # The engines differ only in the rounding of the gradients' reductions (vmap's grouped convolutions against a
    # loop; at most 25 x 64 products per output), compounded over at most 18 steps in each of 2 rounds: 2^10 u32.
    assert_close_normwise(vec.final_parameters, seq.final_parameters, 2 ** 10 * U32, "parameters")
    for key, value in seq.state_dict.items():
        if value.is_floating_point():
            assert_close_normwise(vec.state_dict[key], value, 2 ** 10 * U32, key)
        else:  # num_batches_tracked: the same steps on both engines
            assert torch.equal(vec.state_dict[key], value), key
    assert [m["test_acc"] for m in vec.metrics] == [m["test_acc"] for m in seq.metrics]


def test_buffers_are_counted_in_communication_and_load_back_from_model_pt(tmp_path):
    history = fedflat.run(_cfg(*BN_DROPOUT_CNN, "rounds=1"), run_dir=tmp_path / "run", progress=False)
    P = history.summary["parameters"]
    # the model and the train loss as float32, the buffers at their own dtypes: 2 x (64 + 64) float32, 2 int64
    assert history.metrics[-1]["up_bytes"] == 4 * (P + 1) + 2 * (2 * 64 * 4 + 8)
    assert history.metrics[-1]["down_bytes"] == 4 * P + 2 * (2 * 64 * 4 + 8)
    (tmp_path / "run" / CHECKPOINT).unlink()  # load_run falls back to model.pt: the buffers come with it
    sim = load_run(tmp_path / "run")
    assert torch.equal(sim.server.buffers.cpu(), FlatModel(_loaded(tmp_path / "run")).initial_buffers)
    assert sim.evaluate()[0] == history.summary["final_test_acc"]


def _loaded(folder) -> nn.Module:
    module = _fresh_cnn()
    module.load_state_dict(torch.load(folder / "model.pt", weights_only=True), strict=True)
    return module


# -- the server's statistics: the clients', averaged with the round's weights -------------------------------------
def _bn_logreg() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.BatchNorm1d(16), nn.Linear(16, 3))


def test_aggregated_running_statistics_equal_a_hand_computation():
    """Full-batch steps (batch 1000 > every client's samples), two local epochs, sample-weighted FedAvg: client i's
    statistics after two steps from (0, 1) with momentum 0.1 are ``m_i (0.1 + 0.09)`` and ``0.81 + v_i (0.1 +
    0.09)`` (``m_i``, ``v_i`` its samples' mean and unbiased variance), its count 2; the server's are their average
    with ``p_i = n_i / sum n_j``."""
    sim = Simulation(_cfg("algo.weighting=samples", "train.local_epochs=2", "train.batch_size=1000", "rounds=1"),
                     UserInputs(model_fn=_bn_logreg))
    clients = sim.server.sample_clients(0).tolist()
    sim.run_round(0)
    n = torch.tensor([len(sim.client_indices[c]) for c in clients], dtype=torch.float64)
    p = n / n.sum()
    means, variances = [], []
    for c in clients:
        x = sim.dataset.x_train[sim.client_indices[c]].flatten(1).double()
        means.append(x.mean(0))
        variances.append(x.var(0, unbiased=True))
    mean = sum(pi * (0.1 + 0.9 * 0.1) * m for pi, m in zip(p, means))
    var = sum(pi * (0.81 + (0.1 + 0.9 * 0.1) * v) for pi, v in zip(p, variances))
    state = sim.server.model_state()
    # float32 kernels: a handful of roundings of values of order one per statistic
    assert_close_normwise(state["1.running_mean"], mean, 16 * U32, "running_mean")
    assert_close_normwise(state["1.running_var"], var, 16 * U32, "running_var")
    assert int(state["1.num_batches_tracked"]) == 2


def test_each_local_step_updates_the_statistics_once_and_counts_average_to_the_nearest_integer():
    """FedSAM takes two forward passes per step (ascent, descent) and the statistics move once per step (the SAM
    authors' ``disable_running_stats`` for the second). With batches of 10, clients take ``E_i = ceil(n_i / 10)``
    steps; the server's count is ``round(sum p_i E_i)`` (uniform weights: the mean, half to even)."""
    sim = Simulation(_cfg("algo=fedsam", "train.batch_size=10", "rounds=1"), UserInputs(model_fn=_bn_logreg))
    opened = sim.server.begin_round(0)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    counts = result.upload[BUFFERS][:, -1]  # the layout's last entry: num_batches_tracked
    assert counts.tolist() == opened.task.steps.double().tolist()
    sim.server.finish_round(opened, result)
    expected = torch.tensor(opened.task.steps.double().mean().item()).round()
    assert sim.server.model_state()["1.num_batches_tracked"] == expected.long()


# -- dropout: masks from each client's own stream, the same on both engines ---------------------------------------
class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.out(F.dropout(torch.relu(self.hidden(x.flatten(1))), 0.5, self.training))


def test_dropout_masks_come_from_the_clients_stream():
    """One local step of one client by hand: its batch from its ``batches`` stream, the keep-mask of F.dropout
    from ``torch_stream(seed, 0, client, "dropout")`` (``rand < 1 - p``, kept values scaled by ``1 / (1 - p)``)."""
    # on CUDA the sequential engine: the hand computation's F.linear is its kernel (agreement.bitwise)
    cfg = _cfg(*bitwise("train.local_steps=1", "train.weight_decay=0", "train.clip=null", "rounds=1"))
    sim = Simulation(cfg, UserInputs(model_fn=DropoutMLP))
    opened = sim.server.begin_round(0)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    client = int(opened.task.ids[0])
    (batch,) = local_schedule(sim.client_indices[client], 1, 10, torch_stream(0, 0, client, "batches"))
    x, y = sim.dataset.x_train[batch].flatten(1), sim.dataset.y_train[batch]
    w = sim.server.w.clone().requires_grad_(True)
    weight1, bias1, weight2, bias2 = sim.model.layout.views(w)
    keep = torch.rand((len(batch), 12), generator=torch_stream(0, 0, client, "dropout", sim.device),
                      device=sim.device) < 0.5  # the stream on the run's device, as the engine draws it
    hidden = torch.relu(F.linear(x, weight1, bias1)) * keep.float().div(0.5)
    (grad,) = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight2, bias2), y), w)
    # w - eta g as torch.optim.SGD (and fedflat's engine) computes it: one fused add with alpha = -eta
    assert torch.equal(result.upload["model"][0], torch.add(w, grad, alpha=-sim.server.lr_at(0)).detach())


def test_dropout_gives_the_same_training_on_both_engines_and_any_chunking():
    """The vectorized engine draws each client's masks from the same stream, chunk by chunk: runs agree with the
    sequential engine's to rounding (2^10 u32, as the CNN's), and chunkings of the vectorized engine likewise."""
    finals = [fedflat.run(_cfg(*UNEQUAL, *extra), model_fn=DropoutMLP, save=False, progress=False).final_parameters
              for extra in (["engine=sequential"], ["engine=vectorized"], ["engine=vectorized", "chunk_size=1"])]
    for other in finals[1:]:
        assert_close_normwise(other, finals[0], 2 ** 10 * U32)
    no_dropout = fedflat.run(_cfg(*UNEQUAL), save=False, progress=False).final_parameters
    assert no_dropout.shape != finals[0].shape or not torch.equal(no_dropout, finals[0])


class StochasticDepth(nn.Module):
    """A residual branch dropped per sample with torch.bernoulli: randomness outside PyTorch's dropout functions."""

    def __init__(self):
        super().__init__()
        self.inp, self.branch, self.out = nn.Linear(16, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x.flatten(1)))
        if self.training:
            h = h + self.branch(h) * torch.bernoulli(torch.full((x.shape[0], 1), 0.8, device=x.device)) / 0.8
        return self.out(h)


def test_other_random_operations_draw_from_the_clients_stream_on_the_sequential_engine():
    """The global generator is seeded from the client's stream ``"forward"`` while it trains (one local step by
    hand); the vectorized engine, which cannot key such draws per client, refuses the module."""
    sim = Simulation(_cfg(*bitwise("train.local_steps=1", "train.weight_decay=0", "train.clip=null")),
                     UserInputs(model_fn=StochasticDepth))
    opened = sim.server.begin_round(0)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    client = int(opened.task.ids[0])
    (batch,) = local_schedule(sim.client_indices[client], 1, 10, torch_stream(0, 0, client, "batches"))
    reference = StochasticDepth().to(sim.device)
    reference.load_state_dict(sim.model.state_dict(sim.server.w))
    with torch.random.fork_rng(devices=[sim.device] if sim.device.type == "cuda" else []):  # the engine's generator
        torch.manual_seed(stream_seed(0, 0, client, "forward"))
        loss = F.cross_entropy(reference(sim.dataset.x_train[batch]), sim.dataset.y_train[batch])
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    step = torch.cat([torch.add(p, g, alpha=-sim.server.lr_at(0)).detach().reshape(-1)
                      for p, g in zip(reference.parameters(), grads)])
    assert torch.equal(result.upload["model"][0], step)
    with pytest.raises(ConfigError, match=r"model StochasticDepth cannot run under torch.func.vmap \(its forward draws "
                                          r"random numbers \(bernoulli\) outside PyTorch's dropout functions"):
        Simulation(_cfg("engine=vectorized"), UserInputs(model_fn=StochasticDepth))


# -- train() for training, eval() for every evaluation -----------------------------------------------------------
class ModeLog(nn.Module):
    """A BatchNorm MLP that records the mode of each of its forward passes."""

    def __init__(self, log: list[bool]):
        super().__init__()
        self.log = log
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        self.log.append(self.training)
        return self.body(x)

    def features(self, x):
        self.log.append(self.training)
        return self.body[:4](x)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_training_runs_in_train_mode_and_every_evaluation_in_eval_mode(engine):
    from fedflat.metrics.objective import client_objective, global_objective
    from fedflat.metrics.representations import penultimate_features

    log: list[bool] = []
    sim = Simulation(_cfg("algo=qfedavg", f"engine={engine}"), UserInputs(model_fn=lambda: ModeLog(log)))
    log.clear()
    sim.run_round(0)  # q-FedAvg's F_i(w^t) is an evaluation inside the clients' round
    assert True in log and False in log
    for evaluation in (sim.evaluate, lambda: global_objective(sim, 30).loss(sim.server.w),
                       lambda: client_objective(sim, 0, 10).grad(sim.server.w),
                       lambda: penultimate_features(sim, samples=20)):
        log.clear()
        evaluation()
        assert log and not any(log)


# -- checked before round 0 -------------------------------------------------------------------------------------
class ShrinksItsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x.flatten(1))


class RandomWhenEvaluated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x):
        return F.dropout(self.lin(x.flatten(1)), 0.5)  # training=True by default: random in eval mode too


class CountsInAHiddenBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.lin(x.flatten(1))


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x):
        out = self.lin(x.flatten(1))
        return out if out.mean() > 0 else -out


@pytest.mark.parametrize("model_fn, says", [
    (ShrinksItsWeights, "model ShrinksItsWeights: its forward pass changes its parameters in place"),
    # F.dropout is bernoulli_ on a CPU, CUDA's fused native_dropout on a GPU
    (RandomWhenEvaluated, r"model RandomWhenEvaluated draws random numbers in eval\(\) mode "
                          r"\((bernoulli_|native_dropout)\)"),
    (CountsInAHiddenBuffer, "changes the non-persistent buffer 'calls'.*persistent=True"),
    (lambda: nn.Sequential(nn.Flatten(), nn.LazyLinear(3)), r"uninitialized \(lazy\) parameters"),
])
def test_what_fedflat_cannot_train_correctly_is_refused_before_round_0(model_fn, says):
    with pytest.raises(ConfigError, match=says):
        Simulation(_cfg(), UserInputs(model_fn=model_fn))


def test_a_module_vmap_cannot_run_is_refused_by_the_vectorized_engine_and_auto_says_why():
    with pytest.raises(ConfigError, match=r"^engine=vectorized: model BranchesOnData cannot run under torch.func.vmap "
                                          r"\(RuntimeError: .*data-dependent control flow.*; use engine=sequential"):
        Simulation(_cfg("engine=vectorized"), UserInputs(model_fn=BranchesOnData))
    sim = Simulation(_cfg("engine=sequential"), UserInputs(model_fn=BranchesOnData))  # the loop runs it
    sim.run_round(0)
    # BatchNorm's cumulative average (momentum=None) reads its count as a Python number: the loop only
    cumulative = FlatModel(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(16, momentum=None), nn.Linear(16, 3)))
    x, y = sim.dataset.x_train[:4].cpu(), sim.dataset.y_train[:4].cpu()  # the fresh module's device
    problem = vmap_problem(cumulative, inspect_module(cumulative, x), x, y)
    assert problem and "\n" not in problem
    cnn = Simulation(_cfg(*BN_DROPOUT_CNN))  # BatchNorm with momentum and dropout: vmap runs them
    assert vmap_problem(cnn.model, cnn.report.traits, cnn.dataset.x_train[:4], cnn.dataset.y_train[:4]) is None
    with pytest.warns(UserWarning, match="engine=auto: model Sequential cannot run under torch.func.vmap .*: its "
                                         "clients train on the sequential engine"):
        assert choose_engine("auto", "vectorized", problem, cumulative.module) == "sequential"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_engine("auto", "vectorized", None, cumulative.module) == "vectorized"


# -- any registered buffer, shared parameters: federated, and model.pt loads strictly ----------------------------
class Tracked(nn.Module):
    """BatchNorm1d, functional dropout, a persistent buffer of its own (training passes seen) and a weight shared
    by two layers."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.mid.weight = self.inp.weight
        self.norm = nn.BatchNorm1d(16)
        self.register_buffer("passes", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.passes += 1
        h = torch.relu(self.norm(self.inp(x.flatten(1))))
        return self.out(F.dropout(torch.relu(self.mid(h)), 0.2, self.training))


def test_a_users_module_with_its_own_buffer_and_a_shared_weight_saves_a_strict_model_pt(tmp_path):
    history = fedflat.run(_cfg("rounds=2"), model_fn=Tracked, run_dir=tmp_path / "run", progress=False)
    module = Tracked()
    module.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True), strict=True)
    assert module.mid.weight is module.inp.weight and int(module.passes) > 0
    sim = Simulation(_cfg())
    correct, _ = _eval_mode_scores(module, sim.dataset.x_test, sim.dataset.y_test)
    assert history.summary["final_test_acc"] == correct / len(sim.dataset.y_test)


def test_a_shared_weight_gets_the_gradient_of_both_its_uses():
    model = FlatModel(Tracked())
    x, y = torch.randn(6, 1, 4, 4), torch.randint(0, 3, (6,))
    w = model.initial.clone().requires_grad_(True)
    model.module.eval()
    model.bind_buffers(model.buffer_layout.tensors(model.initial_buffers))
    (grad,) = torch.autograd.grad(F.cross_entropy(model.call_views(model.layout.views(w), x), y), w)
    plain = Tracked()
    plain.load_state_dict(model.state_dict(model.initial, model.initial_buffers))
    plain.eval()
    F.cross_entropy(plain(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    assert_close_normwise(grad, expected, 64 * U32)


# -- FedBN: BatchNorm stays on each client ------------------------------------------------------------------------
def test_fedbn_keeps_each_clients_batch_norm_and_averages_everything_else():
    """Three styled domains, two clients each (the feature shift FedBN targets), every client in every round.
    Each client's BatchNorm statistics and affine parameters are its own and differ; every other parameter is the
    server's average of the uploads; each client is evaluated with its own BatchNorm."""
    cfg = _cfg("algo=fedbn", "model=cnn", "model.padding=2", "model.norm=batch", "data.options.shape=[1,8,8]",
               "data.options.domains=3", "data.num_clients=6", "data.partition.scheme=domain",
               "data.partition.per_domain=2", "sampling.clients_per_round=6", "eval.batch_size=7")
    sim = Simulation(cfg)
    private = sim.algorithm.parts["personalization"].private(sim.settings)
    for t in range(2):
        sim.run_round(t)
    opened = sim.server.begin_round(2)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    w_before = sim.server.w.clone()
    sim.server.finish_round(opened, result)
    shared = ~private
    by_hand = w_before + (result.upload["model"] - w_before).mean(0)  # FedAvg, uniform weights
    assert_close_normwise(sim.server.w[shared], by_hand[shared], 4 * U32, "shared parameters")
    assert torch.equal(sim.server.w[private], sim.model.initial[private])  # the server never learns a client's BN
    assert torch.equal(sim.server.buffers, sim.model.initial_buffers)  # every buffer of this CNN is a BatchNorm's
    ids = torch.arange(6)
    state, known = sim.server.load_state(ids)
    assert known[BUFFERS].all() and known[PERSONAL_MODEL].all()
    own = state[BUFFERS]
    for i in range(6):
        for j in range(i + 1, 6):
            assert not torch.equal(own[i], own[j]) and not torch.equal(state[PERSONAL_MODEL][i][private],
                                                                        state[PERSONAL_MODEL][j][private])
    # each client's model: the global one with its own BatchNorm, in eval mode on its own test share
    models = sim.algorithm.parts["personalization"].models(sim.server.w, state, known, sim.settings)
    correct = 0
    for c in range(6):
        module = build_model("cnn", (1, 8, 8), 3, padding=2, norm="batch")
        module.load_state_dict(sim.model.state_dict(models[c], own[c]), strict=True)
        share = sim.client_tests[c]
        correct += _eval_mode_scores(module, sim.dataset.x_test[share], sim.dataset.y_test[share])[0]
    total = sum(len(s) for s in sim.client_tests)
    assert sim.evaluate()[0] == correct / total
    assert torch.allclose(models[:, shared], sim.server.w[shared].expand(6, -1), rtol=0, atol=0)


@pytest.mark.slow
def test_fedbn_passes_the_checks_every_part_passes():
    """fedflat.testing.check_part on the BatchNorm CNN: the contract kept, both engines agree, it composes with
    FedSAM, a resumed run ends bit for bit where an uninterrupted one does."""
    from fedflat.algorithms.fedbn import FedBN
    from fedflat.testing import TINY, check_part

    tree = {**TINY, "model": {"name": "cnn", "padding": 2, "norm": "batch", "dropout": 0.3},
            "data": {**TINY["data"], "options": {**TINY["data"]["options"], "shape": [1, 8, 8]}}}
    report = check_part(FedBN, recipe="fedbn", tree=tree)
    assert report["contract"] == "kept" and report["checkpoint"].endswith("bit for bit")


def test_fedbn_on_a_model_without_batch_norm_says_what_to_use():
    with pytest.raises(ConfigError, match="personalization=fedbn keeps BatchNorm layers.*model.norm=batch"):
        Simulation(_cfg("algo=fedbn"))


def test_float64_buffers_round_trip_and_average_exactly():
    """The flat buffer vector holds float32 statistics and int64 counts exactly; the average of equal rows is the
    row, bit for bit (FedBN's private entries, uploaded as broadcast)."""
    layout = FlatModel(_fresh_cnn()).buffer_layout
    b = torch.randn(layout.size, dtype=torch.float64).float().double()
    b[[129 - 1, 258 - 1]] = torch.tensor([2.0 ** 40 + 1, 7.0], dtype=torch.float64)
    assert torch.equal(layout.pack(layout.tensors(b)), b)
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float32)
    assert torch.equal(layout.average(b, b.expand(3, -1), weights), b)
    rows = b.expand(3, -1).clone()
    rows[:, 0] += torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    exact = b[0] + (weights.double() * torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)).sum()
    # the float64 sum in another order (a few u64), then one rounding to float32
    assert abs(layout.average(b, rows, weights)[0] - exact) <= (U32 + 8 * U64) * abs(exact)
