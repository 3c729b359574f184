"""CUDA graphs of the clients' training passes (``cuda_graphs: true``), and their lanes (``engine: streams``).

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

:class:`ClientLanes` runs a cohort's clients' passes side by side (``engine: streams``): each client's pass, the
sequential engine's own kernels, on a CUDA stream of its own, so the GPU overlaps the small kernels of several
clients' batches that one client alone leaves it waiting between; with ``cuda_graphs`` each lane replays its own
graph (its own memory pool: graphs sharing a pool may not run at once). Off CUDA the lanes run one after another.
"""
from __future__ import annotations

from contextlib import nullcontext
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


class ClientLanes:
    """Up to as many CUDA streams as a cohort has clients, each with its client's pass (a :class:`GraphedPass` of its
    own under ``cuda_graphs``). :meth:`run` forks every client's pass from the current stream onto its lane and joins
    them back: the results are those of the passes run one after another (each lane's kernels are one client's,
    in the order the sequential engine runs them)."""

    def __init__(self, f: Pass, device: torch.device, graphs: bool = False):
        self.f, self.device, self.graphs = f, device, graphs
        self.streams: list = []
        self.passes: list[Pass] = []

    def _lane(self, c: int) -> tuple:
        while len(self.passes) <= c:
            self.passes.append(GraphedPass(self.f) if self.graphs else self.f)
            self.streams.append(torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None)
        return self.streams[c], self.passes[c]

    def run(self, calls: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], grad[C, P])``: client ``c``'s pass ``f(*calls[c])`` on lane ``c``."""
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        losses, grads = [], []
        for c, inputs in enumerate(calls):
            stream, f = self._lane(c)
            if stream is not None:
                stream.wait_stream(main)  # the inputs were written on the main stream
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                loss, grad = f(*inputs)
            losses.append(loss)
            grads.append(grad)
        if main is not None:
            for c in range(len(calls)):
                main.wait_stream(self.streams[c])
                # (each lane's outputs are read on the main stream: their memory waits for it before reuse)
                losses[c].record_stream(main)
                grads[c].record_stream(main)
        return torch.stack(losses), torch.stack(grads)

    @property
    def replays(self) -> int:
        return sum(getattr(f, "replays", 0) for f in self.passes)


def check_cuda_graphs(device: torch.device) -> None:
    """Refuses ``cuda_graphs: true`` off a CUDA device, saying what to change."""
    if device.type != "cuda":
        raise ConfigError(f"cuda_graphs=true records CUDA graphs and needs a CUDA device (this run's is {device}); "
                          "set device=cuda or cuda_graphs=false")
