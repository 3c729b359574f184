"""Gradient backends (fedflat/engine/gradients/): one chosen per run from its compute options and the model's traits,
any objective's gradient the general backend's, and the objectives composing (FedMAN's penalty around a
distillation term) as their sum would."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import BN_DROPOUT_CNN
from fedflat.core import Batch, Distillation
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.gradients import (HandMLP, Lanes, Penalized, PerClient, PerExampleDP, StatefulGroups,
                                      StatefulPerClient, Vectorized)
from fedflat.engine.client import Oracle, objective_of
from fedflat.engine.simulation import Simulation
from fedflat.models.mlp import mlp
from fedflat.params import FlatModel


@pytest.mark.parametrize("overrides,backend,general", [
    (("engine=sequential",), HandMLP, PerClient),  # fedflat's MLP, float32, cross-entropy, CPU
    (("engine=sequential", "train.label_smoothing=0.1"), PerClient, PerClient),  # a loss of its own: autograd
    (("engine=sequential", "precision=bf16"), PerClient, PerClient),
    (("engine=vectorized",), Vectorized, Vectorized),
    (("engine=streams",), Lanes, PerClient),  # (off CUDA the lanes run one after another)
    (("engine=sequential", *BN_DROPOUT_CNN), StatefulPerClient, StatefulPerClient),
    (("engine=vectorized", *BN_DROPOUT_CNN), StatefulGroups, StatefulGroups),
    (("engine=sequential", "privacy.level=instance", "privacy.noise_multiplier=1.0", "privacy.clip=1.0"),
     PerExampleDP, PerClient),  # (DP-SGD's per-example gradient first, even for the MLP)
])
def test_the_runs_backend_is_chosen_once_from_its_options_and_traits(tiny, overrides, backend, general):
    oracle = Simulation(tiny("device=cpu", *overrides)).oracle
    assert type(oracle.backend) is backend and type(oracle.backend.general) is general


def test_cuda_graphs_off_a_gpu_are_refused_when_the_backend_is_chosen():
    model = FlatModel(mlp((1, 4, 4), 3, (8,)))
    with pytest.raises(ValueError, match="cuda_graphs=true records CUDA graphs and needs a CUDA device"):
        Oracle(model, ComputeOptions(cuda_graphs=True))


def _cohort(seed: int = 0):
    torch.manual_seed(seed)
    model = FlatModel(mlp((1, 4, 4), 3, (8,)))
    W = model.initial + 0.1 * torch.randn(2, model.layout.size)
    batch = Batch(torch.randn(2, 6, 1, 4, 4), torch.randint(0, 3, (2, 6)))
    term = Distillation(model.initial + 0.1 * torch.randn(model.layout.size), weight=0.7, temperature=2.0)
    return model, W, batch, term


@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_a_term_on_the_hand_derived_backend_is_its_general_backends(penalty):
    """The accelerated backend computes the data loss alone: a distillation term (with or without FedMAN's
    penalty) is the autograd backend's, bit for bit, and so is the data loss (the hand-derived gradient equals
    autograd's)."""
    model, W, batch, term = _cohort()
    hand = Oracle(model)
    assert isinstance(hand.backend, HandMLP)
    general = hand.backend.general
    for distill in (None, term):
        objective = objective_of(distill, penalty)
        got, want = hand.backend.loss_grad(W, batch, objective), general.loss_grad(W, batch, objective)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_the_penalty_around_a_distillation_term_is_their_sum(engine):
    """``Penalized(Distilled)`` is the gradient of ``CE + gamma tau^2 KL + mu/2 mean_b mean_f a^2``, the MLP's hidden
    activation ``a = relu(x W_1^T + b_1)`` written out here; the reported loss is CE. (float32 sums in another order:
    torch.testing's float32 tolerances.)"""
    model, W, batch, term = _cohort(1)
    mu = 0.5
    objective = objective_of(term, mu)
    assert isinstance(objective, Penalized)
    loss, grad = Oracle(model, ComputeOptions(engine=engine)).loss_grad(W, batch, term, mu)
    for c in range(2):
        w = W[c].clone().requires_grad_(True)
        W1, b1, W2, b2 = model.layout.views(w)
        x, y = batch.x[c].flatten(1), batch.y[c]
        a = torch.relu(x @ W1.T + b1)
        logits = a @ W2.T + b2
        with torch.no_grad():
            teacher = F.log_softmax(model(term.teacher, batch.x[c]) / term.temperature, dim=-1)
        ce = F.cross_entropy(logits, y)
        kl = F.kl_div(F.log_softmax(logits / term.temperature, dim=-1), teacher, reduction="batchmean",
                      log_target=True)
        total = ce + term.weight * term.temperature ** 2 * kl + mu / 2 * a.pow(2).mean()
        (g,) = torch.autograd.grad(total, w)
        torch.testing.assert_close(loss[c], ce.detach())
        torch.testing.assert_close(grad[c], g)


def test_moons_term_beside_the_penalty_is_refused():
    from fedflat.core import Contrast

    model, W, _, _ = _cohort()
    term = Contrast(model.initial, W, torch.ones(2), weight=1.0, temperature=0.5)
    with pytest.raises(ValueError, match="FedMAN's activation penalty beside MOON's contrastive term"):
        objective_of(term, 0.1)
