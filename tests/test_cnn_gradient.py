"""The hand-derived gradient of fedflat's CNN (:mod:`fedflat.engine.gradients.convnet`) is autograd's bit for bit, by
the native pooling kernels and by ATen's channels-last pooling; whole runs with it equal runs without it, and every
other module or option keeps autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedflat
from fedflat.core import Batch
from fedflat.engine import native
from fedflat.engine.client import Oracle
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.gradients import HandCNN
from fedflat.engine.gradients.convnet import CNNGradient
from fedflat.engine.modes import ModelTraits
from fedflat.models.cnn import CNN, cnn
from fedflat.params import FlatModel
from fedflat.testing import TINY
from tests.test_mlp_gradient import assert_autograds, autograd_oracle
from tests.test_native import require_native

aten = torch.ops.aten
POOL = ([2, 2], [2, 2], [0, 0], [1, 1], False)

# (input shape, padding, batch): W2's CIFAR shape with a full and a short batch and a batch of one, Fashion-MNIST's,
# the hash runs' 8x8 with padding 2, and odd sizes (15 + 2 - 4 = 13: a last row and column in no window; 5x5 maps
# after the second stage leave a window block of 2 that the kernels finish from padded copies)
SHAPES = [((3, 32, 32), 0, 10), ((3, 32, 32), 0, 3), ((3, 32, 32), 0, 1), ((1, 28, 28), 0, 7),
          ((1, 8, 8), 2, 10), ((2, 15, 15), 1, 4)]


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("shape,padding,B", SHAPES)
def test_gradient_is_autograds_bit_for_bit(shape, padding, B, path):
    """Loss and every entry of ``g[P]`` equal autograd's (``torch.equal``) at several points."""
    torch.manual_seed(0)
    model = FlatModel(cnn(shape, 7, padding=padding))
    assert_autograds(model, CNNGradient.of(model), path, (B, *shape), 7, scale=0.05)


