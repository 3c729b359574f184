"""The local objective a gradient is taken of: the data loss, with at most one term added, and FedMAN's penalty.

An :class:`Objective` is one client's ``(objective, reported loss)`` at its per-tensor views, the same function
whether a backend runs it client by client or under ``vmap`` (``weight[B]``, last, for a padded batch: the means
are then over the real samples). What a term needs of the whole cohort beforehand, without gradient (a teacher's
log-probabilities, MOON's anchor representations), :meth:`Objective.prepare` computes once per call for a cohort
under ``vmap``, and :meth:`Objective.prepare_client` for one client from its real samples alone (the per-client
backends: the teacher's pass then has one client's shapes in any cohort, so ``engine: streams`` rounds as the
sequential engine on every CPU). The oracle builds the objective of a call
(:func:`fedflat.engine.client.objective_of`) from the term a method's part gives (:class:`~fedflat.core.Distillation`,
:class:`~fedflat.core.Contrast`) and the activation penalty's weight, so the terms compose instead of branching in
the backends.
"""
from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F

from fedflat.core import Batch, Contrast, Distillation
from fedflat.engine.gradients.forward import Forward
from fedflat.engine.losses import LossFn, mean_loss, per_sample

Rows = tuple[torch.Tensor, ...]


class Evaluator(Protocol):
    """What an objective's preparation reads of a backend (:class:`~fedflat.engine.gradients.backend.Backend`)."""

    forward: Forward

    def cohort_logits(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...

    def client_logits(self, w: torch.Tensor, x: torch.Tensor, c: int) -> torch.Tensor: ...


def not_true_columns(y: torch.Tensor, classes: int) -> torch.Tensor:
    """``[B, K - 1]``: the class indices other than each label ``y[B]``, ascending (FedNTD's not-true classes; made
    by arithmetic, not boolean indexing, so that it runs under ``vmap``)."""
    j = torch.arange(classes - 1, device=y.device)
    return j + (j >= y[..., None]).to(j.dtype)


def distilled_objective(logits: torch.Tensor, y: torch.Tensor, teacher_logp: torch.Tensor, gamma: float, tau: float,
                        weight: torch.Tensor | None = None, loss: LossFn | None = None,
                        data_weight: float = 1.0, not_true: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CE + gamma tau^2 KL(q || p), CE)`` of a batch, ``q = softmax(z_e / tau)`` the teacher's probabilities
    (``teacher_logp`` their logarithms), ``p = softmax(z / tau)``: Hinton et al.'s distillation loss, the KL being
    ``torch.nn.KLDivLoss(reduction="batchmean")`` of ``log p`` against ``q``. Means over the samples, or with
    ``weight[B]`` (0 for padding) weighted means over the real ones. With a ``loss`` of one's own
    (:mod:`fedflat.engine.losses`) it takes CE's place: ``loss + gamma tau^2 KL``. ``data_weight`` scales the data
    loss in the objective (0: the distillation term alone; the reported loss stays CE). With ``not_true`` (FedNTD,
    Lee et al., NeurIPS 2022, eq. 4) both ``p`` and ``q`` are softmaxes over each sample's not-true classes only."""
    student = logits
    if not_true:
        columns = not_true_columns(y, logits.shape[-1])
        student = logits.gather(-1, columns)
        teacher_logp = F.log_softmax(teacher_logp.gather(-1, columns), dim=-1)  # renormalized over K - 1 classes
    log_p = F.log_softmax(student / tau, dim=-1)
    if weight is None:
        ce = mean_loss(loss, logits, y)
        kl = F.kl_div(log_p, teacher_logp, reduction="batchmean", log_target=True)
    else:
        mean = (lambda per_sample: (per_sample * weight).sum() / weight.sum())
        ce = mean(per_sample(loss, logits, y))
        kl = mean(F.kl_div(log_p, teacher_logp, reduction="none", log_target=True).sum(-1))
    data = ce if data_weight == 1.0 else data_weight * ce
    return data + gamma * tau ** 2 * kl, ce


def contrastive_objective(logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor, z_glob: torch.Tensor,
                          z_prev: torch.Tensor, on: torch.Tensor, mu: float, temperature: float,
                          weight: torch.Tensor | None = None,
                          loss: LossFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CE + on mu l_con, CE)`` of one client's batch: MOON's model-contrastive loss (Li, He and Song, CVPR 2021,
    eq. 3) ``l_con = mean_b [logsumexp(s_b^+ / T, s_b^- / T) - s_b^+ / T]``, ``s^+ = cos(z, z_glob)``, ``s^- = cos(z,
    z_prev)`` (``F.cosine_similarity``, the authors' ``nn.CosineSimilarity``), i.e. cross-entropy of the two-way logits
    ``[s^+, s^-] / T`` with label 0. Means over the samples, or with ``weight[B]`` over the real ones."""
    positive = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    negative = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    contrast = torch.logsumexp(torch.stack([positive, negative], dim=-1), dim=-1) - positive
    if weight is None:
        ce, con = mean_loss(loss, logits, y), contrast.mean()
    else:
        ce = (per_sample(loss, logits, y) * weight).sum() / weight.sum()
        con = (contrast * weight).sum() / weight.sum()
    return ce + mu * on * con, ce


def activation_norms(activations: list[torch.Tensor], weight: torch.Tensor | None) -> torch.Tensor:
    """``sum_l mean_b mean_f a_l[b, f]^2`` of a batch's activations ``a_l[B, ...]`` (FedMAN's layerwise
    activation norm; with ``weight[B]`` the weighted mean over the real samples)."""
    total = 0.0
    for a in activations:
        per_sample_norm = a.reshape(a.shape[0], -1).pow(2).mean(1)
        total = total + (per_sample_norm.mean() if weight is None
                         else (per_sample_norm * weight).sum() / weight.sum())
    return total


class Objective:
    """One client's local objective: ``objective(forward, views, x, y, *extra[, weight]) -> (objective, reported
    loss)``, ``extra`` the client's rows of what :meth:`prepare` computed (``extras`` tensors)."""

    extras: ClassVar[int] = 0
    plain: ClassVar[bool] = False  # the data loss alone (what the accelerated backends compute)
    stateful_refusal: ClassVar[str | None] = None  # why a module with per-client state cannot train on it

    def prepare(self, backend: Evaluator, W: torch.Tensor, batch: Batch) -> Rows:
        """The cohort's ``[C, ...]`` tensors the objective reads (computed without gradient, in ``eval()`` mode)."""
        return ()

    def prepare_client(self, backend: Evaluator, x: torch.Tensor, c: int) -> Rows:
        """Client ``c``'s rows of what :meth:`prepare` computes, from its real samples ``x[n_c, ...]`` alone, with
        the operations :meth:`prepare` runs for a cohort of that one client (what the per-client backends call). A
        pass over a cohort's ``[C B, ...]`` rows would round each row otherwise than the client's own ``[n_c, ...]``
        pass where the BLAS picks its kernel by the row count (MKL's on an Intel Xeon): one client's pass keeps
        ``engine: streams`` equal to the sequential engine on every CPU (docs/architecture.md, "Exactness")."""
        return ()

    def split(self, rest: tuple[torch.Tensor, ...]) -> tuple[Rows, torch.Tensor | None]:
        """``(extra, weight)`` of the arguments after ``y``."""
        return rest[:self.extras], (rest[self.extras] if len(rest) > self.extras else None)

    def __call__(self, forward: Forward, views: Any, x: torch.Tensor, y: torch.Tensor,
                 *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class DataLoss(Objective):
    """The mini-batch's mean loss (``train.loss``), or with ``weight`` the mean over its real samples."""

    plain = True

    def __call__(self, forward, views, x, y, *rest):
        _, weight = self.split(rest)
        loss = self.value(forward, forward.logits(views, x), y, weight)
        return loss, loss

    @staticmethod
    def value(forward: Forward, logits: torch.Tensor, y: torch.Tensor,
              weight: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``logits``."""
        if weight is None:
            return mean_loss(forward.loss_fn, logits, y)
        return (per_sample(forward.loss_fn, logits, y) * weight).sum() / weight.sum()


DATA_LOSS = DataLoss()


class Distilled(Objective):
    """The data loss plus a distillation term (:func:`distilled_objective`: FedGMT's, FedNTD's not-true one,
    FedSOL's proximal one); the reported loss is the data loss, as for methods whose regularizer enters through
    the gradient (FedProx, FedDyn)."""

    extras = 1

    def __init__(self, term: Distillation):
        self.term = term

    def prepare(self, backend, W, batch):
        """``log softmax(f(teacher, x) / tau)`` of the cohort's batch, ``[C, B, K]``."""
        with torch.no_grad():
            return (self._log_probs(backend.cohort_logits(self.term.teacher, batch.x)),)

    def prepare_client(self, backend, x, c):
        """``log softmax(f(teacher, x) / tau)`` of client ``c``'s real samples, ``[n_c, K]``."""
        with torch.no_grad():
            return (self._log_probs(backend.client_logits(self.term.teacher, x, c)),)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits / self.term.temperature, dim=-1)

    def __call__(self, forward, views, x, y, *rest):
        (teacher_logp,), weight = self.split(rest)
        t = self.term
        return distilled_objective(forward.logits(views, x), y, teacher_logp, t.weight, t.temperature, weight,
                                   forward.loss_fn, data_weight=t.data_weight, not_true=t.not_true)


class Contrastive(Objective):
    """The data loss plus MOON's model-contrastive term (:func:`contrastive_objective`)."""

    extras = 3
    stateful_refusal = ("MOON's contrastive term runs on models without buffers, batch statistics or dropout "
                        "(model.norm=group or none, no dropout; adapter.dropout=0 under LoRA): the per-client "
                        "sessions of such a model do not carry it")

    def __init__(self, term: Contrast):
        self.term = term

    @torch.no_grad()
    def prepare(self, backend, W, batch):
        """``(z_glob, z_prev, on)``: the representations ``[C, B, D]`` at the term's anchor (one pass) and at each
        client's previous model, in ``eval()`` mode, and the term's switch per client ``[C]``."""
        model, x, term = backend.forward.model, batch.x, self.term
        C, B = x.shape[:2]
        z_glob = model.features(term.anchor, x.reshape(C * B, *x.shape[2:])).reshape(C, B, -1)
        z_prev = torch.stack([model.features(term.previous[c], x[c]) for c in range(C)])
        return z_glob, z_prev, term.on.to(W.dtype)

    @torch.no_grad()
    def prepare_client(self, backend, x, c):
        """Client ``c``'s ``(z_glob, z_prev, on)`` of its real samples ``x``."""
        model, term = backend.forward.model, self.term
        return model.features(term.anchor, x), model.features(term.previous[c], x), term.on[c].to(term.anchor.dtype)

    def __call__(self, forward, views, x, y, *rest):
        (z_glob, z_prev, on), weight = self.split(rest)
        logits, z = forward.logits_features(views, x)
        return contrastive_objective(logits, z, y, z_glob, z_prev, on, self.term.weight, self.term.temperature,
                                     weight, forward.loss_fn)


class Penalized(Objective):
    """``inner`` plus FedMAN's activation penalty ``mu/2 sum_l mean |a_l|^2`` (:func:`activation_norms`): the
    activations of every activation module caught by forward hooks during the pass (at the perturbed point and in
    a perturbation's ascent alike, as MAN's code adds it to both of SAM's passes)."""

    stateful_refusal = ("an activation penalty (FedMAN) on a model with buffers, batch statistics or random "
                        "forwards (dropout) is not implemented: use a model without them (adapter.dropout=0 "
                        "under LoRA)")

    def __init__(self, inner: Objective, mu: float):
        self.inner, self.mu = inner, mu
        self.extras = inner.extras

    def prepare(self, backend, W, batch):
        return self.inner.prepare(backend, W, batch)

    def prepare_client(self, backend, x, c):
        return self.inner.prepare_client(backend, x, c)

    def __call__(self, forward, views, x, y, *rest):
        _, weight = self.split(rest)
        caught: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: caught.append(out)) for m in forward.activations()]
        try:
            data, reported = self.inner(forward, views, x, y, *rest)
        finally:
            for hook in hooks:
                hook.remove()
        return data + self.mu / 2 * activation_norms(caught, weight), reported


TERMS: dict[type, type[Objective]] = {Distillation: Distilled, Contrast: Contrastive}
