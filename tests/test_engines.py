"""The sequential and vectorized engines: same batches, same random numbers, same results.

The tiny problem has unequal client sizes (7 to 60 samples) and batch size 7, so a round mixes
clients with 2 and 18 local steps and last batches of different sizes: the vectorized engine pads
both the step count (masking) and the batch (weights), and must still reproduce the sequential run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import model_for

import fedflat
from fedflat.algorithms import PARTS, RECIPES, build_algorithm
from fedflat.core import Batch, ConfigError
from fedflat.data import Dataset
from fedflat.engine import runtime as runtime_module
from fedflat.engine.client import stack_batches
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.client import Oracle
from fedflat.engine.runtime import auto_chunk_size, engine_choice, resolve_engine
from fedflat.engine.simulation import Simulation
from fedflat.params import FlatModel

UNEQUAL = ("rounds=2", "train.batch_size=7", "train.local_epochs=2")
RTOL, ATOL = 1e-4, 1e-5


def _metrics(history) -> list[dict]:
    return [{k: v for k, v in m.items() if "seconds" not in k} for m in history.metrics]


def _assert_runs_agree(first, second, rel: float | None = None) -> None:
    """The runs' final parameters and metrics agree within ``rel`` relative to their scale (RTOL/ATOL where no bound
    is derived)."""
    rtol, atol = (RTOL, ATOL) if rel is None else (rel, rel * first.final_parameters.abs().max().item())
    torch.testing.assert_close(second.final_parameters, first.final_parameters, rtol=rtol, atol=atol)
    for a, b in zip(_metrics(first), _metrics(second), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=rtol, abs=atol), key
            else:
                assert a[key] == b[key], key


def _vectorizable(name: str) -> bool:
    return all(getattr(p, "supports_vectorized", True) for p in build_algorithm({"name": name}).parts.values())


def _sequential_and(tiny, name: str, engine: str):
    """``(sequential run, the run on engine)`` of recipe ``name`` on the unequal tiny problem, or ``(run, None)`` for
    a method with a part that cannot train a cohort at once, which ``engine`` must refuse by name."""
    model = model_for(name)
    sequential = fedflat.run(tiny(f"algo={name}", *UNEQUAL, *model, "engine=sequential"), save=False, progress=False)
    if not _vectorizable(name):
        with pytest.raises(ConfigError, match="does not support training a cohort at once"):
            Simulation(tiny(f"algo={name}", *UNEQUAL, *model, f"engine={engine}"))
        return sequential, None
    other = fedflat.run(tiny(f"algo={name}", *UNEQUAL, *model, f"engine={engine}"), save=False, progress=False)
    assert other.summary["engine"] == engine and sequential.summary["engine"] == "sequential"
    return sequential, other


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_engines_agree_for_every_method(tiny, name):
    sequential, vectorized = _sequential_and(tiny, name, "vectorized")
    if vectorized is not None:
        _assert_runs_agree(sequential, vectorized)


# Methods whose parts multiply a whole cohort's rows in one matrix product (FedSCAM's projection of the clients'
# summaries and their cosines, `[C, P] @ [P, d]` once rather than C products of one row, which on the W1/W2 models
# would read the projection C times): the BLAS may sum a product of C rows in another order than C products of one
# row (MKL's sgemm on an Intel Xeon does, on this AMD EPYC it happens not to), so these agree to rounding.
COHORT_PRODUCTS = ("fedscam", "fedscam-sam", "fedscam-wa")
# Methods whose objective has a term computed before the pass (a teacher's log-probabilities, MOON's anchors): the
# per-client backends compute it from each client's own samples, one client's shapes whatever the cohort
TERM_METHODS = ("fedgmt", "fedntd", "fedsol", "moon")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_streams_engine_equals_the_sequential_engine_bit_for_bit(tiny, name):
    """engine=streams trains a cohort's clients at once with each client's own pass (the sequential engine's
    kernels, on lanes that run side by side on a GPU and one after another here): every method's run is the
    sequential run exactly, padded cohorts included (clients of 2 to 18 steps, short last batches)."""
    from agreement import on_cuda

    sequential, streams = _sequential_and(tiny, name, "streams")
    if streams is None:
        return
    if name in COHORT_PRODUCTS or on_cuda():  # (a GPU's reductions of C rows are blocked by C)
        _assert_runs_agree(sequential, streams, _cohort_product_bound(tiny, name))
    else:
        assert torch.equal(streams.final_parameters, sequential.final_parameters)
        assert _metrics(streams) == _metrics(sequential)


def _cohort_product_bound(tiny, name: str) -> float:
    """How far the streams run may lie from the sequential one where a part's cohort product sums in another order:
    a client's summary is a sum over all P parameters (FedSCAM's projection), P u relative in another order, and
    each local step's radius and the round's weights carry one such error into the weights (agreement.float32_bound
    with P as the widest sum)."""
    from agreement import float32_bound

    sim = Simulation(tiny(f"algo={name}", *UNEQUAL, *model_for(name)))
    return float32_bound(sim, rounds=2, widest=sim.num_parameters)


@pytest.mark.parametrize("name", [*TERM_METHODS, "fedbn"])  # (every recipe: `pytest --shape-rounding`)
def test_streams_engine_equals_the_sequential_engine_on_a_cpu_that_rounds_by_shape(tiny, name):
    """The bit-for-bit equality above holds by the arithmetic, not by this CPU's rounding: under
    :class:`rounding.ShapeRounding` (every product, reduction and transcendental function rounded by its call's
    shapes, as MKL rounds a product by its row count on an Intel Xeon) the streams engine still equals the sequential
    one, since each client's passes, its term's teacher pass included, run with one client's shapes."""
    from rounding import ShapeRounding

    with ShapeRounding() as cpu:
        sequential, streams = _sequential_and(tiny, name, "streams")
    assert cpu.calls.get("mm") and cpu.calls.get("addmm")  # (the products were moved)
    assert torch.equal(streams.final_parameters, sequential.final_parameters)
    assert _metrics(streams) == _metrics(sequential)


