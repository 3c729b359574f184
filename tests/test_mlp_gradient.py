"""The hand-derived gradient of fedflat's MLP and LogReg (:mod:`fedflat.engine.gradients.hand`) is autograd's bit for
bit, whole runs with it equal runs without it, and every other module keeps autograd."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedflat
from fedflat.core import Batch
from fedflat.engine.gradients.hand import ALIGNMENT, MLPGradient
from fedflat.engine.modes import ModelTraits
from fedflat.engine.client import Oracle
from fedflat.engine.simulation import Simulation
from fedflat.models.mlp import MLP, LogReg, logreg, mlp
from fedflat.params import FlatModel
from fedflat.testing import TINY
from tests.test_native import require_native

# (input shape, hidden widths (None: LogReg), batch): W1's MLP with its full and a short last batch, one and three
# hidden layers of odd widths (slices of g at offsets no multiple of a vector's width), a batch of one, LogReg
SHAPES = [((1, 28, 28), (200, 200), 50), ((1, 28, 28), (200, 200), 13), ((1, 4, 4), (8,), 7),
          ((3, 8, 8), (33, 17, 5), 21), ((64,), (100,), 1), ((1, 28, 28), None, 50), ((10,), None, 6)]


def autograd_oracle(model: FlatModel) -> Oracle:
    """The sequential oracle with the hand-derived gradient off: autograd through the module's own forward."""
    oracle = Oracle(model, traits=ModelTraits(hand_gradient=False))
    assert oracle.gradient == "autograd"
    return oracle


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("shape,hidden,B", SHAPES)
def test_gradient_is_autograds_bit_for_bit(shape, hidden, B, path):
    """Loss and every entry of ``g[P]`` equal autograd's (``torch.equal``) at several points, with labels of every
    class, by the native operator (tests/test_native.py) and by the Python method."""
    torch.manual_seed(0)
    model = FlatModel(logreg(shape, 10) if hidden is None else mlp(shape, 10, hidden))
    assert_autograds(model, MLPGradient.of(model), path, (B, *shape), 10, scale=0.1)


def assert_autograds(model: FlatModel, hand, path: str, shape: tuple[int, ...], classes: int, scale: float) -> None:
    """``hand``'s loss and gradient (a hand-derived gradient of ``model``) equal autograd's (``torch.equal``) at three
    points ``w0 + scale N(0, 1)`` on batches ``x[shape]`` of labels of every class, by its native operator
    (``path="native"``) or its Python method."""
    reference = autograd_oracle(model)
    assert hand is not None
    if path == "native":
        require_native(hand)
    else:
        hand.native = None
    for _ in range(3):
        w = model.initial + scale * torch.randn_like(model.initial)
        x, y = torch.randn(*shape), torch.randint(0, classes, shape[:1])
        assert hand.takes(w, x, y)
        loss, g = hand.loss_grad(w, x, y)
        want_loss, want_g = reference.loss_grad(w[None], Batch(x[None], y[None]))
        assert torch.equal(loss, want_loss[0]) and torch.equal(g, want_g[0])


def test_a_cohort_with_padded_rows_is_autograds():
    """The oracle's cohort path (several rows, a padded batch: each row's real samples) equals autograd's, loss and
    gradient, and does not count backprops differently."""
    torch.manual_seed(2)
    model = FlatModel(mlp((1, 4, 4), 3, (8,)))
    hand, reference = Oracle(model), autograd_oracle(model)
    assert hand.gradient != "autograd"
    W = model.initial + 0.1 * torch.randn(3, model.initial.numel())
    weight = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] * 6])
    batch = Batch(torch.randn(3, 6, 1, 4, 4), torch.randint(0, 3, (3, 6)), weight, clients=3)
    (loss, g), (want_loss, want_g) = hand.loss_grad(W, batch), reference.loss_grad(W, batch)
    assert torch.equal(loss, want_loss) and torch.equal(g, want_g) and hand.backprops == reference.backprops == 3


def test_shapes_hold_a_misaligned_weight():
    """Among SHAPES a weight's slice of ``g`` starts off the 64-byte alignment of a fresh tensor (written through the
    aligned scratch matrix) and others on it (written in place)."""
    model = FlatModel(mlp((3, 8, 8), 10, (33, 17, 5)))
    starts = [s.weight * 4 % ALIGNMENT for s in MLPGradient.of(model).slots]
    assert 0 in starts and any(starts)


def test_logreg_gradient_is_the_softmax_residual():
    """LogReg's equation computed by hand in float64: ``dl/dW = (softmax(z) - onehot(y))^T x / B``,
    ``dl/db = sum_j (softmax(z_j) - onehot(y_j)) / B``, to float32 rounding of a few operations on O(1) values."""
    torch.manual_seed(1)
    model = FlatModel(logreg((5,), 3))
    x, y = torch.randn(4, 5), torch.tensor([0, 2, 1, 2])
    loss, g = MLPGradient.of(model).loss_grad(model.initial, x, y)
    W, b = (v.double() for v in model.layout.views(model.initial))
    z = x.double() @ W.T + b
    residual = (z.softmax(1) - F.one_hot(y, 3).double()) / 4
    want = torch.cat([(residual.T @ x.double()).flatten(), residual.sum(0)])
    torch.testing.assert_close(g.double(), want, rtol=0, atol=64 * 2.0 ** -24)
    torch.testing.assert_close(loss.double(), F.cross_entropy(z, y), rtol=0, atol=64 * 2.0 ** -24)


