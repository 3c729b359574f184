"""CUDA graphs of the clients' training passes (``cuda_graphs: true``).

A local step of a mid-sized network on a fast GPU is bound by the host, not the GPU: ResNet-18-GN at batch 50
launches about 13 ms of kernels a step for 3.8 ms of GPU work in bf16 (docs/benchmarks.md, "GPU, second session").
A CUDA graph records the kernels of one pass (forward, backward and the gradient's concatenation) once per batch
shape and replays them with one launch: the pass then costs its GPU time.

:class:`GraphedPass` wraps a pure function of tensors ``f(w, x, y[, weight]) -> (loss, grad)`` (the oracle's pass
of one client, or the vectorized engine's pass of a chunk, its padded samples weighted 0). It copies the call's inputs into the graph's static inputs,
replays, and returns copies of the static outputs (the next replay overwrites them; a caller may hold a gradient
across passes: SAM's ascent gradient). The kernels are those the eager pass runs, so the numbers are the eager
pass's (tests/test_cuda.py compares them); a pass a graph cannot hold (a new shape beyond ``max_shapes``) runs
eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fedflat.core import ConfigError

Pass = Callable[..., tuple[torch.Tensor, torch.Tensor]]
WARMUP = 3  # eager passes on a side stream before a capture (cuDNN's and cuBLAS's workspaces, autograd's state)


@dataclass
class _Captured:
    """One batch shape's graph: its static inputs ``(w, x, y[, weight])`` and the outputs its replay writes."""

    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    loss: torch.Tensor
    grad: torch.Tensor


class GraphedPass:
    """``f(*inputs) -> (loss, grad)`` replayed from a CUDA graph captured at its first call with each input shape
    (at most ``max_shapes`` graphs, sharing one memory pool; further shapes run eagerly)."""

    def __init__(self, f: Pass, max_shapes: int = 4):
        self.f = f
        self.max_shapes = max_shapes
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = None
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_shapes:
                return self.f(*inputs)
            captured = self.graphs[key] = self._capture(inputs)
        for static, value in zip(captured.inputs, inputs):
            static.copy_(value)
        captured.graph.replay()
        self.replays += 1
        return captured.loss.clone(), captured.grad.clone()

    def _capture(self, given: tuple[torch.Tensor, ...]) -> _Captured:
        """Warms ``f`` up on a side stream (as ``torch.cuda.graphs``' documentation asks), then records one call."""
        inputs = tuple(t.detach().clone() for t in given)
        device = inputs[0].device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.f(*inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            loss, grad = self.f(*inputs)
        self.pool = graph.pool()
        return _Captured(graph, inputs, loss, grad)


def check_cuda_graphs(device: torch.device) -> None:
    """Refuses ``cuda_graphs: true`` off a CUDA device, saying what to change."""
    if device.type != "cuda":
        raise ConfigError(f"cuda_graphs=true records CUDA graphs and needs a CUDA device (this run's is {device}); "
                          "set device=cuda or cuda_graphs=false")
