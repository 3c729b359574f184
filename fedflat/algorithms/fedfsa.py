r"""FedFSA (Xing, Zhan, Xie, Yang, Wang and Liu, *Flexible Sharpness-Aware Personalized Federated Learning*, AAAI 2025;
code github.com/xxdznl/FedFSA): SAM with a larger radius on the layers whose weights a client's last local training
changed most, on MoFedSAM's momentum-corrected local steps.

Each client keeps the layers it perturbs more (``fsa.larger``, a mask over the parameter vector: the entries of its
top-:math:`C` tensors, none before its first round). A step perturbs tensor :math:`l` by its own radius with one norm over
all parameters, :math:`\epsilon_l = \rho_l g_l / \lVert g \rVert`, :math:`\rho_l = \rho_{larger}` on those tensors and :math:`\rho` elsewhere (the
code's ``FSA.first_step``), and descends along :math:`a\, g(w + \epsilon) + (1 - a)\, m` (MoFedSAM's correction ``momentum``). After
the round, each weight tensor's *perturbation sensitivity* (:math:`J_l` entries)

.. math::

    s_l = \frac{1}{J_l} \sum_{j=1}^{J_l} \big(\mathrm{mm}(w_{l,E})_j - \mathrm{mm}(w_{l,0})_j\big)^2,

    \mathrm{mm}(v) = \frac{v - \min v}{\max v - \min v}

(:math:`s_l = 0` for tensors named ``bn``, ``downsample``, ``shortcut``, ``norm`` or ``bias``), min-max normalized over
the layers, ranks the tensors; the top :math:`C` become the next round's (``FSA.nextDisruptLayer``).

The code's personalization is its evaluation: each client's own model after its local training, clients syncing to
the global model every round (``--sync``), and in the last round every client fine-tunes its head. fedflat evaluates
the global model; FedFSA's selection and step are its own either way (``algo.personalization=fedper`` keeps the head
on each client and evaluates the clients' models).
"""
from __future__ import annotations

import math

import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM, SAMParams
from fedflat.core import ClientContext, Cohort, Recipe, register_recipe

LARGER = "fsa.larger"  # client state: 1 on the entries of the tensors perturbed with rho_larger, else 0
SKIPPED = ("bn", "downsample", "shortcut", "norm", "bias")  # tensors whose sensitivity is 0 (the code's keywords)


class FlexibleSAMParams(SAMParams):
    rho: float = Field(0.05, ge=0, description="the default radius (the code's --rho_default; its FedFSA runs 0.05)")
    rho_larger: float = Field(0.9, ge=0, description="the radius of the top-C sensitive tensors (--rho_larger 0.9)")
    top: int = Field(2, ge=0, description="C: how many tensors get the larger radius (--TopC 2)")


def min_max(v: torch.Tensor) -> torch.Tensor:
    r""":math:`(v - \min v) / (\max v - \min v)` (NaN where :math:`v` is constant, as the code's)."""
    return (v - v.min()) / (v.max() - v.min())


def sensitive_tensors(names, after: list[torch.Tensor], before: list[torch.Tensor], top: int) -> list[int]:
    """The indices of the ``top`` tensors of highest normalized perturbation sensitivity (``FSA.nextDisruptLayer``:
    ties in tensor order, NaN last)."""
    sensitivity = torch.tensor([0.0 if any(key in name.lower() for key in SKIPPED)
                                else float(((min_max(a) - min_max(b)) ** 2).mean())
                                for name, a, b in zip(names, after, before)])
    normalized = min_max(sensitivity).tolist()
    ranked = sorted(enumerate(normalized), key=lambda x: x[1] if not math.isnan(x[1]) else float("-inf"), reverse=True)
    return [index for index, _ in ranked[:top]]


class FlexibleSAM(LocalSAM):
    r""":math:`\epsilon_l = \rho_l g_l / \lVert g \rVert` with :math:`\rho_{larger}` on the client's kept tensors (module docstring)."""

    name = "fsa"
    summary = "FedFSA: SAM with rho_larger on each client's top-C most sensitive layers of its last round"
    Params = FlexibleSAMParams
    keeps = (LARGER,)

    def radius(self, ctx: ClientContext, cohort: Cohort) -> torch.Tensor:
        mask = cohort.state[LARGER]
        return self.p.rho + (self.p.rho_larger - self.p.rho) * mask

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        layout = ctx.settings.layout
        start = ctx.w_start.expand_as(W)
        rows = []
        for c in range(cohort.size):
            after, before = layout.segments(W[c]), layout.segments(start[c])
            chosen = set(sensitive_tensors(layout.names, after, before, self.p.top))
            rows.append(torch.cat([torch.full_like(seg, float(j in chosen)) for j, seg in enumerate(after)]))
        cohort.new_state[LARGER] = torch.stack(rows)


register_recipe(Recipe(
    name="fedfsa", display="FedFSA", summary="FedFSA: MoFedSAM with a larger radius on each client's most sensitive layers",
    source="Xing et al., AAAI 2025 (github.com/xxdznl/FedFSA)", perturbation="fsa", correction="momentum",
    defaults={"rho": 0.05, "rho_larger": 0.9, "top": 2, "a": 0.1},
    tunable={"algo.rho_larger": (0.1, 0.5, 0.9), "algo.rho": (0.01, 0.05, 0.1)}))