def test_streams_engine_runs_each_client_of_a_cohort_on_its_own_lane(tiny):
    """The round's three clients are one cohort with a lane (and a pass) each, not three cohorts of one."""
    sim = Simulation(tiny("engine=streams", "device=cpu"))
    assert sim.runtime.chunk_size(3) == 3
    sim.run_round(0)
    assert len(sim.runtime.oracle.backend.lanes.passes) == 3


@pytest.mark.parametrize("chunk", [1, 2])
def test_chunked_and_unchunked_vectorized_runs_agree(tiny, chunk):
    whole = fedflat.run(tiny("algo=fedsam", "algo.rho=0.1", *UNEQUAL, "engine=vectorized"), save=False,
                        progress=False)
    chunked = fedflat.run(tiny("algo=fedsam", "algo.rho=0.1", *UNEQUAL, "engine=vectorized", f"chunk_size={chunk}"),
                          save=False, progress=False)
    _assert_runs_agree(whole, chunked)


def test_padding_gives_each_client_exactly_its_own_steps(tiny, monkeypatch):
    """In a vectorized chunk, row i's parameters change in exactly E_i of the max(E) padded steps,
    and it is marked active in exactly those steps."""
    sim = Simulation(tiny(*UNEQUAL, "engine=vectorized"))
    correction = sim.algorithm.parts["correction"]
    states: list[torch.Tensor] = []
    actives: list[torch.Tensor] = []
    cls = PARTS[correction.role][correction.name]  # the part's class (the contract's mode wraps the part)
    plain_direction, plain_end = cls.direction, cls.end

    def direction(self, ctx, cohort, k, W, grad):
        states.append(W.clone())
        actives.append(cohort.active.clone())
        return plain_direction(self, ctx, cohort, k, W, grad)

    def end(self, ctx, cohort, W):
        states.append(W.clone())
        plain_end(self, ctx, cohort, W)

    monkeypatch.setattr(cls, "direction", direction)  # on the class: a part keeps nothing on itself
    monkeypatch.setattr(cls, "end", end)
    round_steps = sim.server.new_context(0).steps.cpu()
    assert round_steps.min() < round_steps.max()  # the round really mixes step counts
    sim.run_round(0)
    # the cohort takes the clients longest-first (less padding when chunked), whatever their ids
    steps = round_steps.sort(descending=True).values
    trajectory = torch.stack(states)  # [max(E) + 1, K, P]
    assert trajectory.shape[0] == int(steps.max()) + 1
    changed = (trajectory[1:] != trajectory[:-1]).any(dim=2).sum(0)
    assert torch.equal(changed.cpu(), steps)
    assert torch.equal(torch.stack(actives).sum(0).cpu(), steps)
    # and the active steps come first: a finished client never moves again
    assert torch.equal(trajectory[steps, torch.arange(len(steps))], trajectory[-1])


