"""How a run computes, apart from what it computes: one frozen :class:`ComputeOptions`, passed whole.

The config's compute settings (``engine``, ``precision``, ``channels_last``, ``cuda_graphs``, ``compile``, ``tf32``,
``chunk_size``, ``threads``) travel together from the config through :class:`~fedflat.engine.simulation.Simulation` and
:class:`~fedflat.engine.runtime.WorkerSpec` to each :class:`~fedflat.engine.runtime.ClientRuntime` and its oracle,
which chooses its gradient backend from them once (:func:`fedflat.engine.gradients.choose_backend`). None of them
changes a number on the CPU except the engine's padding rules (docs/models.md, "The engines") and ``compile``'s
order of operations (float32 rounding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Precision = Literal["float32", "bf16"]


@dataclass(frozen=True)
class ComputeOptions:
    """The run's compute settings (the config's fields of the same names; docs/configuration.md).

    ``engine``: ``auto``, ``sequential``, ``vectorized`` or ``streams`` (a runtime holds the resolved one:
    :func:`fedflat.engine.runtime.resolve_engine`); ``precision``: the clients' passes in ``float32`` or under
    bfloat16 autocast; ``channels_last``: image batches in NHWC order; ``cuda_graphs``: full batches' passes
    replayed from CUDA graphs; ``compile``: a client's data pass compiled by ``torch.compile``; ``tf32``: TF32
    tensor-core products on CUDA; ``chunk_size``: clients per vectorized chunk (None: from the memory budget);
    ``threads``: torch intra-op threads (``auto``, a number or None)."""

    engine: str = "sequential"
    precision: Precision = "float32"
    channels_last: bool = False
    cuda_graphs: bool = False
    compile: bool = False
    tf32: bool = False
    chunk_size: int | None = None
    threads: int | str | None = "auto"

    @classmethod
    def of(cls, cfg: Any) -> ComputeOptions:
        """The options a :class:`fedflat.config.Config` sets."""
        return cls(engine=cfg.engine, precision=cfg.precision, channels_last=cfg.channels_last,
                   cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, tf32=cfg.tf32, chunk_size=cfg.chunk_size,
                   threads=cfg.threads)

    @property
    def vectorized(self) -> bool:
        return self.engine == "vectorized"