def _aten_relu_pool(z: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What autograd runs for ``maxpool2(relu(z))`` and its backward, on ATen's NCHW kernels."""
    r = torch.relu(z)
    p, indices = aten.max_pool2d_with_indices(r, *POOL)
    return p, aten.threshold_backward(aten.max_pool2d_with_indices_backward(g, r, *POOL, indices), r, 0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,W", [(2, 2), (3, 5), (4, 9), (6, 16), (5, 17), (28, 28)])
def test_kernels_match_aten_on_ties_zeros_and_nans(H, W, dtype):
    """Every bit of the pooled values and of the input gradient (the signs of zeros and NaNs included) is ATen's:
    windows of equal maxima (the first wins), of zeros and -0 (no gradient), of negatives only, with one or two NaNs
    (ATen keeps the last), a -0 gradient (ATen's zero fill makes it +0), every window width's remainder; in float32
    and in bfloat16."""
    require_native(CNNGradient.of(FlatModel(cnn((1, 8, 8), 3, padding=2))))
    relu_max_pool2, max_pool2_backward = native.operator("relu_max_pool2"), native.operator("max_pool2_backward")
    torch.manual_seed(H * 100 + W)
    choices = torch.tensor([1.5, 1.5, 0.0, -0.0, -2.0, 3.0, float("nan"), 0.25])
    z = choices[torch.randint(0, len(choices), (3, 2, H, W))]
    z[0] = torch.randn(2, H, W)
    g = torch.randn(3, 2, H // 2, W // 2)
    g[1, 0] = -0.0
    z, g = z.to(dtype), g.to(dtype)
    p, code = relu_max_pool2(z)
    want_p, want_dz = _aten_relu_pool(z, g)
    assert _same_bits(p, want_p)
    assert _same_bits(max_pool2_backward(g, code, H, W), want_dz)


def test_kernels_refuse_what_they_do_not_compute():
    """A float64 or non-contiguous input is a clear error, not a wrong answer."""
    require_native(CNNGradient.of(FlatModel(cnn((1, 8, 8), 3, padding=2))))
    relu_max_pool2 = native.operator("relu_max_pool2")
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        relu_max_pool2(torch.randn(1, 2, 4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        relu_max_pool2(torch.randn(1, 4, 4, 2).permute(0, 3, 1, 2))


def test_a_cohort_with_padded_rows_is_autograds():
    """The oracle's cohort path (several rows, a padded batch: each row's real samples) equals autograd's."""
    torch.manual_seed(2)
    model = FlatModel(cnn((1, 8, 8), 3, padding=2))
    hand, reference = Oracle(model), autograd_oracle(model)
    assert isinstance(hand.backend, HandCNN)
    W = model.initial + 0.1 * torch.randn(3, model.initial.numel())
    weight = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] * 6])
    batch = Batch(torch.randn(3, 6, 1, 8, 8), torch.randint(0, 3, (3, 6)), weight, clients=3)
    (loss, g), (want_loss, want_g) = hand.loss_grad(W, batch), reference.loss_grad(W, batch)
    assert torch.equal(loss, want_loss) and torch.equal(g, want_g) and hand.backprops == reference.backprops == 3


CNN_TREE = {**TINY, "rounds": 2, "device": "cpu", "model": {"name": "cnn", "padding": 2},
            "data": {**TINY["data"], "options": {**TINY["data"]["options"], "shape": [1, 8, 8]}}}


@pytest.mark.parametrize("algo", ["fedavg", "fedsam"])
def test_runs_with_and_without_it_agree(monkeypatch, algo):
    """Whole FedAvg and FedSAM runs of the CNN (weight decay, the clip, SAM's perturbed point) end with the same
    parameters bit for bit with the gradient by hand and with it forced off; the first run did take it."""
    tree = {**CNN_TREE, "algo": {"name": algo}}
    taken = []
    real = CNNGradient.loss_grad
    monkeypatch.setattr(CNNGradient, "loss_grad", lambda self, *a: taken.append(1) or real(self, *a))
    fast = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert taken
    monkeypatch.setattr(CNNGradient, "of", classmethod(lambda cls, model, dtype=None: None))
    taken.clear()
    plain = fedflat.run(tree, overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert not taken
    assert torch.equal(fast, plain)


class SameCNN(CNN):
    """A user's subclass that changes nothing visible."""


def _hooked() -> CNN:
    module = cnn((1, 8, 8), 3, padding=2)
    module.conv[1].register_forward_hook(lambda m, inputs, out: out * 2)
    return module


def _strided() -> CNN:
    module = cnn((1, 8, 8), 3, padding=2)
    module.conv[2] = nn.MaxPool2d(2, stride=1)
    return module


@pytest.mark.parametrize("build", [
    lambda: cnn((1, 8, 8), 3, padding=2, norm="group"), lambda: cnn((1, 8, 8), 3, padding=2, dropout=0.5),
    lambda: SameCNN((1, 8, 8), 3, padding=2), _hooked, _strided,
])
def test_other_modules_keep_autograd(build):
    """GroupNorm or dropout variants, a subclass, a hook, another pooling: autograd."""
    assert CNNGradient.of(FlatModel(build())) is None


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("shape,padding,B", SHAPES[:2] + SHAPES[4:])
def test_bf16_gradient_is_autocasts_bit_for_bit(shape, padding, B, path):
    """Under ``precision: bf16`` the gradient is autograd's of the pass under ``torch.autocast(bfloat16)``, bit for
    bit: every operand cast as autocast casts it, the layers in bfloat16, the loss in float32, the gradients cast
    back. (Its distance from float32's is bfloat16's rounding: tests/test_engines.py, docs/benchmarks.md.)"""
    torch.manual_seed(1)
    model = FlatModel(cnn(shape, 7, padding=padding))
    bf16 = ComputeOptions(precision="bf16")
    hand, reference = Oracle(model, bf16), Oracle(model, bf16, traits=ModelTraits(hand_gradient=False))
    assert isinstance(hand.backend, HandCNN) and hand.backend.hand.dtype == torch.bfloat16
    if path == "python":
        hand.backend.hand.native = None
    else:
        require_native(hand.backend.hand)
    assert reference.gradient == "autograd"
    for _ in range(2):
        W = (model.initial + 0.05 * torch.randn_like(model.initial))[None]
        batch = Batch(torch.randn(1, B, *shape), torch.randint(0, 7, (1, B)))
        (loss, g), (want_loss, want_g) = hand.loss_grad(W, batch), reference.loss_grad(W, batch)
        assert torch.equal(loss, want_loss) and torch.equal(g, want_g)


@pytest.mark.parametrize("option", [{"channels_last": True}, {"engine": "vectorized"}])
def test_options_that_change_the_pass_keep_autograd(option):
    """Channels-last order and the vectorized engine compute another pass: not the hand gradient."""
    model = FlatModel(cnn((3, 32, 32), 10))
    oracle = Oracle(model, ComputeOptions(**option))
    assert oracle.traits.hand_gradient and oracle.gradient == "autograd"
    assert Oracle(model).gradient in ("native", "python")


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # (mkldnn.flags sets its TF32 flag too)
def test_inputs_it_does_not_take_go_to_autograd():
    """float64 images, int32 labels and a vector of the wrong size are not taken; oneDNN's absence neither."""
    model = FlatModel(cnn((1, 8, 8), 3, padding=2))
    hand = CNNGradient.of(model)
    w, x, y = model.initial, torch.randn(2, 1, 8, 8), torch.tensor([0, 1])
    assert hand.takes(w, x, y)
    assert not hand.takes(w, x.double(), y) and not hand.takes(w, x, y.int()) and not hand.takes(w[:-1], x, y)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not hand.takes(w, x, y)


def test_the_loss_is_the_cross_entropy_of_the_modules_logits():
    """The reported loss is ``F.cross_entropy`` of the module's own forward at ``w`` (to float32 rounding of the same
    operations: equal)."""
    torch.manual_seed(3)
    model = FlatModel(cnn((3, 32, 32), 10))
    w = model.initial + 0.05 * torch.randn_like(model.initial)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    loss, _ = CNNGradient.of(model).loss_grad(w, x, y)
    model.module.train()
    assert torch.equal(loss, F.cross_entropy(model(w, x), y))


def test_two_client_threads_give_the_local_runs_numbers():
    """``executor: threads`` with two workers (each thread its own runtime and CNN gradient, the pooling kernels run
    with the GIL released) ends with the local run's parameters, bit for bit."""
    local = fedflat.run(CNN_TREE, overrides=["engine=sequential"], save=False, progress=False)
    threads = fedflat.run(CNN_TREE, overrides=["engine=sequential", "executor=threads", "executor.workers=2"],
                          save=False, progress=False)
    assert local.summary["gradient"] in ("native", "python")
    assert torch.equal(local.final_parameters, threads.final_parameters)