def test_vectorized_train_loss_averages_own_steps_only(tiny):
    seq = Simulation(tiny(*UNEQUAL, "engine=sequential"))
    vec = Simulation(tiny(*UNEQUAL, "engine=vectorized"))
    a, b = seq.run_round(0), vec.run_round(0)
    assert b.train_loss == pytest.approx(a.train_loss, rel=RTOL)
    assert b.backprops_per_step == a.backprops_per_step == 1.0  # padded steps are not counted as work


def test_engines_agree_with_augmentation_and_padding():
    """CIFAR-style augmentation draws from each client's stream for its real samples only, so a
    padded vectorized batch does not shift the random numbers of later steps."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(130, 3, 6, 6, generator=g), torch.randint(0, 3, (130,), generator=g)
    data = Dataset("aug", x[:100], y[:100], x[100:], y[100:], 3, augmentation="cifar")
    cfg = {"rounds": 2, "data": {"num_clients": 4, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}},
           "model": {"name": "mlp", "hidden": [8]}, "sampling": {"clients_per_round": 3},
           "train": {"local_epochs": 1, "batch_size": 7}}
    runs = [fedflat.run(cfg, overrides=[f"engine={e}"], dataset=data, save=False, progress=False)
            for e in ("sequential", "vectorized")]
    _assert_runs_agree(*runs)


def _toy_oracle(vectorized: bool) -> tuple[Oracle, torch.Tensor]:
    torch.manual_seed(0)
    model = FlatModel(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)))
    W = model.initial + 0.1 * torch.randn(2, model.layout.size)
    return Oracle(model, ComputeOptions(engine="vectorized" if vectorized else "sequential")), W


@pytest.mark.parametrize("vectorized", [False, True])
def test_padded_batch_uses_only_real_samples(vectorized):
    """A cohort batch whose second row has 2 real samples of 4 gives that client the loss and gradient
    of its 2 samples alone."""
    oracle, W = _toy_oracle(vectorized)
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
    batch = stack_batches(x, y, [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])], 4)
    assert batch.weight is not None and batch.weight.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    loss, grad = oracle.loss_grad(W, batch)
    for c, rows in enumerate(([0, 1, 2, 3], [4, 5])):
        leaf = W[c].clone().requires_grad_(True)
        expected = torch.nn.functional.cross_entropy(oracle.model(leaf, x[rows]), y[rows])
        (g,) = torch.autograd.grad(expected, leaf)
        torch.testing.assert_close(loss[c], expected.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad[c], g, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(oracle.loss(W, batch), loss, rtol=1e-6, atol=1e-7)
    assert oracle.backprops == 2


def test_sequential_oracle_is_exactly_autograd_through_the_flat_vector():
    """Per-tensor gradients concatenated equal the gradient with respect to the flat vector, bit for bit."""
    oracle, W = _toy_oracle(False)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    _, grad = oracle.loss_grad(W[:1], Batch(x[None], y[None]))
    leaf = W[0].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(oracle.model(leaf, x), y), leaf)
    assert torch.equal(grad[0], g)


def test_auto_chunk_size_follows_the_memory_budget(tiny, monkeypatch):
    assert auto_chunk_size(100, 1000, 50) == 10
    assert auto_chunk_size(100, 50, 50) == 1  # never zero
    assert auto_chunk_size(1, 10**9, 7) == 7  # never more than the cohort
    sim = Simulation(tiny("engine=vectorized", "sampling.clients_per_round=6"))
    per_client = sim.runtime.client_bytes()
    assert per_client > 8 * sim.num_parameters * 4  # at least the loop's model-sized vectors
    monkeypatch.setattr(runtime_module, "memory_budget", lambda device: 2 * per_client)
    assert sim.runtime.chunk_size(6) == 2
    assert Simulation(tiny("engine=sequential")).runtime.chunk_size(6) == 1
    assert Simulation(tiny("engine=vectorized", "chunk_size=4")).runtime.chunk_size(6) == 4


def test_a_part_without_vectorized_support_is_refused_by_name(tiny, monkeypatch):
    part = type(build_algorithm({"name": "fedsam"}).parts["perturbation"])
    monkeypatch.setattr(part, "supports_vectorized", False, raising=False)
    with pytest.raises(ConfigError, match="perturbation 'sam' of 'fedsam' does not support training a cohort at once"):
        Simulation(tiny("algo=fedsam", "engine=vectorized"))
    Simulation(tiny("algo=fedsam", "engine=sequential"))  # the sequential engine runs it


def test_auto_engine_is_sequential_on_cpu(tiny):
    assert Simulation(tiny("engine=auto", "device=cpu")).report.engine == "sequential"
    assert np.isfinite(Simulation(tiny("engine=auto", "device=cpu")).run_round(0).train_loss)


def test_auto_engine_on_a_gpu_follows_the_step_size():
    """On a GPU, small steps (W2's CNN, 0.8 GFLOP) run vectorized and steps that fill the device by themselves
    (W3's ResNet-18 at batch 50, 166 GFLOP) one client at a time, as measured on an H100; explicit choices stay."""
    cuda = torch.device("cuda")
    assert resolve_engine("auto", cuda, 0.8e9) == "vectorized"
    assert resolve_engine("auto", cuda, 166e9) == "sequential"
    assert resolve_engine("auto", torch.device("cpu"), 0.8e9) == "sequential"
    assert resolve_engine("vectorized", cuda, 166e9) == "vectorized"
    # with CUDA graphs the launches are gone and the streams engine overlaps the clients' kernels (W3 on an H100)
    assert resolve_engine("auto", cuda, 166e9, cuda_graphs=True) == "streams"
    assert resolve_engine("auto", cuda, 0.8e9, cuda_graphs=True) == "vectorized"
    assert "engine=auto on CPU" in engine_choice("auto", torch.device("cpu"))[1]


def test_a_run_records_its_engine_and_why(tiny):
    history = fedflat.run(tiny("engine=auto", "device=cpu", "rounds=1"), save=False, progress=False)
    assert history.summary["engine"] == "sequential"
    assert history.summary["engine_reason"].startswith("engine=auto on CPU: the sequential engine")


def test_an_out_of_memory_chunk_is_halved_and_retried_with_the_same_numbers(tiny, monkeypatch):
    """A CUDA out-of-memory error inside a vectorized chunk halves the chunk and trains it again; the
    clients' results do not depend on the chunking, so the run's numbers are those of a run that never
    ran out of memory. (The error is raised for chunks above two clients, as a GPU short of memory would.)"""
    from fedflat.engine import client as client_module

    cfg = tiny("algo=scaffold", *UNEQUAL, "engine=vectorized", "sampling.clients_per_round=5")
    reference = Simulation(cfg)
    expected = [reference.run_round(t).train_loss for t in range(2)]
    original_fit, sizes = runtime_module.fit, []

    def fit_with_little_memory(algorithm, ctx, cohort):
        sizes.append(cohort.size)
        if cohort.size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated: more than 2 clients per chunk)")
        return original_fit(algorithm, ctx, cohort)

    monkeypatch.setattr(runtime_module, "fit", fit_with_little_memory)
    sim = Simulation(cfg)
    got = [sim.run_round(t).train_loss for t in range(2)]
    assert got == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(sim.server.w, reference.server.w, rtol=1e-5, atol=1e-6)
    assert sizes[:3] == [5, 2, 2] and sim.runtime.oom_retries == 1  # 5 -> halved to 2, and stays there
    assert client_module.fit is original_fit


def _conv_oracle(vectorized: bool, **options) -> tuple[Oracle, torch.Tensor, Batch]:
    """Two clients of a small convolutional network on 3x6x6 images."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 4 * 4, 3))
    model = FlatModel(module)
    W = model.initial + 0.1 * torch.randn(2, model.layout.size)
    return Oracle(model, ComputeOptions(engine="vectorized" if vectorized else "sequential", **options)), W, Batch(torch.randn(2, 5, 3, 6, 6),
                                                                      torch.randint(0, 3, (2, 5)))


@pytest.mark.parametrize("vectorized", [False, True])
def test_bf16_precision_runs_the_passes_under_autocast(vectorized):
    """``precision: bf16`` gives each client the loss and gradient of its forward pass under
    ``torch.autocast(bfloat16)`` (float32 logits into the loss), as float32 tensors; they differ from the
    float32 ones by bfloat16's rounding, no more. (vmap's grouped convolution rounds its bfloat16 sums in
    another order: the vectorized engine agrees to that rounding.)"""
    oracle, W, batch = _conv_oracle(vectorized, precision="bf16")
    reference, _, _ = _conv_oracle(vectorized)
    loss, grad = oracle.loss_grad(W, batch)
    loss32, grad32 = reference.loss_grad(W, batch)
    assert grad.dtype == loss.dtype == torch.float32
    bf16_gap = 0.0
    for c in range(2):
        leaf = W[c].clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = oracle.model(leaf, batch.x[c])
        expected = torch.nn.functional.cross_entropy(logits.float(), batch.y[c])
        (g,) = torch.autograd.grad(expected, leaf)
        # the vectorized pass's bfloat16 logits may each differ by a rounding or two (u = 2^-8) from the loop's, and
        # cross-entropy moves by at most 2 max|dz| (its gradient in a sample's logits sums to 2 in absolute value)
        bf16_gap = max(bf16_gap, 2 * 2 * 2.0 ** -8 * float(logits.float().abs().max()))
        torch.testing.assert_close(loss[c], expected.detach(), rtol=0 if vectorized else 1e-5,
                                   atol=bf16_gap if vectorized else 1e-6)
        assert (grad[c] - g).norm() / g.norm() < (5e-2 if vectorized else 1e-5)
    gap = (grad - grad32).norm() / grad32.norm()
    assert 1e-4 < gap < 5e-2, gap  # bfloat16's 8-bit mantissa: visibly not float32, and close to it
    # (the evaluation's pass and the training pass: bfloat16 products of their own, on the vectorized engine vmapped)
    torch.testing.assert_close(oracle.loss(W, batch), loss, rtol=0 if vectorized else 1e-5,
                               atol=bf16_gap if vectorized else 1e-6)


def test_channels_last_feeds_the_convolutions_nhwc_with_the_same_numbers():
    """``channels_last`` hands the sequential engine's convolutions channels-last batches (seen by a hook on
    the convolution), and the loss and gradient are float32's up to rounding."""
    oracle, W, batch = _conv_oracle(False, channels_last=True)
    reference, _, _ = _conv_oracle(False)
    seen: list[bool] = []
    conv = oracle.model.module[0]
    hook = conv.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    loss, grad = oracle.loss_grad(W, batch)
    hook.remove()
    assert seen == [True, True]
    loss32, grad32 = reference.loss_grad(W, batch)
    torch.testing.assert_close(loss, loss32, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad32, rtol=1e-5, atol=1e-6)


