"""DP-SGD's per-example clipped and noised gradient (``privacy.level: instance``)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from fedflat.core import clip_factors, torch_stream
from fedflat.engine.gradients.backend import Accelerated, Backend
from fedflat.engine.gradients.objectives import DATA_LOSS


class PerExampleDP(Accelerated):
    """DP-SGD's gradient of each client row (Abadi et al., CCS 2016), as Opacus computes it: per-example gradients
    (``torch.func``: ``vmap`` of ``grad`` over the batch's examples), each clipped to ``C``, summed,
    ``N(0, z^2 C^2 I)`` from the client's own stream ``"dpsgd"`` of the round added, divided by the batch size
    ``B``: ``g~ = (sum_j g_j min(1, C / ||g_j||) + N(0, z^2 C^2 I)) / B``. The loss is the batch's mean.

    Every call is of the data loss: a method whose objective has a term beyond it declares it
    (``Part.beyond_batch``: FedGMT's, FedNTD's and FedSOL's distillation, MOON's contrast, FedMAN's penalty) and
    ``privacy.level: instance`` refuses it (:mod:`fedflat.privacy.config`). Evaluations and the clients' sessions
    are the general backend's."""

    def __init__(self, inner: Backend, clip: float, noise_multiplier: float):
        super().__init__(inner)
        self.clip, self.z = clip, noise_multiplier
        self.noise: list[torch.Generator] = []  # each row's noise stream in the open clients() block
        forward = self.forward
        self._per_example = torch.func.vmap(torch.func.grad_and_value(lambda *a: DATA_LOSS(forward, *a)[0]))

    @contextmanager
    def clients(self, ids, round, seed, buffers):
        previous, device = self.noise, self.forward.model.initial.device
        self.noise = [torch_stream(seed, round, i, "dpsgd", device) for i in ids]
        try:
            with self.general.clients(ids, round, seed, buffers) as session:
                yield session
        finally:
            self.noise = previous

    def loss_grad(self, W, batch, objective):
        forward, clip = self.forward, self.clip
        forward.mode(True)
        losses, grads = [], []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            views = tuple(v.unsqueeze(0).expand(len(y), *v.shape) for v in forward.model.layout.views(W[c].detach()))
            g, loss = self._per_example(views, x.unsqueeze(1), y.unsqueeze(1))
            G = forward.flat(g, (len(y),))
            scale = clip_factors(G.double().norm(dim=1), clip).to(G.dtype)
            noise = torch.randn(G.shape[1], generator=self.noise[c], dtype=G.dtype, device=G.device)
            grads.append((scale @ G + noise * (self.z * clip)) / len(y))
            losses.append(loss.mean())
        return torch.stack(losses), torch.stack(grads)
