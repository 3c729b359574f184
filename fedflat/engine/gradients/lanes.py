"""``engine: streams``: a cohort's clients' data-loss passes, each on a CUDA stream of its own
(:class:`fedflat.engine.graphs.ClientLanes`)."""
from __future__ import annotations

from fedflat.engine.gradients.backend import Accelerated
from fedflat.engine.graphs import ClientLanes


class Lanes(Accelerated):
    """Every client's pass of ``inner`` (the sequential engine's kernels) on its lane, a graph each under
    ``cuda_graphs``; the results are those of the passes run one after another."""

    def __init__(self, inner, cuda_graphs: bool = False):
        super().__init__(inner)
        self.lanes = ClientLanes(inner.data_pass, inner.forward.model.initial.device, cuda_graphs)

    def loss_grad(self, W, batch, objective):
        if not objective.plain:
            return self.general.loss_grad(W, batch, objective)
        self.forward.mode(True)
        return self.lanes.run([(W[c], *batch.row(c)) for c in range(W.shape[0])])

    def data_pass(self, *inputs):
        return self.inner.data_pass(*inputs)
