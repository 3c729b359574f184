"""Where clients run: the client runtime, the local executor and the thread executor.

A :class:`ClientRuntime` is everything one worker needs to run clients' local work under the client
contract (:func:`fedflat.engine.client.fit`): the algorithm's parts, the model's gradient oracle on the
worker's device, each client's batches, the shared settings, and the engine's chunking (one client at a
time for the sequential engine; cohorts under ``vmap`` for the vectorized one). The driver's
:class:`LocalExecutor` holds one; :class:`ThreadExecutor` one per thread; every Ray worker its own
(:mod:`fedflat.engine.ray_executor`).

Results never depend on the chunking: every random draw is keyed by (seed, round, client, purpose), each
client's rows are computed independently, and the server reduces them in ascending client-id order.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from fedflat.algorithms import Algorithm, build_algorithm
from fedflat.config import AdapterConfig
from fedflat.core import (Broadcast, ClientContext, ClientResult, Cohort, ConfigError, ResultRows, TrainSettings)
from fedflat.data import Standardize
from fedflat.engine.client import ClientBatches, Oracle, fit
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.modes import ModelTraits, module_name
from fedflat.engine.optim import state_vectors
from fedflat.models import assemble, build_model, frozen_hash, without_weights
from fedflat.params import FlatModel

# Model-sized vectors the inner loop holds per client besides the parts' state: W, W + eps, eps, the
# per-tensor gradients and their flat copy, the direction and the step's temporaries.
LOOP_VECTORS = 8
ENGINES = ("sequential", "vectorized", "streams")
DEFAULT_CPU_BUDGET = 2 << 30  # bytes for one vectorized chunk on CPU

StateLoader = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


# One local step of at least this many FLOPs keeps a GPU busy by itself (measured on an H100: W3, 166 GFLOP
# per step, ran 1.55x faster one client at a time; W2, 0.8 GFLOP, 10x faster vectorized): docs/benchmarks.md.
GPU_BUSY_STEP_FLOPS = 1e10


def engine_choice(name: str, device: torch.device, step_flops: float = 0.0,
                  cuda_graphs: bool = False, compiled: bool = False) -> tuple[str, str]:
    """``(engine, why)``: the engine ``name`` asks for, or ``auto``'s choice as measured (docs/benchmarks.md). On
    CPU the sequential engine (the vectorized one was slower on every standard workload: vmap over convolutions
    becomes grouped convolutions, and clients with fewer steps are padded); on a GPU the vectorized engine for small
    steps, which leave the GPU waiting for kernel launches, and for steps that fill it by themselves
    (``step_flops``, forward and backward of a batch) the streams engine when the passes are CUDA graphs (its
    lanes overlap the clients' small kernels once the launches are gone), else the sequential one; with ``compiled``
    (``compile: true``, one client's pass compiled) never the vectorized one."""
    if name != "auto":
        return name, f"engine={name} as configured"
    if device.type != "cuda":
        return "sequential", "engine=auto on CPU: the sequential engine (the fastest on every measured workload)"
    if step_flops < GPU_BUSY_STEP_FLOPS and not compiled:
        return "vectorized", (f"engine=auto on a GPU: a local step of {step_flops:.2g} FLOPs leaves the GPU waiting "
                              "on kernel launches, so a cohort's steps run at once under vmap (W2: 10x)")
    if cuda_graphs:
        return "streams", (f"engine=auto on a GPU with cuda_graphs: steps of {step_flops:.2g} FLOPs, each client's "
                           "graph on a stream of its own so the GPU overlaps their kernels (W3 on an H100: 1.35x"
                           + (", 2.5x compiled)" if compiled else "; compile=true makes it 2.5x)"))
    if compiled:
        return "sequential", ("engine=auto on a GPU with compile=true: one client's compiled pass at a time (the "
                              "vectorized engine's vmap is not compiled; with cuda_graphs=true, the streams engine)")
    return "sequential", (f"engine=auto on a GPU: a local step of {step_flops:.2g} FLOPs fills the GPU's launch queue "
                          "one client at a time (with cuda_graphs=true auto takes the faster streams engine)")


def resolve_engine(name: str, device: torch.device, step_flops: float = 0.0, cuda_graphs: bool = False,
                   compiled: bool = False) -> str:
    """The engine of :func:`engine_choice`."""
    return engine_choice(name, device, step_flops, cuda_graphs, compiled)[0]


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 tensor-core products on CUDA for matmuls and cuDNN convolutions, or none (process-wide).

    PyTorch's own defaults differ (convolutions TF32, matmuls not); fedflat sets both from ``tf32`` so a
    GPU run is float32 throughout unless asked, and its numbers stay comparable with a CPU run's."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def check_vectorizable(algorithm: Algorithm, engine: str = "vectorized") -> None:
    """Refuses, naming the part, a method with a part that declares ``supports_vectorized = False``
    (a part whose per-client work cannot run on ``[C, P]`` tensors of a whole cohort, as the vectorized and the
    streams engines run it)."""
    for role, part in algorithm.parts.items():
        if not part.supports_vectorized:
            raise ConfigError(f"engine={engine}: {role} '{part.name}' of '{algorithm.name}' does not support "
                             f"training a cohort at once yet; use engine=sequential")


def activation_bytes(model: FlatModel, w: torch.Tensor, x: torch.Tensor) -> int:
    """Bytes of every module output of one forward pass on ``x`` (what a backward pass keeps alive)."""
    total = 0

    def count(_module, _inputs, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    handles = [m.register_forward_hook(count) for m in model.module.modules()]
    try:
        with torch.no_grad():
            model(w, x, model.initial_buffers)
    finally:
        for h in handles:
            h.remove()
    return total


def memory_budget(device: torch.device) -> int:
    """Bytes a vectorized chunk may use: half the GPU memory that is free, counting what PyTorch's caching
    allocator holds unused (the driver reports it as taken: an earlier run in this process would otherwise
    shrink every later chunk), or 2 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return (free + cached) // 2
    return DEFAULT_CPU_BUDGET


def auto_chunk_size(per_client_bytes: int, budget: int, K: int) -> int:
    """The most clients whose working sets fit ``budget`` (at least one, at most ``K``)."""
    return max(1, min(K, budget // max(per_client_bytes, 1)))


@dataclass
class RoundTask:
    """The clients a runtime trains this round: ids (ascending), sample counts and local step counts ``E_i``."""

    ids: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def rows(self, index: torch.Tensor) -> "RoundTask":
        return RoundTask(self.ids[index], self.num_samples[index], self.steps[index])


def rows_loader(ids: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor]) -> StateLoader:
    """A :data:`StateLoader` over state rows sent with a task (``[C, ...]`` in the order of ``ids``): what a
    remote worker or node gives :meth:`ClientRuntime.fit` in place of the driver's store."""
    row_of = {int(c): r for r, c in enumerate(ids.tolist())}

    def load_state(sub: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        rows = torch.tensor([row_of[int(c)] for c in sub.tolist()], dtype=torch.long)
        return {k: v[rows] for k, v in state.items()}, {k: v[rows] for k, v in known.items()}

    return load_state


def make_cohort(task: RoundTask, broadcast: Broadcast, load_state: StateLoader, device: torch.device) -> Cohort:
    """The clients of ``task`` on ``device`` with their own state rows and their rows of the broadcast."""
    state, known = load_state(task.ids)
    return Cohort(ids=task.ids.to(device), num_samples=task.num_samples.to(device), steps=task.steps.to(device),
                  active=torch.ones(len(task), dtype=torch.bool, device=device),
                  state={k: v.to(device) for k, v in state.items()},
                  known={k: v.to(device) for k, v in known.items()},
                  personal={k: v.to(device) for k, v in broadcast.for_clients(task.ids).personal.items()})


class ClientRuntime:
    """Runs clients' local work in this process, on ``model``'s device, with the chosen engine.

    ``options``: the run's compute options with the engine resolved (``options.chunk_size``: clients per
    vectorized chunk, None: as many as fit the memory budget). A CUDA
    out-of-memory error inside a chunk halves the chunk and retries it, and later chunks stay at most
    that size: the clients' results do not depend on the chunking, so the numbers are unchanged.
    """

    def __init__(self, algorithm: Algorithm, model: FlatModel, batches: ClientBatches, settings: TrainSettings,
                 options: ComputeOptions, traits: ModelTraits | None = None):
        engine = options.engine
        if engine not in ENGINES:
            raise ConfigError(f"engine must be sequential, vectorized or streams here, got {engine!r}")
        if engine != "sequential":
            check_vectorizable(algorithm, engine)
        self.algorithm, self.model, self.batches, self.settings = algorithm, model, batches, settings
        self.options, self.engine, self.device = options, engine, model.initial.device
        batches.independent = settings.dp_sgd is not None  # DP-SGD samples each step's batch on its own
        self.oracle = Oracle(model, options, traits, settings.loss, settings.dp_sgd)
        if engine != "sequential" and self.oracle.traits.random is not None:
            raise ConfigError(f"engine={engine}: model {module_name(model.module)} draws random numbers "
                              f"({self.oracle.traits.random}) outside dropout; use engine=sequential")
        self._client_bytes: int | None = None
        self.oom_retries = 0
        self.oom_cap: int | None = None  # the largest chunk known to fit, after an out-of-memory error

    def client_bytes(self) -> int:
        """Estimated bytes one client of a vectorized chunk needs: the loop's model-sized vectors, the
        parts' per-client state, and three times a batch's activations (kept, their gradients, scratch)."""
        if self._client_bytes is None:
            w = self.model.initial
            vectors = LOOP_VECTORS + 2 * self.algorithm.client_state_vectors + state_vectors(self.settings.optimizer)
            x = self.batches.x[: self.settings.batch_size]
            x = x if self.batches.features is None else self.batches.features(x)  # (uint8 pixels: standardized)
            self._client_bytes = vectors * w.numel() * w.element_size() + 3 * activation_bytes(self.model, w, x)
        return self._client_bytes

    def chunk_size(self, K: int) -> int:
        """Clients trained together: 1 for the sequential engine; ``chunk_size`` if set, else as many
        as fit the memory budget (:func:`memory_budget`)."""
        if self.engine == "sequential":
            return 1
        fixed = self.options.chunk_size
        size = min(K, fixed) if fixed else auto_chunk_size(
            self.client_bytes(), memory_budget(self.device), K)
        return size if self.oom_cap is None else min(size, self.oom_cap)

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult:
        """Every client of ``task`` trained from ``broadcast`` with its own state (``load_state(ids)``).

        The vectorized engine takes clients longest-first, so chunks hold clients of similar step
        counts and pad little (FedJAX's ``for_each_client`` does the same)."""
        rows = ResultRows(task.ids)
        self.fit_into(rows, broadcast, task, load_state)
        return rows.result()

    def fit_into(self, rows: ResultRows, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> None:
        """:meth:`fit`, each chunk's rows copied into ``rows`` as soon as the chunk is trained (the round's result,
        which other threads' runtimes may fill too)."""
        broadcast = broadcast.to(self.device)
        ctx = ClientContext.of(broadcast, self.settings, self.oracle, self.batches)
        order = torch.arange(len(task))
        if self.engine != "sequential":
            order = torch.as_tensor(sorted(range(len(task)), key=lambda i: (-int(task.steps[i]), i)))
        size, lo = self.chunk_size(len(task)), 0
        while lo < len(task):
            chunk = order[lo:lo + size]
            try:
                result = fit(self.algorithm, ctx, make_cohort(task.rows(chunk), broadcast, load_state, self.device))
            except torch.cuda.OutOfMemoryError:
                if size == 1:
                    raise
                size, self.oom_retries = max(1, size // 2), self.oom_retries + 1
                self.oom_cap = size
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            rows.add(result)
            lo += len(chunk)


class LocalExecutor:
    """Trains a round's clients in this process (the default ``executor: local``)."""

    name = "local"

    def __init__(self, runtime: ClientRuntime):
        self.runtime = runtime

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult:
        return self.runtime.fit(broadcast, task, load_state)

    def close(self) -> None:
        """Nothing to release: the runtime lives in the driver."""


@dataclass
class WorkerSpec:
    """What a process or thread needs to build a run's :class:`ClientRuntime` (:func:`build_client_runtime`): a Ray
    worker receives it with the data (once, through the object store); a thread worker shares the driver's data."""

    algo: dict[str, Any]
    model: dict[str, Any]
    model_fn: Callable[[], torch.nn.Module] | None
    input_shape: tuple[int, ...]
    num_classes: int
    settings: TrainSettings
    compute: ComputeOptions  # the run's, ``threads`` the worker's count (None: torch's own) and ``engine`` maybe auto
    augmentation: str | None
    use_gpu: bool
    step_flops: float = 0.0  # of one local step: engine=auto's choice on a GPU worker
    standardize: Standardize | None = None  # uint8 pixels' per-batch standardization (Dataset.standardize)
    traits: ModelTraits | None = None  # what the driver's up-front check found (dropout, buffers, batch statistics)
    plugins: tuple[str, ...] = ()  # the config's plugins: a worker imports them before it builds the method
    stages: tuple[dict[str, Any], ...] = ()  # the upload path's stages (Config.stage_specs, z calibrated)
    seed: int = 0  # the run's: a worker draws its module's initialization from the same keyed stream as the driver
    adapter: dict[str, Any] | None = None  # the config's adapter section (LoRA): the base is loaded, frozen, here
    base_hash: str | None = None  # the driver's frozen parameters' digest (fedflat.models.frozen_hash): checked


def build_client_runtime(spec: WorkerSpec, batches: ClientBatches, device: torch.device,
                         base: FlatModel | None = None) -> ClientRuntime:
    """A runtime of the run ``spec`` describes on ``device``: its own model (built again from the config or
    ``model_fn``; the broadcast carries the trained weights, and under adapters the worker loads the frozen base
    from its own files, checked against the driver's digest), parts and oracle, over the given ``batches``.
    ``base``: the model of the same run in this process, whose frozen tensors the new one shares (thread workers:
    :func:`thread_module`)."""
    compute = spec.compute
    if compute.threads:
        torch.set_num_threads(compute.threads)
    set_tf32(device, compute.tf32)
    adapter = AdapterConfig(**spec.adapter) if spec.adapter is not None else None
    module = thread_module(spec, base, adapter) if base is not None else assemble(
        lambda: worker_module(spec, read_weights=adapter is not None), spec.seed, adapter)
    check_base(frozen_hash(module), spec.base_hash)
    model = FlatModel(module.to(device))
    settings = replace(spec.settings, layout=model.layout)
    engine = resolve_engine(compute.engine, device, spec.step_flops, compute.cuda_graphs, compute.compile)
    return ClientRuntime(build_algorithm(spec.algo, spec.stages), model, batches, settings,
                         replace(compute, engine=engine), spec.traits)


def thread_module(spec: WorkerSpec, base: FlatModel, adapter: AdapterConfig | None) -> torch.nn.Module:
    """A thread worker's module, which costs no second copy of a frozen base: the run's module built on the meta
    device (its structure, nothing allocated, no weights file read), then given the driver's tensors
    (:func:`adopt_tensors`). A module the meta device cannot build (a ``model_fn`` that computes with its tensors,
    say) is built whole, without its weights' files, and given them the same way."""
    def build() -> torch.nn.Module:
        return assemble(lambda: worker_module(spec, read_weights=False), spec.seed, adapter)

    try:
        with torch.device("meta"):
            module = build()
    except Exception:  # noqa: BLE001 - whatever the meta device refuses: the whole build
        module = build()
    adopt_tensors(module, base)
    return module


def adopt_tensors(module: torch.nn.Module, base: FlatModel) -> None:
    """Gives ``module`` (the same run's architecture, built on the meta device or whole) the tensors of ``base``:
    its frozen parameters and non-persistent buffers shared (one pretrained base in the process, which every
    thread only reads), its trained parameters and persistent buffers copied from their initial values; tied
    tensors stay tied. A tensor ``base`` lacks is a ``KeyError``."""
    frozen = dict(base.module.named_parameters(remove_duplicate=False))
    trained = dict(zip(base.layout.names, base.layout.views(base.initial.detach())))
    persistent = dict(zip(base.buffer_layout.names, base.buffer_layout.tensors(base.initial_buffers))) \
        if base.buffer_layout.size else {}
    shared = dict(base.module.named_buffers(remove_duplicate=False))
    given: dict[int, torch.Tensor] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in given:
            given[id(p)] = torch.nn.Parameter(trained[name].clone()) if p.requires_grad else frozen[name]
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._parameters[attr] = given[id(p)]
    for name, b in list(module.named_buffers(remove_duplicate=False)):
        if id(b) not in given:
            given[id(b)] = persistent[name].clone() if name in persistent else shared[name]
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._buffers[attr] = given[id(b)]
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise KeyError(f"no tensor for {left[:3]}")


def worker_module(spec: WorkerSpec, read_weights: bool) -> torch.nn.Module:
    """The module of a worker before its adapters: ``model_fn()``, or the config's model, its pretrained weights
    read only where ``read_weights`` (under adapters, a frozen base no broadcast carries, on a Ray worker; a thread
    worker shares the driver's, and without adapters the broadcast brings them: the files need not exist there)."""
    section = spec.model if read_weights else without_weights(spec.model)
    options = {k: v for k, v in section.items() if k != "name"}
    return spec.model_fn() if spec.model_fn is not None else build_model(
        section["name"], spec.input_shape, spec.num_classes, **options)


def check_base(own: str | None, expected: str | None) -> None:
    """Refuses a worker or node whose frozen base (digest ``own``, :func:`fedflat.models.frozen_hash`) differs
    from the server's (another checkpoint or folder at its path), naming both digests; nothing to check where the
    server has no frozen part."""
    if expected is not None and own != expected:
        raise ConfigError(f"the frozen base model here (digest {own}) differs from the server's (digest {expected}): "
                          "every worker and node must hold the same pretrained files at the path its config names")


def longest_first(steps: torch.Tensor, workers: list[int]) -> dict[int, torch.Tensor]:
    """Longest-processing-time assignment: clients in decreasing ``E_i`` each go to the worker with the least
    work so far (ties: the lower worker index); each worker's clients in ascending position."""
    load = {w: 0 for w in workers}
    assigned: dict[int, list[int]] = {w: [] for w in workers}
    for row in sorted(range(len(steps)), key=lambda r: (-int(steps[r]), r)):
        w = min(workers, key=lambda v: (load[v], v))
        load[w] += int(steps[row])
        assigned[w].append(row)
    return {w: torch.tensor(sorted(rows), dtype=torch.long) for w, rows in assigned.items() if rows}


class ThreadExecutor:
    """``executor: threads``: a round's clients on ``len(runtimes)`` threads of this process, one runtime each (its
    own model, parts and oracle over the driver's data), assigned longest-first as the Ray workers are.

    PyTorch releases the GIL inside its operators, so on a CPU two threads of one intra-op thread each keep two
    cores busy on small steps with no data copied and no process started (docs/benchmarks.md). Each client's work
    is a pure function of what it is given and the results are reduced in ascending client-id order, so the
    numbers are those of ``executor: local`` bit for bit (on CUDA: on the sequential engine; the vectorized engine's
    batched cuBLAS products round a row by the chunk's size, so there they agree to float32 rounding). The threads
    are daemons, started per round: an interrupted run exits without waiting for its abandoned clients, and a round
    after an interrupted one (in a notebook) first lets them finish, so no runtime ever trains two clients at once."""

    name = "threads"

    def __init__(self, runtimes: list[ClientRuntime]):
        self.runtimes = runtimes
        self.threads: list[threading.Thread] = []  # the last round's

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult:
        for thread in self.threads:  # a round abandoned by an interrupt: its clients finish before a runtime is reused
            thread.join()
        plan = longest_first(task.steps, list(range(len(self.runtimes))))
        outcomes: dict[int, BaseException | None] = {}
        results = ResultRows(task.ids)  # (every thread copies its clients' rows in: the round holds them once)

        def work(worker: int, sub: RoundTask, loader: StateLoader) -> None:
            try:
                self.runtimes[worker].fit_into(results, broadcast, sub, loader)
                outcomes[worker] = None
            except BaseException as err:  # noqa: BLE001 - raised again in the driver's thread below
                outcomes[worker] = err

        self.threads = threads = []
        for worker, rows in plan.items():
            sub = task.rows(rows)
            state, known = load_state(sub.ids)  # the store is read here, in the driver's thread only
            threads.append(threading.Thread(target=work, args=(worker, sub, rows_loader(sub.ids, state, known)),
                                            name=f"fedflat-client-{worker}", daemon=True))
            threads[-1].start()
        for thread in threads:
            thread.join()
        for worker in sorted(outcomes):
            if isinstance(outcomes[worker], BaseException):
                raise outcomes[worker]
        return results.result()

    def close(self) -> None:
        """Nothing to release: the threads end with each round."""
