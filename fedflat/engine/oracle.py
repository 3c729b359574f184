"""The gradient oracle: loss and gradient of each client's objective at its own parameters.

Both engines call the same oracle interface with a leading client dimension ``C``:
``loss_grad(W[C, P], batch) -> (loss[C], g[C, P])``. The sequential oracle loops over the rows on
one reused model; the vectorized oracle runs all rows at once with ``torch.func.vmap``.

Gradients are taken with respect to the per-tensor views of ``w`` (not ``w`` itself) and written
into one flat ``[C, P]`` tensor by a single ``torch.cat``: differentiating through the views of one
flat leaf would make autograd materialise a zero-filled ``[P]`` gradient per tensor and add them up,
which costs more than the backward pass itself for a small MLP. The values are the same.

fedflat's own MLP and LogReg under plain cross-entropy in float32 on the CPU (``ModelTraits.hand_gradient``,
decided once per model) skip autograd on the sequential engine: :class:`~fedflat.engine.mlp_gradient.MLPGradient`
runs the forward pass and the backward formulas autograd would run, the same ATen operations on the same operands,
and writes each layer's gradient into its slice of ``g[P]`` (no graph, no ``torch.cat``): the same bits, and W1's
rounds in 0.7-0.85 of their CPU time (docs/benchmarks.md). Distillation, DP-SGD, ``precision: bf16``, a ``loss_fn``,
the vectorized engine, a GPU and every other module keep autograd.

A module with buffers, dropout or batch statistics (:class:`fedflat.engine.modes.ModelTraits`) is run per client
within a :class:`ClientSession` that :func:`fedflat.engine.client.fit` opens: training passes in ``train()`` mode,
each client with its own buffers (``[C, Q]``) and its own dropout masks, a step's batch never padded (clients of
the vectorized engine are grouped by their batch's length), and the buffers a local step leaves are those of its
first training pass (:meth:`ClientSession.step`). Loss evaluations without a gradient (:meth:`Oracle.loss`) and a
distillation teacher's logits run in ``eval()`` mode.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F

from fedflat.core import Batch, Contrast, Distillation, clip_factors, stream_seed, torch_stream
from fedflat.engine.graphs import ClientLanes, GraphedPass, check_cuda_graphs
from fedflat.engine.losses import LossFn, mean_loss, per_sample
from fedflat.engine.mlp_gradient import MLPGradient
from fedflat.engine.modes import DropoutCall, ModelTraits, Replay, draw_keep, drawing, recording
from fedflat.params import FlatModel


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


# The activation modules whose outputs MAN's penalty reads (the hidden layers' nonlinearities)
ACTIVATIONS = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.GELU, torch.nn.SiLU,
               torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softplus, torch.nn.Mish, torch.nn.Hardtanh)


def activation_norms(activations: list[torch.Tensor], weight: torch.Tensor | None) -> torch.Tensor:
    """``sum_l mean_b mean_f a_l[b, f]^2`` of a batch's activations ``a_l[B, ...]`` (FedMAN's layerwise
    activation norm; with ``weight[B]`` the weighted mean over the real samples)."""
    total = 0.0
    for a in activations:
        per_sample_norm = a.reshape(a.shape[0], -1).pow(2).mean(1)
        total = total + (per_sample_norm.mean() if weight is None
                         else (per_sample_norm * weight).sum() / weight.sum())
    return total


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


class ClientSession:
    """The cohort a stateful module's oracle calls compute (:func:`fedflat.engine.client.fit` opens one per chunk).

    ``buffers[C, Q]``: each client's buffers, which the first training pass of every local step updates
    (``step`` marks a step's start; ``active`` rows only: a client whose steps are exhausted keeps its own);
    ``start``: the buffers the clients started from (eval-mode passes); ``dropout``: each client's generator of
    dropout masks, ``torch_stream(seed, round, client, "dropout")``."""

    def __init__(self, buffers: torch.Tensor, dropout: list[torch.Generator] | None):
        self.start = buffers
        self.buffers = buffers.clone()
        self.dropout = dropout
        self.active: torch.Tensor | None = None
        self.fresh = False

    @property
    def size(self) -> int:
        return int(self.buffers.shape[0])

    def step(self, active: torch.Tensor | None) -> None:
        """A local step begins: its first training pass updates the buffers of the ``active`` rows."""
        self.active, self.fresh = active, True

    def first_pass(self) -> bool:
        """Whether this training pass is the step's first (it updates the buffers); later passes of the step
        (SAM's descent at ``w + eps`` after its ascent at ``w``) leave them, as ``disable_running_stats`` does in
        the SAM authors' code."""
        first, self.fresh = self.fresh, False
        return first

    def commit(self, rows: torch.Tensor, new: torch.Tensor) -> None:
        """The buffers ``new[G, Q]`` of the clients at positions ``rows``, where active."""
        if self.active is not None:
            new = torch.where(self.active[rows][:, None], new, self.buffers[rows])
        self.buffers[rows] = new


class Oracle:
    """Stochastic loss and gradient ``g(w)`` for a cohort, counting backprops.

    ``backprops`` counts per-client backward passes, so a method's "backprops per local step"
    (seed 002, Table 7) can be measured rather than declared; rows of clients whose local steps are
    exhausted (masked padding of the vectorized engine) are not counted. ``traits`` (found by
    :func:`fedflat.engine.modes.inspect_module`) say whether the module needs the per-client passes of a
    :class:`ClientSession`; by default, when it has buffers or normalizes with batch statistics.
    """

    def __init__(self, model: FlatModel, vectorized: bool = False, precision: str = "float32",
                 channels_last: bool = False, traits: ModelTraits | None = None, loss: LossFn | None = None,
                 cuda_graphs: bool = False, streams: bool = False):
        self.model = model
        self.loss_fn = loss  # per-sample losses (None: cross-entropy), fedflat/engine/losses.py
        self.vectorized = vectorized
        self.autocast = {"float32": None, "bf16": torch.bfloat16}[precision]
        self.channels_last = channels_last
        self.backprops = 0
        hand = MLPGradient.of(model)  # (found again on this process's own module: a Ray worker builds its own)
        self.traits = traits if traits is not None else ModelTraits(
            buffers=model.buffer_layout.size > 0,
            mixes=any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.module.modules()),
            hand_gradient=hand is not None)
        plain = not vectorized and self.autocast is None and loss is None  # sequential, float32, cross-entropy
        self.hand = hand if self.traits.hand_gradient and plain else None  # the gradient by hand (None: autograd)
        self.session: ClientSession | None = None
        self._dropout_calls: dict[tuple, tuple[DropoutCall, ...]] = {}
        self.dp_sgd: tuple[float, float] | None = None  # (C, z) of per-example DP-SGD (privacy.level: instance)
        self._dp_noise: list[torch.Generator] = []  # each row's noise stream in the open clients() block
        if vectorized:
            self._vgrad = torch.func.vmap(torch.func.grad_and_value(self._mean_loss))
            self._vgrad_weighted = torch.func.vmap(torch.func.grad_and_value(self._weighted_loss))
            self._vloss = torch.func.vmap(self._mean_loss)
            self._vloss_weighted = torch.func.vmap(self._weighted_loss)
        # the stateless passes replayed from CUDA graphs (fedflat/engine/graphs.py)
        self.graphed: GraphedPass | None = None
        self.graphed_weighted: GraphedPass | None = None  # (the vectorized engine's padded batches)
        if cuda_graphs:
            check_cuda_graphs(model.initial.device)
            self.graphed = GraphedPass(self._vector_pass if vectorized else self._loss_grad_one)
            self.graphed_weighted = GraphedPass(self._vector_pass_weighted) if vectorized else None
        # engine=streams: a cohort's full batches, each client's pass on a CUDA stream of its own (graphs.py)
        self.lanes = ClientLanes(self._loss_grad_one, model.initial.device, cuda_graphs) if streams else None

    def _logits(self, views: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """The model's forward pass at ``views``; with ``precision: bf16`` under ``torch.autocast`` (matrix
        products and convolutions in bfloat16, reductions and normalizations in float32, as autocast decides),
        the logits returned in float32. Parameters and gradients stay float32 leaves either way."""
        if self.autocast is None:
            return self.model.call_views(views, x)
        # (autocast's cache of cast weights would hold tensors of a graph's capture past it: off under CUDA graphs)
        with torch.autocast(x.device.type, dtype=self.autocast, cache_enabled=self.graphed is None):
            logits = self.model.call_views(views, x)
        return logits.float()

    def _arranged(self, x: torch.Tensor) -> torch.Tensor:
        """One client's image batch in channels-last memory order when ``channels_last`` is set (cuDNN's
        tensor-core convolutions want NHWC). Only outside ``vmap``, which cannot change a memory format: the
        vectorized engine keeps its grouped convolutions' layout."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    # Per-client losses of the tensors ``views`` (one client's parameters, per tensor).
    def _mean_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mean_loss(self.loss_fn, self._logits(views, x), y)

    def _weighted_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                       weight: torch.Tensor) -> torch.Tensor:
        losses = per_sample(self.loss_fn, self._logits(views, x), y)
        return (losses * weight).sum() / weight.sum()

    def _distilled_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                        teacher_logp: torch.Tensor, weight: torch.Tensor | None = None, *, gamma: float,
                        tau: float, data_weight: float = 1.0, not_true: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(objective, CE)`` of one client's batch."""
        return distilled_objective(self._logits(views, x), y, teacher_logp, gamma, tau, weight, self.loss_fn,
                                   data_weight=data_weight, not_true=not_true)

    @torch.no_grad()
    def teacher_log_probs(self, distill: Distillation, x: torch.Tensor) -> torch.Tensor:
        """``log softmax(f(teacher, x) / tau)`` of a cohort's batch ``x[C, B, ...]`` in one forward pass, ``[C, B, K]``
        (in ``eval()`` mode; a module with buffers runs each client's rows with the buffers it started from)."""
        C, B = x.shape[:2]
        if self.traits.stateful:
            start = self._session(C).start
            logits = torch.stack([self._eval_logits(distill.teacher, start[c], x[c]) for c in range(C)])
            return F.log_softmax(logits / distill.temperature, dim=-1)
        logits = self.model(distill.teacher, x.reshape(C * B, *x.shape[2:]))
        return F.log_softmax(logits / distill.temperature, dim=-1).reshape(C, B, -1)

    def _loss_grad_distilled(self, W: torch.Tensor, batch: Batch,
                             distill: Distillation) -> tuple[torch.Tensor, torch.Tensor]:
        """``(CE[C], grad[C, P])`` of the distilled objective; the reported loss is the data loss, as it is for
        methods whose regularizer enters through the gradient (FedProx, FedDyn)."""
        C = W.shape[0]
        teacher_logp = self.teacher_log_probs(distill, batch.x)
        self._mode(True)  # the teacher's pass was an evaluation
        objective = partial(self._distilled_loss, gamma=distill.weight, tau=distill.temperature,
                            data_weight=distill.data_weight, not_true=distill.not_true)
        if self.vectorized:
            views = tuple(self.model.layout.views(W.detach()))
            padded = () if batch.weight is None else (batch.weight,)
            grads, (_, ce) = torch.func.vmap(torch.func.grad_and_value(objective, has_aux=True))(
                views, batch.x, batch.y, teacher_logp, *padded)
            return ce, self._flat(grads, (C,))
        losses, rows = [], []
        for c in range(C):
            views = [v.detach().requires_grad_(True) for v in self.model.layout.views(W[c])]
            x, y = batch.row(c)
            total, ce = objective(views, self._arranged(x), y, teacher_logp[c][batch.real(c)])
            rows.append(self._flat(torch.autograd.grad(total, views), ()))
            losses.append(ce.detach())
        return torch.stack(losses), torch.stack(rows)

    def _penalized_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                        *extra: torch.Tensor, penalty: float, distill: Distillation | None,
                        padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(objective + penalty/2 sum_l mean |a_l|^2, reported loss)`` of one client's batch: the activations
        ``a_l`` of every activation module (:data:`ACTIVATIONS`) caught by forward hooks during the pass; ``extra``
        the teacher's log-probabilities (with ``distill``) and the samples' weights (``padded``)."""
        teacher_logp = extra[0] if distill is not None else None
        weight = extra[-1] if padded else None
        caught: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: caught.append(out)) for m in self._activations()]
        try:
            logits = self._logits(views, x)
        finally:
            for hook in hooks:
                hook.remove()
        if distill is not None:
            data, reported = distilled_objective(logits, y, teacher_logp, distill.weight, distill.temperature, weight,
                                                 self.loss_fn, data_weight=distill.data_weight,
                                                 not_true=distill.not_true)
        elif weight is None:
            data = reported = mean_loss(self.loss_fn, logits, y)
        else:
            data = reported = (per_sample(self.loss_fn, logits, y) * weight).sum() / weight.sum()
        return data + penalty / 2 * activation_norms(caught, weight), reported

    def _activations(self) -> list[torch.nn.Module]:
        modules = [m for m in self.model.module.modules() if isinstance(m, ACTIVATIONS)]
        if not modules:
            raise ValueError(f"an activation penalty reads the outputs of the model's activation modules "
                             f"({', '.join(a.__name__ for a in ACTIVATIONS)}); {type(self.model.module).__name__} "
                             "has none")
        return modules

    def _loss_grad_penalized(self, W: torch.Tensor, batch: Batch, distill: Distillation | None,
                             penalty: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], grad[C, P])`` of the data loss (with ``distill``'s term) plus FedMAN's activation penalty."""
        C = W.shape[0]
        teacher_logp = None if distill is None else self.teacher_log_probs(distill, batch.x)
        self._mode(True)
        objective = partial(self._penalized_loss, penalty=penalty, distill=distill, padded=batch.weight is not None)
        if self.vectorized:
            extra = (() if teacher_logp is None else (teacher_logp,)) + (() if batch.weight is None else (batch.weight,))
            views = tuple(self.model.layout.views(W.detach()))
            grads, (_, reported) = torch.func.vmap(torch.func.grad_and_value(objective, has_aux=True))(
                views, batch.x, batch.y, *extra)
            return reported, self._flat(grads, (C,))
        losses, rows = [], []
        for c in range(C):
            views = [v.detach().requires_grad_(True) for v in self.model.layout.views(W[c])]
            x, y = batch.x[c], batch.y[c]
            extra = ((() if teacher_logp is None else (teacher_logp[c],))
                     + (() if batch.weight is None else (batch.weight[c],)))
            total, reported = objective(views, self._arranged(x), y, *extra)
            rows.append(self._flat(torch.autograd.grad(total, views), ()))
            losses.append(reported.detach())
        return torch.stack(losses), torch.stack(rows)

    def _logits_features(self, views: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, z)`` of the module at ``views``: ``z = features(x)``, ``logits = head(z)`` (a fedflat model's
        ``forward``, :class:`fedflat.models.base.FedModel`), in float32 as :meth:`_logits` gives them."""
        module = self.model.module
        if not (hasattr(module, "features") and hasattr(module, "head")):
            raise ValueError(f"{type(module).__name__} has no features()/head split: a representation loss (MOON) "
                             "needs a model whose forward is head(features(x)) (docs/models.md)")
        for owner, attr, j in self.model._slots:
            owner.__dict__[attr] = views[j]
        with (torch.autocast(x.device.type, dtype=self.autocast, cache_enabled=self.graphed is None)
              if self.autocast is not None else nullcontext()):
            z = module.features(x)
            logits = module.head(z)
        return logits.float(), z.float()

    def _contrastive_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor, z_glob: torch.Tensor,
                          z_prev: torch.Tensor, on: torch.Tensor, weight: torch.Tensor | None = None, *, mu: float,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits, z = self._logits_features(views, x)
        return contrastive_objective(logits, z, y, z_glob, z_prev, on, mu, temperature, weight, self.loss_fn)

    @torch.no_grad()
    def contrast_features(self, term: Contrast, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z_glob, z_prev)`` ``[C, B, D]`` of a cohort's batch: the representations at the term's anchor (one pass)
        and at each client's previous model, in ``eval()`` mode."""
        C, B = x.shape[:2]
        z_glob = self.model.features(term.anchor, x.reshape(C * B, *x.shape[2:])).reshape(C, B, -1)
        z_prev = torch.stack([self.model.features(term.previous[c], x[c]) for c in range(C)])
        return z_glob, z_prev

    def _loss_grad_contrast(self, W: torch.Tensor, batch: Batch, term: Contrast) -> tuple[torch.Tensor, torch.Tensor]:
        """``(CE[C], grad[C, P])`` of MOON's objective (:func:`contrastive_objective`), both engines."""
        if self.traits.stateful:
            raise ValueError("MOON's contrastive term runs on models without buffers, batch statistics or dropout "
                             "(model.norm=group or none, no dropout): the per-client sessions of such a model do not "
                             "carry it")
        C = W.shape[0]
        z_glob, z_prev = self.contrast_features(term, batch.x)
        self._mode(True)
        on = term.on.to(W.dtype)
        objective = partial(self._contrastive_loss, mu=term.weight, temperature=term.temperature)
        if self.vectorized:
            views = tuple(self.model.layout.views(W.detach()))
            padded = () if batch.weight is None else (batch.weight,)
            grads, (_, ce) = torch.func.vmap(torch.func.grad_and_value(objective, has_aux=True))(
                views, batch.x, batch.y, z_glob, z_prev, on, *padded)
            return ce, self._flat(grads, (C,))
        losses, rows = [], []
        for c in range(C):
            views = [v.detach().requires_grad_(True) for v in self.model.layout.views(W[c])]
            x, y = batch.row(c)
            keep = batch.real(c)
            total, ce = objective(views, self._arranged(x), y, z_glob[c][keep], z_prev[c][keep], on[c])
            rows.append(self._flat(torch.autograd.grad(total, views), ()))
            losses.append(ce.detach())
        return torch.stack(losses), torch.stack(rows)

    def _mode(self, training: bool) -> None:
        """The module's mode for a pass of a module without per-client state, whose passes set none themselves: an
        evaluation (``FlatModel.__call__``, the chunk budget's probe) leaves ``eval()`` mode behind, and a forward
        that reads ``self.training`` would otherwise train in it."""
        if self.model.module.training != training:
            self.model.module.train(training)

    def _flat(self, grads: tuple[torch.Tensor, ...], lead: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([g.reshape(*lead, -1) for g in grads], dim=-1)

    @property
    def gradient(self) -> str:
        """Which gradient the steps run: ``native`` (the hand-derived MLP gradient as one C++ operator), ``python``
        (the same hand-derived gradient in Python: the operator is off or could not be built) or ``autograd``
        (any other model, engine, precision or loss); ``summary.json`` records it."""
        if self.hand is None:
            return "autograd"
        return "native" if self.hand.native is not None else "python"

    def _loss_grad_one(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hand is not None and self.hand.takes(w, x, y):
            return self.hand.loss_grad(w, x, y)
        views = [v.detach().requires_grad_(True) for v in self.model.layout.views(w)]
        loss = self._mean_loss(views, self._arranged(x), y)
        grads = torch.autograd.grad(loss, views)
        return loss.detach(), self._flat(grads, ())

    def _vector_pass(self, W: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of a cohort's full batches under ``vmap`` (the vectorized engine's pass)."""
        grads, loss = self._vgrad(tuple(self.model.layout.views(W.detach())), x, y)
        return loss, self._flat(grads, (W.shape[0],))

    def _vector_pass_weighted(self, W: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_vector_pass` of padded batches, each client's loss the ``weight``-ed mean of its real samples."""
        grads, loss = self._vgrad_weighted(tuple(self.model.layout.views(W.detach())), x, y, weight)
        return loss, self._flat(grads, (W.shape[0],))

    def loss_grad(self, W: torch.Tensor, batch: Batch, distill: Distillation | Contrast | None = None,
                  penalty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of each client's mini-batch loss at its row of ``W``; with ``distill``, ``g`` is
        the gradient of the loss plus the distillation term (:func:`distilled_objective`) or MOON's contrastive term
        (:func:`contrastive_objective`); with ``penalty`` ``mu``, plus ``mu/2`` times the layerwise activation norms
        (FedMAN, :func:`activation_norms`)."""
        C = W.shape[0]
        self.backprops += C if batch.clients is None else batch.clients
        if self.dp_sgd is not None:
            return self._private_loss_grad(W, batch)
        if isinstance(distill, Contrast):
            if penalty:
                raise ValueError("FedMAN's activation penalty beside MOON's contrastive term is not implemented: "
                                 "use one of them")
            return self._loss_grad_contrast(W, batch, distill)
        if penalty:
            if self.traits.stateful:
                raise ValueError("an activation penalty (FedMAN) on a model with buffers, batch statistics or random "
                                 "forwards (dropout) is not implemented: use a model without them")
            return self._loss_grad_penalized(W, batch, distill, penalty)
        if self.traits.stateful:
            return self._stateful_loss_grad(W, batch, distill)
        if distill is not None:
            return self._loss_grad_distilled(W, batch, distill)
        self._mode(True)
        if self.vectorized:
            if batch.weight is None:
                return (self.graphed or self._vector_pass)(W, batch.x, batch.y)
            return (self.graphed_weighted or self._vector_pass_weighted)(W, batch.x, batch.y, batch.weight)
        if self.lanes is not None:
            return self.lanes.run([(W[c], *batch.row(c)) for c in range(C)])
        one = self.graphed or self._loss_grad_one
        if C == 1 and batch.weight is None:
            loss, grad = one(W[0], batch.x[0], batch.y[0])
            return loss.unsqueeze(0), grad.unsqueeze(0)
        pairs = [one(W[c], *batch.row(c)) for c in range(C)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    @torch.no_grad()
    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass (an evaluation: ``eval()`` mode, each client's current buffers)."""
        if self.traits.stateful:
            buffers, losses = self._eval_buffers(W.shape[0]), []
            for c in range(W.shape[0]):
                x, y = batch.row(c)
                losses.append(mean_loss(self.loss_fn, self._eval_logits(W[c], buffers[c], self._arranged(x)), y))
            return torch.stack(losses)
        self._mode(False)
        if self.vectorized:
            views = tuple(self.model.layout.views(W))
            if batch.weight is None:
                return self._vloss(views, batch.x, batch.y)
            return self._vloss_weighted(views, batch.x, batch.y, batch.weight)
        losses = []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            losses.append(self._mean_loss(tuple(self.model.layout.views(W[c])), self._arranged(x), y))
        return torch.stack(losses)

    def _private_loss_grad(self, W: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """DP-SGD's gradient of each client row (Abadi et al., CCS 2016), as Opacus computes it: per-example
        gradients (``torch.func``: ``vmap`` of ``grad`` over the batch's examples), each clipped to ``C``, summed,
        ``N(0, z^2 C^2 I)`` from the client's own stream added, divided by the batch size ``B``:
        ``g~ = (sum_j g_j min(1, C / ||g_j||) + N(0, z^2 C^2 I)) / B``. The loss is the batch's mean."""
        clip, z = self.dp_sgd
        self._mode(True)
        if not hasattr(self, "_per_example"):
            self._per_example = torch.func.vmap(torch.func.grad_and_value(self._mean_loss))
        losses, grads = [], []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            views = tuple(v.unsqueeze(0).expand(len(y), *v.shape) for v in self.model.layout.views(W[c].detach()))
            g, loss = self._per_example(views, x.unsqueeze(1), y.unsqueeze(1))
            G = self._flat(g, (len(y),))
            scale = clip_factors(G.double().norm(dim=1), clip).to(G.dtype)
            noise = torch.randn(G.shape[1], generator=self._dp_noise[c], dtype=G.dtype, device=G.device)
            grads.append((scale @ G + noise * (z * clip)) / len(y))
            losses.append(loss.mean())
        return torch.stack(losses), torch.stack(grads)

    @contextmanager
    def clients(self, ids: list[int], round: int, seed: int,
                buffers: torch.Tensor | None) -> Iterator[ClientSession | None]:
        """The :class:`ClientSession` of the clients ``ids`` of round ``round`` starting from ``buffers[C, Q]`` (None:
        a model without buffers), for the oracle calls inside; None, and nothing to do, for a module that needs
        none. A module drawing random numbers outside dropout draws them from the global generator seeded from its
        client's stream ``"forward"`` (the sequential engine: one client at a time). Under DP-SGD each client's
        noise comes from its stream ``"dpsgd"`` of the round."""
        device = self.model.initial.device
        previous_noise = self._dp_noise
        if self.dp_sgd is not None:
            self._dp_noise = [torch_stream(seed, round, i, "dpsgd", device) for i in ids]
        try:
            with self._session_of(ids, round, seed, buffers) as session:
                yield session
        finally:
            self._dp_noise = previous_noise

    @contextmanager
    def _session_of(self, ids: list[int], round: int, seed: int,
                    buffers: torch.Tensor | None) -> Iterator[ClientSession | None]:
        if not self.traits.stateful:
            yield None
            return
        device = self.model.initial.device
        if buffers is None:
            buffers = torch.zeros(len(ids), 0, dtype=torch.float64, device=device)
        dropout = [torch_stream(seed, round, i, "dropout", device) for i in ids] if self.traits.dropout else None
        session = ClientSession(buffers.to(device, torch.float64), dropout)
        previous, self.session = self.session, session
        try:
            with self._keyed_global_stream(ids, round, seed):
                yield session
        finally:
            self.session = previous

    @contextmanager
    def _keyed_global_stream(self, ids: list[int], round: int, seed: int) -> Iterator[None]:
        if self.traits.random is None:
            yield
            return
        if len(ids) != 1:
            raise RuntimeError(f"a module drawing {self.traits.random} in its forward trains one client at a time")
        device = self.model.initial.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(stream_seed(seed, round, ids[0], "forward"))
            yield

    def _session(self, rows: int) -> ClientSession:
        session = self.session
        if session is None or session.size != rows:
            raise RuntimeError(f"the oracle of a module with buffers, dropout or batch statistics computes the clients "
                               f"of an open ClientSession (fit opens it); got {rows} rows for "
                               f"{'no session' if session is None else f'a session of {session.size}'}")
        return session

    def _eval_buffers(self, rows: int) -> torch.Tensor:
        """The buffers of an eval-mode loss of ``rows`` clients: the session's, or for one row (q-FedAvg's ``F_i``,
        client by client) the cohort's when all its clients have the same."""
        session = self.session
        if session is not None and rows == 1 and bool((session.buffers == session.buffers[:1]).all()):
            return session.buffers[:1]
        return self._session(rows).buffers

    def _eval_logits(self, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of one client's ``x`` at ``w`` with the buffers ``b``, in ``eval()`` mode."""
        self.model.module.eval()
        self.model.bind_buffers(self.model.buffer_layout.tensors(b))
        return self._logits(tuple(self.model.layout.views(w)), x)

    def _objective(self, logits: torch.Tensor, y: torch.Tensor, teacher_logp: torch.Tensor | None,
                   distill: Distillation | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(objective, reported loss)`` of one client's unpadded batch."""
        if distill is None:
            ce = mean_loss(self.loss_fn, logits, y)
            return ce, ce
        return distilled_objective(logits, y, teacher_logp, distill.weight, distill.temperature,
                                   loss=self.loss_fn, data_weight=distill.data_weight, not_true=distill.not_true)

    def _stateful_loss_grad(self, W: torch.Tensor, batch: Batch,
                            distill: Distillation | None) -> tuple[torch.Tensor, torch.Tensor]:
        session = self._session(W.shape[0])
        teacher = None if distill is None else self.teacher_log_probs(distill, batch.x)
        update = session.first_pass() and self.model.buffer_layout.size > 0
        self.model.module.train()
        if not self.vectorized:
            pairs = [self._client_loss_grad(session, c, W[c], batch, teacher, distill, update)
                     for c in range(W.shape[0])]
            return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        losses = torch.empty(W.shape[0], dtype=W.dtype, device=W.device)
        grads = torch.empty_like(W)
        for rows, length in _equal_lengths(batch):
            losses[rows], grads[rows] = self._group_loss_grad(session, rows, length, W, batch, teacher, distill, update)
        return losses, grads

    def _client_loss_grad(self, session: ClientSession, c: int, w: torch.Tensor, batch: Batch,
                          teacher: torch.Tensor | None, distill: Distillation | None,
                          update: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's training pass on its real samples, with its buffers and dropout masks (sequential)."""
        x, y = batch.row(c)
        views = [v.detach().requires_grad_(True) for v in self.model.layout.views(w)]
        tensors = self.model.buffer_layout.tensors(session.buffers[c])
        self.model.bind_buffers(tensors)
        with drawing(session.dropout[c]) if session.dropout else nullcontext():
            logits = self._logits(views, self._arranged(x))
        total, reported = self._objective(logits, y, None if teacher is None else teacher[c][batch.real(c)], distill)
        grads = torch.autograd.grad(total, views)
        if update:
            session.commit(torch.tensor([c], device=session.buffers.device),
                           self.model.buffer_layout.pack([t.detach() for t in tensors])[None])
        return reported.detach(), self._flat(grads, ())

    def _group_loss_grad(self, session: ClientSession, rows: torch.Tensor, length: int, W: torch.Tensor,
                         batch: Batch, teacher: torch.Tensor | None, distill: Distillation | None,
                         update: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The training passes of the clients ``rows``, whose batches have ``length`` real samples, under ``vmap``:
        stacked buffers, and the dropout masks each client's stream gives, drawn before the call."""
        x, y = batch.x[rows, :length], batch.y[rows, :length]
        Wg = W[rows].detach()
        buffers = tuple(self.model.buffer_layout.tensors(session.buffers[rows]))
        calls = self._dropout_shapes(Wg[0], session.buffers[rows[0]], x[0]) if session.dropout else ()
        keeps = self._keeps(session, rows.tolist(), calls)
        extra = () if teacher is None else (teacher[rows, :length],)
        client = partial(self._client_pass, calls=calls, distill=distill)
        grads, (_, (reported, new)) = torch.func.vmap(torch.func.grad_and_value(client, has_aux=True))(
            tuple(self.model.layout.views(Wg)), buffers, keeps, x, y, *extra)
        if update:
            session.commit(rows, self.model.buffer_layout.pack(list(new)))
        return reported, self._flat(grads, (len(rows),))

    def _client_pass(self, views: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...],
                     keeps: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                     teacher_logp: torch.Tensor | None = None, *, calls: tuple[DropoutCall, ...],
                     distill: Distillation | None):
        """One client's training pass inside ``vmap``: ``(objective, (reported loss, its updated buffers))``."""
        own = [b.clone() for b in buffers]
        self.model.bind_buffers(own)
        with Replay(keeps, calls) if calls else nullcontext():
            logits = self._logits(views, x)
        total, reported = self._objective(logits, y, teacher_logp, distill)
        return total, (reported, tuple(own))

    @torch.no_grad()
    def _dropout_shapes(self, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple[DropoutCall, ...]:
        """The dropout calls of a training pass on one client's batch ``x`` (found once per batch shape)."""
        key = (tuple(x.shape), x.dtype)
        if key not in self._dropout_calls:
            self.model.bind_buffers(self.model.buffer_layout.tensors(b))
            with recording() as record:
                self._logits(tuple(self.model.layout.views(w)), x)
            self._dropout_calls[key] = tuple(record.calls)
        return self._dropout_calls[key]

    @staticmethod
    def _keeps(session: ClientSession, rows: list[int], calls: tuple[DropoutCall, ...]) -> tuple[torch.Tensor, ...]:
        """``[G, *shape]`` keep-masks per call, each client's drawn from its own stream in call order (as the
        sequential engine draws them); a client whose steps are exhausted draws none."""
        if not calls:
            return ()
        active = session.active.tolist() if session.active is not None else [True] * session.size
        device = session.dropout[0].device
        per_client = [[draw_keep(call, session.dropout[r]) if active[r] else
                       torch.ones(call.shape, dtype=torch.bool, device=device) for call in calls] for r in rows]
        return tuple(torch.stack([masks[j] for masks in per_client]) for j in range(len(calls)))


def _equal_lengths(batch: Batch) -> list[tuple[torch.Tensor, int]]:
    """The rows of a cohort's batch grouped by their number of real samples (longest first), so no group is padded."""
    C, B = batch.y.shape[:2]
    if batch.weight is None:
        return [(torch.arange(C, device=batch.y.device), B)]
    lengths = (batch.weight > 0).sum(1)
    return [((lengths == n).nonzero().flatten(), int(n)) for n in lengths.unique().flip(0).tolist()]


class PenalizedOracle:
    """An oracle whose every :meth:`loss_grad` adds FedMAN's activation penalty ``mu/2 sum_l mean |a_l|^2`` to the
    local objective (the penalty at the perturbed point and in a perturbation's ascent alike, as MAN's code adds it
    to both of SAM's passes); everything else is the wrapped oracle's."""

    def __init__(self, oracle: Oracle, penalty: float):
        self.__dict__.update(_inner=oracle, _penalty=penalty)

    def loss_grad(self, W: torch.Tensor, batch: Batch,
                  distill: Distillation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._inner.loss_grad(W, batch, distill, self._penalty)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._inner, name, value)
