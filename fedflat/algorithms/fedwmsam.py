r"""FedWMSAM (Li et al., NeurIPS 2025; seed 001): personalized momentum, momentum-guided single-backprop
SAM, and a cosine-adaptive momentum factor.

Server state: momentum :math:`m` (:math:`\mathrm{lr\_decay}\, \bar{G}` of the previous round, 0 at round 0), SCAFFOLD variates :math:`c`,
:math:`c_i` and the momentum factor :math:`a` (init 0.1).

- Personalized momentum (seed 001 eq. 1-2): :math:`m_i = m + (c - c_i)\, a / (1 - a)`.
- Momentum-guided perturbation (the authors' formula, README/poster C1: :math:`\delta = (x_r + b\, \Delta_r^{(k)}) - x_{b,k}`,
  :math:`g = \nabla L(x + \rho\, \delta / \lVert \delta \rVert)`; §4.1(b): the global model's position is inferred "by adding the momentum
  to the received model"): :math:`\hat{x}_k = w^t + k\, m_i`, :math:`d_k = \hat{x}_k - w_{i,k}`, :math:`\epsilon_k = \rho\, d_k / \lVert d_k \rVert`
  (:math:`\epsilon_0 = 0`); no extra backprop. Since :math:`m_i` is gradient-scale, :math:`\epsilon_k` points almost along :math:`+m_i`: the
  SAM ascent along the momentum's estimate of the global gradient.
- Local direction :math:`a\, g(w_{i,k} + \epsilon_k) + (1 - a)\, m_i` (:math:`= a (g + c - c_i) + (1 - a)\, m`).
- After the round: :math:`c_i`, :math:`c` as SCAFFOLD (from :math:`\Delta_i`, computed and kept by the server: no extra upload);
  :math:`s_i = \cos(\Delta_i, m) + 1` (the authors' code; eq. 3's formula is lost in our text, and this is the quantity
  that rises and settles as App. B describes), :math:`s_i = 0` where :math:`m` (round 0) or :math:`\Delta_i` is zero, as the
  code's ``cosine_similarity`` returns (``server/FedWMSAM.py:77-84``); :math:`a \leftarrow (1 - \tau)\, a + \tau\, \mathrm{clip}\big(\frac{1}{K} \sum_i s_i, a_{min}, a_{max}\big)` (eq. 3-4);
  FedAvg server, then :math:`m = \mathrm{lr\_decay}\, \bar{G}`: the code divides the round's average update
  by :math:`E \eta_l^t` and multiplies by ``lr_decay`` before the scheduler steps (``server/FedWMSAM.py:57``), where
  FL-Simulator's FedCM, dividing by the next round's rate, cancels the factor.

Ablations (seed 001 Table 5): ``personalized`` (off: :math:`m_i = m`), ``guided`` (off: :math:`\epsilon = 0`),
``adaptive`` (off: :math:`a` fixed). With all three off FedWMSAM is FedCM with :math:`a` = ``algo.a``.

Options kept from earlier readings (where the paper's text is silent the authors' code is the default):
``similarity_at_zero: 1`` gives round 0 the similarity :math:`0 + 1` (:math:`a` then moves to :math:`0.99\, a + 0.01\, a_{max}`
after round 0); ``momentum_lr_decay: false`` keeps :math:`m = \bar{G}`; ``target: descent`` is the first reconstruction's
trajectory :math:`\hat{x}_k = w^t - k\, \eta_l m_i` (the spec's; :math:`\epsilon` then has cos -0.40 with :math:`m_i` where the authors'
has +0.99); ``sign: code`` perturbs along :math:`-d_k`, as the public code's ``e_w = -g_update * scale`` does against its
own README; ``similarity: gradient`` uses :math:`\cos(G_i, m) = 1 - (\cos(\Delta_i, m) + 1)`, which falls over training.
Not reproduced: the public code, like the FedLESAM code, indexes the flat direction per tensor (one scalar shift per
tensor).

Cost (docs/benchmarks.md, "Every method at the cost of its backward passes"): on the CPU the perturbed point :math:`w_k + \epsilon_k` and the mix
:math:`a g + (1 - a) m_i` with its norm each run as one native kernel (fedflat/engine/native/vector_ops.cpp: a rounding
of its own, the same bits on every CPU, which ATen's AVX2 and AVX-512 kernels share; the torch expressions where no
compiler built it), and the round's ``[K, P]`` work goes by column blocks: the same bits either way.
"""
from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import Field, model_validator

