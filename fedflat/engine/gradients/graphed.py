"""The data loss's passes replayed from CUDA graphs (``cuda_graphs: true``, :mod:`fedflat.engine.graphs`)."""
from __future__ import annotations

from fedflat.engine.gradients.backend import Accelerated
from fedflat.engine.graphs import GraphedPass


class Graphed(Accelerated):
    """``inner``'s data pass (one client's, or a vectorized chunk's) captured once per batch shape and replayed:
    one :class:`~fedflat.engine.graphs.GraphedPass` per number of inputs (a vectorized chunk's padded batches
    bring their ``weight``), so full and padded chunks keep graphs of their own."""

    def __init__(self, inner):
        super().__init__(inner)
        self.passes: dict[int, GraphedPass] = {}

    def data_pass(self, *inputs):
        graphed = self.passes.get(len(inputs))
        if graphed is None:
            graphed = self.passes[len(inputs)] = GraphedPass(self.inner.data_pass)
        return graphed(*inputs)

    @property
    def replays(self) -> int:
        return sum(p.replays for p in self.passes.values())
