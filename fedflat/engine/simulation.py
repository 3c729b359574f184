"""The round loop: sampling, broadcast, local training in chunks, aggregation, server update, evaluation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedflat.algorithms import Algorithm, Cohort, RoundContext, TrainSettings, build_algorithm
from fedflat.config import Config, ConfigError
from fedflat.data import Dataset, cifar_augment, load_dataset, partition
from fedflat.engine.batches import local_steps
from fedflat.engine.local import ClientBatches, train_chunk
from fedflat.engine.oracle import Oracle
from fedflat.engine.store import ClientStore
from fedflat.models import build_model
from fedflat.params import FlatModel
from fedflat.rng import SERVER, numpy_stream, stream_seed


class Diverged(RuntimeError):
    """A non-finite loss or model: the run stops with ``status: diverged``."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{name}' requested but CUDA is not available; use device=cpu")
    return device


def resolve_engine(name: str, device: torch.device) -> str:
    """``auto``: vectorized on GPUs (launch-bound small batches), sequential on CPU, where the
    vectorized engine measured slower on every standard workload (vmap over convolutions becomes
    grouped convolutions; clients with fewer steps are padded): docs/benchmarks.md."""
    if name != "auto":
        return name
    return "vectorized" if device.type == "cuda" else "sequential"


def check_vectorizable(algorithm: Algorithm) -> None:
    """Refuses, naming the part, a method with a part that declares ``supports_vectorized = False``
    (a part whose per-client work cannot run on ``[C, P]`` tensors of a whole cohort)."""
    for role, part in algorithm.parts.items():
        if not part.supports_vectorized:
            raise ConfigError(f"engine=vectorized: {role} '{part.name}' of '{algorithm.name}' does not support the "
                             f"vectorized engine yet; use engine=sequential")


# Model-sized vectors the inner loop holds per client besides the parts' state: W, W + eps, eps, the
# per-tensor gradients and their flat copy, the direction and the step's temporaries.
LOOP_VECTORS = 8
DEFAULT_CPU_BUDGET = 2 << 30  # bytes for one vectorized chunk on CPU


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
            model(w, x)
    finally:
        for h in handles:
            h.remove()
    return total