from fedflat.algorithms.fedcm import DECAY_DESCRIPTION, MOMENTUM, DecayPlacement, mix_norm_torch, momentum_direction
from fedflat.algorithms.scaffold import (CLIENT_VARIATE, SERVER_VARIATE, column_blocks, scaffold_client_variate,
                                         scaffold_server_variate, variate_change)
from fedflat.core import (RHO_GRID, ClientContext, Cohort, Correction, Direction, MeasuredDirection, PartParams,
                          Perturbation, Recipe, RoundContext, Slot, init, normalize_rows_, register_recipe, row_norm)
from fedflat.core.vectors import NOT_RUN, kernel, run_kernel

FACTOR = "wmsam.a"  # ctx.server: the momentum factor a
PERSONAL_MOMENTUM = "wmsam.m_i"  # broadcast, per client: m_i
CLIENT_MOMENTUM = Slot("wmsam.m_i", "the momentum each client of the chunk mixes in, [C, P]: m_i (or m)")


def personalized_momentum(m: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Seed 001 eq. 1: ``m_i = m + (c - c_i) a / (1 - a)``, so that ``a g + (1 - a) m_i = a (g + c - c_i) + (1 - a) m``
    (one fresh ``[K, P]`` tensor, the difference, product and sum written into it block by block while the block is in
    cache, :func:`~fedflat.algorithms.scaffold.column_blocks`: the same roundings)."""
    factor, m_i = a / (1 - a), torch.empty(c_i.shape, dtype=torch.result_type(c, c_i), device=c_i.device)
    for b in column_blocks(m_i):
        torch.sub(c[..., b], c_i[:, b], out=m_i[:, b]).mul_(factor).add_(m[..., b])
    return m_i


def mean_pseudo_gradient(ctx: RoundContext) -> torch.Tensor:
    r""":math:`\bar{G} = \sum_i p_i G_i`, :math:`G_i = -\Delta_i / (E_i \eta_l^t)` (``ctx.aggregate(ctx.pseudo_gradients)``,
    with its refusal under a stateful local optimizer), block by block (:func:`~fedflat.algorithms.scaffold.column_blocks`:
    the same bits, no fresh ``[K, P]``)."""
    if not ctx.settings.optimizer.plain or ctx.deltas.device.type != "cpu":
        return ctx.aggregate(ctx.pseudo_gradients)
    deltas, weights = ctx.deltas, ctx.weights.to(ctx.deltas.dtype)
    divisor, gbar = ctx.steps.to(deltas.dtype)[:, None] * ctx.lr, torch.empty(deltas.shape[-1], dtype=deltas.dtype)
    for b in column_blocks(deltas):
        gbar[b] = weights @ torch.neg(deltas[:, b]).div_(divisor)
    return gbar


def guided_point(w_start: torch.Tensor, W: torch.Tensor, m_i: torch.Tensor, alpha: float, radius: float,
                 out: torch.Tensor) -> torch.Tensor:
    r"""The perturbed point :math:`w_k + \epsilon_k`, :math:`\epsilon_k = \mathrm{radius}\, d_k / (\lVert d_k \rVert + 10^{-12})`,
    :math:`d_k = (w^t - w_k) + \alpha\, m_i` (seed 001 §4.1(b), README C1; :math:`\alpha = k`), written into ``out``:
    the native kernel (two passes over the vector, its own rounding, the same bits on every CPU) where it is built
    and takes the operands (float32 CPU rows with unit last stride, ``W`` and ``out`` contiguous ``[C, P]``,
    ``w_start`` and ``m_i`` ``[P]`` or a row per client: it checks them before it writes), else
    :func:`guided_point_torch` (five ATen calls, ATen's rounding: the kernel's where :func:`rounds_as_kernels`)."""
    if run_kernel("guided_point", W.device, w_start, W, m_i, alpha, radius, out) is not NOT_RUN:
        return out
    return guided_point_torch(w_start, W, m_i, alpha, radius, out)


def guided_point_torch(w_start: torch.Tensor, W: torch.Tensor, m_i: torch.Tensor, alpha: float, radius: float,
                       out: torch.Tensor) -> torch.Tensor:
    """:func:`guided_point` as :meth:`MomentumGuidedPerturbation.perturb`'s torch operations and the local loop's sum,
    ``out`` holding ``d_k``, then ``eps_k``, then the point (the same roundings: each is elementwise)."""
    torch.sub(w_start, W, out=out).add_(m_i, alpha=alpha)
    return torch.add(W, normalize_rows_(out, radius), out=out)


def rounds_as_kernels() -> bool | None:
    """Whether ATen's kernels, in this process (its dispatch level, ``torch.backends.cpu.get_cpu_capability()``),
    round :func:`guided_point_torch` and :func:`mix_norm_torch` as the native kernels do, on :func:`probe_cases`
    (checked once a process; None where the kernels are not built). Where they do, a FedWMSAM run gives the same bits
    with and without the kernels (torch 2.13's AVX2 and AVX-512 levels); where they do not (its default level), the
    run's numbers are the kernels' wherever they are built."""
    if "aten" not in _probed:
        point, mix = kernel("guided_point"), kernel("mix_norm")
        _probed["aten"] = None if point is None or mix is None else _probe(point, mix)
    return _probed["aten"]


_probed: dict[str, bool | None] = {}


def _probe(point: Callable, mix: Callable) -> bool:
    for w_start, W, m_i, alpha, radius in probe_cases():
        out = torch.empty_like(W)
        point(w_start, W, m_i, alpha, radius, out)
        if not torch.equal(out, guided_point_torch(w_start, W, m_i, alpha, radius, torch.empty_like(W))):
            return False
        g = (W - w_start) * alpha
        for weight in (torch.tensor(0.9), torch.tensor(0.3), torch.tensor(0.5)):
            expected, mine = g.clone(), g.clone()
            if not (torch.equal(mix(mine, m_i, weight), mix_norm_torch(expected, m_i, weight))
                    and torch.equal(mine, expected)):
                return False
    return True


def probe_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]]:
    """Operands covering the kernels' paths: every remainder of a row's length modulo 16 around a few multiples,
    one and three clients, ``m_i`` per client, as an expanded row and as ``[P]``, integer and float ``alpha``, both
    signs of the radius, and a long row (W1's layer sizes)."""
    g = torch.Generator().manual_seed(57)
    cases = []
    for P in [*range(1, 50), 95, 1000, 4099, 156_800 + 200 + 13]:
        C = 3 if P % 2 else 1
        w_start = torch.randn(P, generator=g)
        W = w_start + 0.01 * torch.randn(C, P, generator=g)
        m = 0.001 * torch.randn(C, P, generator=g)
        ms = (m, m[:1].expand(C, -1), m[0])
        cases.append((w_start, W, ms[P % 3], P % 5 + 1, 0.05))
        cases.append((W.clone(), W.roll(1, -1).contiguous(), ms[(P + 1) % 3], -0.0123 * P, -0.02))
    return cases


def update_similarity(X: torch.Tensor, m: torch.Tensor, shifted: bool, at_zero: float) -> torch.Tensor:
    """``s_i = cos(X_i, m) (+ 1 when shifted)``, and ``at_zero`` where ``X_i`` or ``m`` is the zero vector (the
    authors' ``cosine_similarity``, ``server/FedWMSAM.py:77-84``, returns 0 there, before its ``+ 1``); each norm
    taken once (``X`` is the round's ``[K, P]``)."""
    x_norms, m_norm = row_norm(X).squeeze(-1), m.norm()
    s = (X @ m) / (x_norms * m_norm + 1e-12) + (1 if shifted else 0)
    return torch.where((x_norms > 0) & (m_norm > 0), s, torch.full_like(s, at_zero))


def adapt_factor(a: torch.Tensor, similarity: torch.Tensor, tau: float, a_min: float, a_max: float) -> torch.Tensor:
    r"""Seed 001 eq. 3-4: :math:`a \leftarrow (1 - \tau)\, a + \tau\, \mathrm{clip}\big(\frac{1}{K} \sum_i s_i, a_{min}, a_{max}\big)`."""
    return (1 - tau) * a + tau * similarity.mean().clamp(a_min, a_max)


class WMSAMParams(PartParams):
    a: float = Field(0.1, gt=0, lt=1, description="initial momentum factor (weight of the local gradient)")
    tau: float = Field(0.01, ge=0, le=1, description="adaptation speed of a")
    a_min: float = Field(0.1, gt=0, lt=1)
    a_max: float = Field(0.9, gt=0, lt=1)
    personalized: bool = Field(True, description="ablation: personalized momentum m_i (off: m_i = m)")
    adaptive: bool = Field(True, description="ablation: cosine-adaptive a (off: a fixed)")
    similarity: Literal["update", "gradient"] = Field(
        "update", description="update: cos(Delta_i, m) + 1 (the authors' code; rises); gradient: cos(G_i, m) (falls)")
    similarity_at_zero: float = Field(
        0.0, ge=0, le=2, description="s_i where m or Delta_i is zero (round 0): 0 as the authors' code returns; 1 is "
                                     "cos := 0 plus 1, fedflat's earlier rule")
    momentum_lr_decay: bool = Field(
        True, description="m = lr_decay Gbar as the authors' server stores it; false: m = Gbar (FedCM's)")
    decay: DecayPlacement = Field("outside", description=DECAY_DESCRIPTION)

    @model_validator(mode="after")
    def _bounds(self) -> "WMSAMParams":
        if self.a_min > self.a_max:
            raise ValueError(f"a_min ({self.a_min}) must not exceed a_max ({self.a_max})")
        return self


class WeightedMomentum(Correction):
    r""":math:`d = a\, g + (1 - a)\, m_i + \lambda_{wd} w` with FedWMSAM's personalized momentum and adaptive factor ``a``
    (weight decay unscaled, as in the authors' optimizer; ``decay = inside``: ``a (g + wd w) + (1 - a) m_i``).

    As seed 001 §4 describes the protocol, the server keeps the correctors: ``c`` and every client's
    ``c_i``, which it "computes based on the differences in gradients uploaded by clients" (SCAFFOLD's
    option-II update from ``Delta_i``, so the model is the only upload), and "broadcasts the global
    model, the personalized momentum, and the momentum factor": each client receives its own ``m_i``
    (2 model-sized vectors down, 1 up). ``m`` is kept under FedCM's name, so momentum-reading parts
    compose with it. With ``personalized`` off every client receives the shared ``m``.
    """

    name = "wmsam"
    summary = "FedWMSAM: a grad + (1 - a) m_i, m_i = m + (c - c_i) a/(1 - a) sent per client, cosine-adaptive a"
    Params = WMSAMParams
    server_state = {SERVER_VARIATE: init.zeros, MOMENTUM: init.zeros, FACTOR: init.scalar("a")}
    holds = (CLIENT_VARIATE,)
    individual = "computes each client's variate c_i from its own update and holds it per client"
    provides = frozenset({CLIENT_MOMENTUM})
    global_direction = (MOMENTUM, 1.0)

    def downlink(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        shared = {FACTOR: ctx.server[FACTOR]}
        if not self.p.personalized:
            shared[MOMENTUM] = ctx.server[MOMENTUM]
        return shared

    def personal(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """Seed 001 eq. 1: ``m_i = m + (c - c_i) a / (1 - a)`` for every sampled client."""
        if not self.p.personalized:
            return {}
        m = ctx.server[MOMENTUM].expand(ctx.K, -1)
        return {PERSONAL_MOMENTUM: personalized_momentum(m, ctx.server[SERVER_VARIATE], ctx.held[CLIENT_VARIATE],
                                                         ctx.server[FACTOR])}

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.shared.put(CLIENT_MOMENTUM, cohort.personal[PERSONAL_MOMENTUM] if self.p.personalized
                          else ctx.server[MOMENTUM].expand(cohort.size, -1))
        cohort.own(self)["complement"] = 1 - ctx.server[FACTOR]  # 1 - a made once per chunk, not at every step

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        """:func:`~fedflat.algorithms.fedcm.momentum_direction` with the chunk's ``1 - a`` (the same bits; the mix's
        norms from its pass where the native kernel runs)."""
        a = ctx.server[FACTOR]
        return momentum_direction(a, grad, cohort.shared[CLIENT_MOMENTUM], ctx.settings.weight_decay, self.p.decay,
                                  cohort.own(self)["complement"])  # (ctx's decay: AdamW's runs see 0, decoupled)

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        server = ctx.server
        c_i = ctx.held[CLIENT_VARIATE]
        c_plus = scaffold_client_variate(c_i, server[SERVER_VARIATE], ctx.w_start, ctx.w_final, ctx.steps, ctx.lr)
        ctx.held[CLIENT_VARIATE] = c_plus
        server[SERVER_VARIATE] = scaffold_server_variate(server[SERVER_VARIATE], variate_change(c_plus, c_i),
                                                         ctx.settings.num_clients)
        if self.p.adaptive:
            s = update_similarity(ctx.deltas if self.p.similarity == "update" else ctx.pseudo_gradients,
                                  server[MOMENTUM], self.p.similarity == "update", self.p.similarity_at_zero)
            ctx.log["wmsam_similarity"] = float(s.mean())
            server[FACTOR] = adapt_factor(server[FACTOR], s, self.p.tau, self.p.a_min, self.p.a_max)
        ctx.log["wmsam_a"] = float(server[FACTOR])
        gbar = mean_pseudo_gradient(ctx)
        server[MOMENTUM] = ctx.settings.lr_decay * gbar if self.p.momentum_lr_decay else gbar


class GuidedParams(PartParams):
    rho: float = Field(0.01, ge=0, description="perturbation radius")
    guided: bool = Field(True, description="ablation: momentum-guided SAM (off: eps = 0)")
    target: Literal["momentum", "descent"] = Field(
        "momentum", description="momentum: xhat_k = w^t + k m_i (the authors' formula); descent: w^t - k eta_l m_i")
    sign: Literal["paper", "code"] = Field("paper", description="code: perturb along -d_k as the public code does")


class MomentumGuidedPerturbation(Perturbation):
    r""":math:`\epsilon_k = \rho\, d_k / \lVert d_k \rVert`, :math:`d_k = (w_{start} + k\, m_i) - w_{i,k}` (seed 001 §4.1(b),
    README C1).

    ``m_i`` is the personalized momentum when the correction provides one (``wmsam``), otherwise
    the server momentum ``m`` (e.g. FedCM's ``momentum`` correction).
    """

    name = "wmsam"
    summary = "FedWMSAM: eps = rho d/||d||, d = (w^t + k m_i) - w_k, the inferred global trajectory (no extra backprop)"
    Params = GuidedParams
    requires = frozenset({MOMENTUM})
    fuses_point = True  # perturbed_point: the native kernel's two passes (perturb and the sum's bits on AVX2/AVX-512)

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if not self.p.guided or self.p.rho == 0 or k == 0:
            return None
        buffer = cohort.own(self).get("d")  # d_k written into one buffer per chunk, not a fresh [C, P] a step
        if buffer is None or buffer.shape != W.shape:
            buffer = cohort.own(self)["d"] = torch.empty_like(W)
        m_i, alpha, radius = self._operands(ctx, cohort, k)
        return normalize_rows_(torch.sub(ctx.w_start, W, out=buffer).add_(m_i, alpha=alpha), radius)

    def perturbed_point(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch,
                        out: torch.Tensor) -> torch.Tensor | None:
        """``W + eps`` into ``out`` by :func:`guided_point` (two passes over the vector where the native kernel is
        built, :meth:`perturb`'s operations and the sum otherwise: the same bits where :func:`rounds_as_kernels`)."""
        if not self.p.guided or self.p.rho == 0 or k == 0:
            return None
        return guided_point(ctx.w_start, W, *self._operands(ctx, cohort, k), out)

    def _operands(self, ctx: ClientContext, cohort: Cohort, k: int) -> tuple[torch.Tensor, float, float]:
        """``m_i`` (``m`` without a personalized one), ``alpha`` (``k``; ``-k eta_l`` for ``target: descent``) and the
        signed radius."""
        m_i = cohort.shared.get(CLIENT_MOMENTUM)
        return (ctx.server[MOMENTUM] if m_i is None else m_i, k if self.p.target == "momentum" else -k * ctx.lr,
                -self.p.rho if self.p.sign == "code" else self.p.rho)


register_recipe(Recipe(
    name="fedwmsam", display="FedWMSAM",
    summary="personalized momentum + momentum-guided single-backprop SAM + cosine-adaptive a",
    source="Li et al., NeurIPS 2025 (seed 001)",
    perturbation="wmsam", correction="wmsam", defaults={"rho": 0.01, "a": 0.1},
    tunable={"algo.rho": RHO_GRID}))