@pytest.mark.parametrize("algo", ["fedavg", "fedsam"])
def test_runs_with_and_without_it_agree(monkeypatch, algo):
    """Whole FedAvg and FedSAM runs on the tiny problem (clients of unequal step counts, weight decay and the clip)
    end with the same parameters bit for bit with the gradient by hand and with it forced off; the first run did
    take it. (On the CPU: its only device.)"""
    tree = {**TINY, "rounds": 2, "algo": {"name": algo}, "device": "cpu"}
    taken = []
    real = MLPGradient.loss_grad
    monkeypatch.setattr(MLPGradient, "loss_grad", lambda self, *a: taken.append(1) or real(self, *a))
    fast = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert taken
    monkeypatch.setattr(MLPGradient, "of", classmethod(lambda cls, model: None))
    taken.clear()
    plain = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert not taken
    assert torch.equal(fast, plain)


def test_decided_once_per_model(tiny):
    """The model's report records it: on for fedflat's MLP and LogReg (and its CNN, tests/test_cnn_gradient.py), off
    for a ResNet; the sequential oracle takes it only with plain cross-entropy in float32 on the CPU, the vectorized
    one never."""
    tiny = partial(tiny, "device=cpu")
    assert Simulation(tiny("engine=sequential")).report.traits.hand_gradient
    assert Simulation(tiny("engine=sequential")).oracle.gradient != "autograd"
    assert Simulation(tiny("engine=sequential", "model=logreg")).oracle.gradient != "autograd"
    assert Simulation(tiny("engine=vectorized")).oracle.gradient == "autograd"
    assert Simulation(tiny("engine=sequential", "train.label_smoothing=0.1")).oracle.gradient == "autograd"
    resnet = Simulation(tiny("engine=sequential", "model=resnet20", "data.options.shape=[3,8,8]"))
    assert not resnet.report.traits.hand_gradient and resnet.oracle.gradient == "autograd"


class ScaledMLP(MLP):
    """A user's subclass whose forward differs from the MLP's: its logits halved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / 2


class SameMLP(MLP):
    """A user's subclass that changes nothing visible (it might in a method the check cannot see)."""


def _hooked() -> MLP:
    module = mlp((1, 4, 4), 3, (8,))
    module.body[1].register_forward_hook(lambda m, inputs, out: out * 2)
    return module


def _patched() -> MLP:
    module = mlp((1, 4, 4), 3, (8,))
    module.forward = lambda x: module.head(module.features(x)) * 3
    return module


@pytest.mark.parametrize("build", [
    lambda: ScaledMLP((1, 4, 4), 3, (8,)), lambda: SameMLP((1, 4, 4), 3, (8,)), _hooked, _patched,
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)),
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 3)),
])
def test_other_modules_keep_autograd(build):
    """A subclass (overriding forward or not), a hook, a patched forward, the same layers in an ``nn.Sequential``:
    autograd, and the gradient is that of the module's own forward."""
    torch.manual_seed(0)
    module = build()
    model = FlatModel(module)
    assert MLPGradient.of(model) is None
    oracle = Oracle(model)
    assert not oracle.traits.hand_gradient and oracle.gradient == "autograd"
    assert Oracle(model, traits=ModelTraits(hand_gradient=True)).gradient == "autograd"  # (a worker checks its own module)
    x, y = torch.randn(5, 1, 4, 4), torch.tensor([0, 1, 2, 1, 0])
    _, g = oracle.loss_grad(model.initial[None], Batch(x[None], y[None]))
    leaf = model.initial.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.cross_entropy(model(leaf, x), y), leaf)
    assert torch.equal(g[0], want)


def test_a_subclass_trains_on_its_own_forward():
    """A whole run with a user's subclass that halves the logits ends elsewhere than the same run with fedflat's MLP
    (its forward is what trains), and is not taken by the hand-derived gradient."""
    tree = {**TINY, "rounds": 1}
    built = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False).final_parameters
    ours = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False,
                       model_fn=lambda: ScaledMLP((1, 4, 4), 3, (8,))).final_parameters
    assert not torch.equal(built, ours)


def test_inputs_it_does_not_take_go_to_autograd():
    """float64 inputs (the module's addmm refuses them as autograd's path does) and int32 labels are not taken."""
    model = FlatModel(mlp((4,), 3, (5,)))
    hand = MLPGradient.of(model)
    w, x, y = model.initial, torch.randn(2, 4), torch.tensor([0, 1])
    assert hand.takes(w, x, y)
    assert not hand.takes(w, x.double(), y) and not hand.takes(w, x, y.int()) and not hand.takes(w[:-1], x, y)
    assert isinstance(model.module, MLP) and not isinstance(model.module, LogReg)