def memory_budget(device: torch.device) -> int:
    """Bytes a vectorized chunk may use: half the free GPU memory, or 2 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return DEFAULT_CPU_BUDGET


def auto_chunk_size(per_client_bytes: int, budget: int, K: int) -> int:
    """The most clients whose working sets fit ``budget`` (at least one, at most ``K``)."""
    return max(1, min(K, budget // max(per_client_bytes, 1)))


@dataclass
class RoundResult:
    round: int
    lr: float
    train_loss: float
    drift: float
    clients: int
    seconds: float
    backprops_per_step: float = 0.0  # measured: the oracle's backward passes / the round's local steps
    store: int = 0  # client-state vectors held in the store after the round


class Simulation:
    """One federated experiment in memory: data, split, model, algorithm, server and client state.

    ``dataset`` and ``model_fn`` let a Python user bring their own tensors and ``nn.Module`` factory.
    """

    def __init__(self, cfg: Config, dataset: Dataset | None = None, model_fn: Callable[[], nn.Module] | None = None):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        if dataset is None:
            dataset = load_dataset(cfg.data.name, root=cfg.data.root, download=cfg.data.download, **cfg.data.options)
        self.dataset = dataset.to(self.device)
        scheme_params = {k: v for k, v in cfg.data.partition.items() if k != "scheme"}
        labels = dataset.y_train.cpu().numpy()
        self.client_indices_np = partition(labels, cfg.data.num_clients, cfg.data.partition["scheme"],
                                           seed=stream_seed(cfg.seed, -1, SERVER, "partition"), **scheme_params)
        self.client_indices = [torch.as_tensor(ix, dtype=torch.long, device=self.device) for ix in self.client_indices_np]
        self.num_samples = torch.tensor([len(ix) for ix in self.client_indices_np], device=self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(cfg.seed, -1, SERVER, "init"))
            module = model_fn() if model_fn is not None else build_model(
                cfg.model["name"], dataset.input_shape, dataset.num_classes,
                **{k: v for k, v in cfg.model.items() if k != "name"})
        self.model = FlatModel(module.to(self.device))
        self.algorithm: Algorithm = build_algorithm(cfg.algo)
        self.engine = resolve_engine(cfg.engine, self.device)
        self._client_bytes: int | None = None
        if self.engine == "vectorized":
            check_vectorizable(self.algorithm)
        self.oracle = Oracle(self.model, vectorized=self.engine == "vectorized")
        self.settings = TrainSettings(weight_decay=cfg.train.weight_decay, clip=cfg.train.clip,
                                      batch_size=cfg.train.batch_size, global_lr=cfg.train.global_lr,
                                      num_clients=cfg.data.num_clients, seed=cfg.seed,
                                      layout=self.model.layout)
        self.w = self.model.initial.clone()
        self.server: dict[str, torch.Tensor] = {}
        for part in self.algorithm.ordered:
            part.setup(self.server, self.w, self.settings)
        self.store = ClientStore(self.model.layout.size, self.device, memory_mb=cfg.store.memory_mb,
                                 directory=cfg.store.dir)
        augment = cifar_augment if dataset.augmentation == "cifar" else None
        self.batches = ClientBatches(self.dataset.x_train, self.dataset.y_train, self.client_indices,
                                     cfg.train.batch_size, cfg.seed, augment)

    @property
    def num_parameters(self) -> int:
        return self.model.layout.size

    def sample_clients(self, round: int) -> torch.Tensor:
        """Round ``t``'s clients: ``K`` uniformly without replacement, or Bernoulli(K/N) participation
        (at least one client, as FL-Simulator)."""
        N, K = self.cfg.data.num_clients, self.cfg.sampling.clients_per_round
        rng = numpy_stream(self.cfg.seed, round, SERVER, "sampling")
        if self.cfg.sampling.participation == "bernoulli":
            chosen = (rng.random(N) < K / N).nonzero()[0]
            if len(chosen) == 0:
                chosen = rng.choice(N, 1)
        else:
            chosen = rng.choice(N, K, replace=False)
        return torch.as_tensor(sorted(chosen.tolist()), dtype=torch.long)

    def lr_at(self, round: int) -> float:
        return self.cfg.train.lr * self.cfg.train.lr_decay ** round

    def client_bytes(self) -> int:
        """Estimated bytes one client of a vectorized chunk needs: the loop's model-sized vectors, the
        parts' per-client state, and three times a batch's activations (kept, their gradients, scratch)."""
        vectors = LOOP_VECTORS + 2 * self.algorithm.client_state_vectors
        x = self.dataset.x_train[: self.cfg.train.batch_size]
        per_client = vectors * self.num_parameters * self.w.element_size()
        return per_client + 3 * activation_bytes(self.model, self.w, x)

    def chunk_size(self, K: int) -> int:
        """Clients trained together: 1 for the sequential engine; ``chunk_size`` if set, else as many
        as fit the memory budget (:func:`memory_budget`)."""
        if self.engine == "sequential":
            return 1
        if self.cfg.chunk_size:
            return min(K, self.cfg.chunk_size)
        if self._client_bytes is None:
            self._client_bytes = self.client_bytes()
        return auto_chunk_size(self._client_bytes, memory_budget(self.device), K)

    def new_context(self, round: int) -> RoundContext:
        sampled = self.sample_clients(round)
        n = self.num_samples[sampled.to(self.device)]
        t = self.cfg.train
        steps = torch.tensor([local_steps(int(ni), t.batch_size, t.local_epochs, t.local_steps) for ni in n.tolist()],
                             device=self.device)
        return RoundContext(round=round, lr=self.lr_at(round), w=self.w, sampled=sampled.to(self.device),
                            num_samples=n, steps=steps, server=self.server, store=self.store,
                            oracle=self.oracle, settings=self.settings, batches=self.batches)

    def run_round(self, round: int) -> RoundResult:
        """One communication round; updates ``self.w`` and the server/client state."""
        start = time.perf_counter()
        backprops_before = self.oracle.backprops
        ctx = self.new_context(round)
        algorithm = self.algorithm
        ctx.w_start = algorithm.parts["server"].broadcast(ctx)
        K, P = ctx.K, self.num_parameters
        ctx.w_final = torch.empty(K, P, device=self.device)
        ctx.train_loss = torch.empty(K, device=self.device)
        size = self.chunk_size(K)
        for lo in range(0, K, size):
            rows = slice(lo, min(K, lo + size))
            cohort = Cohort(ids=ctx.sampled[rows], num_samples=ctx.num_samples[rows], steps=ctx.steps[rows],
                            rows=rows, active=torch.ones(rows.stop - lo, dtype=torch.bool, device=self.device))
            train_chunk(ctx, cohort, algorithm, self.batches)
        if not torch.isfinite(ctx.train_loss).all() or not torch.isfinite(ctx.w_final).all():
            raise Diverged(f"round {round}: non-finite local loss or model (try a smaller train.lr or algo radius)")
        ctx.weights = algorithm.parts["aggregation"].weights(ctx)
        for part in algorithm.ordered:
            part.finish(ctx)
        w_new = algorithm.parts["server"].step(ctx)
        for part in algorithm.ordered:
            part.after_step(ctx, w_new)
        if not torch.isfinite(w_new).all():
            raise Diverged(f"round {round}: the global model became non-finite")
        drift = (ctx.w_final - ctx.w).norm(dim=1).mean().item()
        self.w = w_new
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return RoundResult(round=round, lr=ctx.lr, train_loss=ctx.train_loss.mean().item(), drift=drift, clients=K,
                           seconds=time.perf_counter() - start,
                           backprops_per_step=(self.oracle.backprops - backprops_before) / ctx.steps.sum().item(),
                           store=self.store.count())

    def state_dict(self) -> dict:
        """Everything that evolves across rounds: the global model, server state, client-state store.
        (Random streams are keyed by round, so no generator state needs saving.)"""
        return {"w": self.w.detach().cpu().clone(),
                "server": {k: v.detach().cpu().clone() for k, v in self.server.items()},
                "store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"].to(self.device)
        self.server.clear()
        self.server.update({k: v.to(self.device) for k, v in state["server"].items()})
        self.store.load_state_dict(state["store"])

    @torch.no_grad()
    def evaluate(self, w: torch.Tensor | None = None) -> tuple[float, float]:
        """``(accuracy, mean loss)`` of ``w`` (default: the global model) on the test set."""
        w = self.w if w is None else w
        x, y = self.dataset.x_test, self.dataset.y_test
        correct, loss = 0, 0.0
        for lo in range(0, x.shape[0], self.cfg.eval.batch_size):
            logits = self.model(w, x[lo:lo + self.cfg.eval.batch_size])
            target = y[lo:lo + self.cfg.eval.batch_size]
            loss += F.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(1) == target).sum().item()
        return correct / x.shape[0], loss / x.shape[0]
