r"""FedMAN (Yashwanth, Nayak, Rangwani, Singh, Babu and Chakraborty, *Minimizing Layerwise Activation Norm Improves
Generalization in Federated Learning*, WACV 2024, arXiv 2512.08314; code github.com/vcl-iisc/fedMAN): a flatness
regularizer on any method's local objective, the mean squared activation of every hidden layer,

.. math::

    f_i(w) + \frac{\mu}{2} \sum_l \frac{1}{\lvert B \rvert} \sum_{x \in B} \frac{1}{J_l} \sum_{j=1}^{J_l} a_{l,j}(w, x)^2

(:math:`a_l` the output of layer :math:`l`'s nonlinearity, :math:`J_l` entries), whose minimization bounds the top eigenvalue of the loss's
Hessian. fedflat reads :math:`a_l` with forward hooks on the model's activation modules (``nn.ReLU``, ``nn.Tanh``, ...:
:data:`fedflat.engine.gradients.ACTIVATIONS`), so it needs no change to the model, where the authors' models return
their activations from ``forward`` (``code/utils_models.py``: ``act = mean(x**2)`` after each hidden ReLU, the
logits excluded). The penalty enters every gradient of the round's local objective: under SAM both the ascent and
the perturbed gradient, as the authors' ``man_code_sam`` does.

It is a filter part (``man``) that filters nothing and declares the penalty, so that it stacks on any method whose
filter is ``none`` (all but FedFFT): ``algo=fedsam algo.filter=man algo.mu=0.2``; ``mu = 0`` is the base method.
"""
from __future__ import annotations

from pydantic import Field

from fedflat.core import ClientContext, Filter, PartParams, Recipe, register_recipe


class ActivationNormParams(PartParams):
    mu: float = Field(0.2, ge=0, description="the penalty's weight mu (the authors' run_exp.sh: reg_val 0.2)")


class ActivationNorm(Filter):
    r"""FedMAN's penalty :math:`\frac{\mu}{2} \sum_l \mathrm{mean}\, a_l^2` on the local objective (module docstring); filters nothing."""

    name = "man"
    summary = "FedMAN: adds mu/2 sum_l mean |a_l|^2 (layerwise activation norms) to the local objective"
    Params = ActivationNormParams
    penalizes_activations = True
    beyond_batch = ("its activation penalty enters the gradients outside DP-SGD's per-example computation, which "
                    "would leave it unclipped")

    def activation_penalty(self, ctx: ClientContext) -> float:
        return self.p.mu


SOURCE = "Yashwanth et al., WACV 2024 (arXiv 2512.08314; github.com/vcl-iisc/fedMAN)"
register_recipe(Recipe(name="fedavg-man", display="FedAvg+MAN", summary="FedAvg with FedMAN's layerwise activation-norm penalty",
                       source=SOURCE, filter="man", tunable={"algo.mu": (0.05, 0.1, 0.2, 0.5)}))
register_recipe(Recipe(name="fedsam-man", display="FedSAM+MAN", summary="FedSAM with FedMAN's layerwise activation-norm penalty",
                       source=SOURCE, perturbation="sam", filter="man", defaults={"rho": 0.01},
                       tunable={"algo.mu": (0.05, 0.1, 0.2, 0.5), "algo.rho": (0.01, 0.05, 0.1)}))