def test_a_bf16_run_trains_alike_on_both_engines_and_near_float32(tiny):
    """A whole run with ``precision=bf16``: the engines agree to bfloat16's rounding, and the run stays near
    the float32 one (the precision is a speed option, not another method)."""
    runs = {(engine, precision): fedflat.run(tiny(*UNEQUAL, "algo=fedsam", f"engine={engine}",
                                                  f"precision={precision}", "channels_last=true"),
                                             save=False, progress=False)
            for engine in ("sequential", "vectorized") for precision in ("bf16", "float32")}
    bf16 = runs["sequential", "bf16"].final_parameters
    torch.testing.assert_close(runs["vectorized", "bf16"].final_parameters, bf16, rtol=2e-2, atol=2e-3)
    float32 = runs["sequential", "float32"].final_parameters
    assert not torch.equal(bf16, float32)
    start = Simulation(tiny(*UNEQUAL)).server.w.cpu()  # beside final_parameters, on the CPU
    assert (bf16 - float32).norm() / (float32 - start).norm() < 0.05  # of the distance trained


def test_ray_workers_build_their_oracle_in_the_runs_precision_and_layout(tiny):
    """A Ray worker's runtime (built from the run's WorkerSpec) trains in the run's precision and layout."""
    from fedflat.engine.ray_executor import build_runtime

    sim = Simulation(tiny("precision=bf16", "channels_last=true"))
    oracle = build_runtime(sim.worker_spec(), sim.worker_data()).oracle
    assert oracle.forward.autocast is torch.bfloat16 and oracle.forward.channels_last
    assert sim.oracle.forward.autocast is torch.bfloat16 and sim.oracle.forward.channels_last
