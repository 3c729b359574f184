"""Tests for fedflat.models: shapes, parameter counts, buffers, vmap/functional_call."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import U64, assert_close_normwise
from torch import nn
from torch.func import functional_call, grad, vmap

from fedflat.models import MODELS, build_model, count_parameters, model_options

# (name, input_shape, num_classes, options): tiny configurations, fast on CPU.
TINY: list[tuple[str, tuple[int, ...], int, dict[str, Any]]] = [
    ("logreg", (1, 4, 4), 3, {}),
    ("mlp", (1, 6, 6), 4, {"hidden": (8, 5)}),
    ("mlp", (2, 5), 3, {}),
    ("cnn", (3, 16, 16), 5, {}),
    ("cnn", (1, 8, 8), 3, {"padding": 2}),
    ("resnet18", (3, 16, 16), 10, {}),
    ("resnet18", (3, 16, 16), 10, {"stem": "imagenet"}),
    ("resnet34", (1, 8, 8), 4, {"groups": 4}),
    ("textcnn", (12,), 5, {"vocab_size": 50, "embed_dim": 8, "num_filters": 6}),
    ("resnet20", (3, 8, 8), 3, {}),
    ("resnet50", (3, 16, 16), 3, {"stem": "cifar", "groups": 4}),
    ("wrn28_4", (3, 8, 8), 4, {"groups": 4}),
    ("densenet121", (3, 8, 8), 3, {"groups": 4}),
    ("lstm", (6,), 5, {"hidden": 8, "embed_dim": 4}),
    ("vit", (3, 32, 32), 3, {}),
]
IDS = [f"{n}-{'x'.join(map(str, s))}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
       for n, s, _, o in TINY]


def make_input(model: nn.Module, batch: tuple[int, ...]) -> torch.Tensor:
    """Random input of shape ``[*batch, *input_shape]`` with the model's dtype."""
    shape = (*batch, *model.input_shape)
    if model.input_dtype == torch.long:
        return torch.randint(0, model.embedding.num_embeddings, shape)
    return torch.randn(shape)


def tiny(index: int, seed: int = 0) -> nn.Module:
    name, shape, classes, opts = TINY[index]
    torch.manual_seed(seed)
    return build_model(name, shape, classes, **opts)


# ----------------------------------------------------------------------------- registry

def test_registry_lists_every_model_with_description() -> None:
    assert set(MODELS) == {"logreg", "mlp", "cnn", "resnet18", "resnet20", "resnet34", "resnet50", "wrn28_4", "lstm",
                           "textcnn", "vit", "densenet121", "hf", "timm"}
    for factory, description in MODELS.values():
        assert callable(factory) and isinstance(description, str) and description


def test_unknown_model_names_valid_models_and_closest_match() -> None:
    with pytest.raises(ValueError) as err:
        build_model("resnet19", (3, 32, 32), 10)
    msg = str(err.value)
    assert "resnet19" in msg and "Did you mean 'resnet18'" in msg
    for name in MODELS:
        assert name in msg


def test_unknown_option_names_option_and_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        build_model("resnet18", (3, 32, 32), 10, stme="cifar")
    msg = str(err.value)
    assert "'stme'" in msg and "stem" in msg and "groups" in msg and "'stem'?" in msg
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", (784,), 10, width=3)
    with pytest.raises(ValueError, match=r"\(none\)"):
        build_model("logreg", (784,), 10, hidden=(3,))


def test_model_options_reports_defaults() -> None:
    assert model_options("mlp") == {"hidden": (200, 200)}
    assert model_options("resnet18") == {"stem": "cifar", "groups": 2, "norm": "group"}
    assert model_options("textcnn")["vocab_size"] == 30000


@pytest.mark.parametrize("name, shape, opts, match", [
    ("resnet18", (3, 32, 32), {"stem": "tiny"}, "stem"),
    ("resnet18", (3, 32, 32), {"groups": 3}, "groups"),
    ("resnet18", (32, 32), {}, r"\(C, H, W\)"),
    ("cnn", (3, 12, 12), {}, "H, W >= 16"),
    ("textcnn", (4,), {}, "largest kernel"),
    ("textcnn", (3, 32, 32), {}, r"\(L,\)"),
    ("mlp", (784,), {"hidden": 200}, "sequence"),
])
def test_invalid_option_values(name: str, shape: tuple[int, ...], opts: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, 10, **opts)


# ----------------------------------------------------------------------------- counts

def test_mlp_parameter_count_fashion_mnist() -> None:
    assert count_parameters(build_model("mlp", (1, 28, 28), 10)) == 199_210
    assert count_parameters(build_model("logreg", (1, 28, 28), 10)) == 785 * 10


def test_cnn_parameter_count_cifar() -> None:
    assert count_parameters(build_model("cnn", (3, 32, 32), 10)) == 797_962
    assert count_parameters(build_model("cnn", (1, 28, 28), 10)) == 573_578


@pytest.mark.parametrize("name, stem, expected, low, high", [
    ("resnet18", "cifar", 11_173_962, 11.1e6, 11.3e6),
    ("resnet18", "imagenet", 11_181_642, 11.1e6, 11.3e6),
    ("resnet34", "cifar", 21_282_122, 21.2e6, 21.4e6),
    ("resnet34", "imagenet", 21_289_802, 21.2e6, 21.4e6),
])
def test_resnet_parameter_counts(name: str, stem: str, expected: int, low: float,
                                 high: float) -> None:
    n = count_parameters(build_model(name, (3, 32, 32), 10, stem=stem))
    assert low <= n <= high
    assert n == expected  # torchvision count with GN in place of BN, 10-class head


@pytest.mark.parametrize("name, expected", [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_imagenet_resnets_have_torchvisions_parameter_counts(name: str, expected: int) -> None:
    """With the ImageNet stem and 1000 classes, torchvision's counts (GroupNorm has BatchNorm's two affine
    parameters per channel and no buffers)."""
    assert count_parameters(build_model(name, (3, 224, 224), 1000, stem="imagenet")) == expected


def test_resnet20_parameter_count() -> None:
    """He et al.'s ResNet-20 has 0.27 M parameters (269,722 with option-A zero-padding shortcuts, as the
    common CIFAR reference implementations); fedflat's two 1x1 projection shortcuts add their convolutions
    and norms: 16*32 + 32*64 weights and 2*(32 + 64) GroupNorm parameters."""
    assert count_parameters(build_model("resnet20", (3, 32, 32), 10)) == 269_722 + 16 * 32 + 32 * 64 + 2 * (32 + 64)


def test_wrn28_4_parameter_count_by_layer() -> None:
    """WRN-28-4 for CIFAR-100, counted layer by layer from the paper's layout (3x3 convs without bias, a
    1x1 projection where the width or stride changes, two norm parameters per channel)."""
    conv = lambda i, o, k=3: i * o * k * k  # noqa: E731
    norm = lambda c: 2 * c  # noqa: E731
    total, in_ch = conv(3, 16), 16
    for width in (64, 128, 256):
        for j in range(4):
            c_in = in_ch if j == 0 else width
            total += norm(c_in) + conv(c_in, width) + norm(width) + conv(width, width)
            total += conv(c_in, width, 1) if j == 0 else 0
        in_ch = width
    total += norm(256) + 256 * 100 + 100
    assert count_parameters(build_model("wrn28_4", (3, 32, 32), 100)) == total == 5_872_180


def test_densenet121_parameter_count_by_layer() -> None:
    """DenseNet-121 in FedLAW's CIFAR layout (seed 004's), counted layer by layer: a 3x3 stem of 64, bottlenecks
    norm + 1x1 to 128 + norm + 3x3 to 32, transitions norm + 1x1 halving, a final norm and the classifier."""
    total, channels = 3 * 64 * 9, 64
    for i, layers in enumerate((6, 12, 24, 16)):
        for j in range(layers):
            c_in = channels + 32 * j
            total += 2 * c_in + c_in * 128 + 2 * 128 + 128 * 32 * 9
        channels += 32 * layers
        if i < 3:
            total += 2 * channels + channels * (channels // 2)
            channels //= 2
    total += 2 * channels + channels * 10 + 10
    assert count_parameters(build_model("densenet121", (3, 32, 32), 10)) == total == 6_956_298


def test_lstm_is_nn_lstm_and_leaf_sized() -> None:
    """The vmap-friendly recurrence computes ``nn.LSTM``'s function with its parameters; LEAF's Shakespeare
    size: embedding 80 x 8, LSTM 8 -> 256 -> 256 (two bias vectors per layer, PyTorch's), classifier 256 -> 80."""
    model = build_model("lstm", (80,), 80)
    lstm_params = 4 * 256 * (8 + 256) + 4 * 256 * (256 + 256) + 2 * 2 * 4 * 256
    assert count_parameters(model) == 80 * 8 + lstm_params + 256 * 80 + 80 == 819_920
    reference = nn.LSTM(8, 256, 2, batch_first=True)
    with torch.no_grad():
        for layer in range(2):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(reference, f"{kind}_l{layer}").copy_(getattr(model.lstm, kind)[layer])
    embedded = model.embedding(torch.randint(0, 80, (3, 80)))
    torch.testing.assert_close(model.lstm(embedded), reference(embedded)[0][:, -1], rtol=1e-5, atol=1e-6)


def test_textcnn_parameter_count() -> None:
    model = build_model("textcnn", (64,), 14)
    embed, convs, head = 30000 * 128, 128 * 100 * (3 + 4 + 5) + 300, 300 * 14 + 14
    assert count_parameters(model) == embed + convs + head == 3_998_114


# ----------------------------------------------------------------------------- behaviour

@pytest.mark.parametrize("name, stem", [("resnet18", "cifar"), ("resnet18", "imagenet"), ("resnet20", None),
                                        ("wrn28_4", None), ("resnet34", "cifar"), ("cnn", None), ("mlp", None),
                                        ("densenet121", None)])
def test_full_size_output_shapes(name: str, stem: str | None) -> None:
    opts = {"stem": stem} if stem else {}
    model = build_model(name, (3, 32, 32), 10, **opts)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_textcnn_takes_long_tokens() -> None:
    model = build_model("textcnn", (40,), 14, vocab_size=1000)
    assert model.input_dtype == torch.long and model.feature_dim == 300
    tokens = torch.randint(0, 1000, (3, 40))
    assert model(tokens).shape == (3, 14)
    assert model.features(tokens).shape == (3, 300)
    torch.testing.assert_close(model(tokens.float()), model(tokens))  # float ids are cast


def test_textcnn_padding_token_has_zero_embedding_and_gradient() -> None:
    model = build_model("textcnn", (6,), 2, vocab_size=10, embed_dim=4, num_filters=2)
    assert torch.all(model.embedding.weight[0] == 0)
    tokens = torch.tensor([[0, 0, 3, 4, 5, 0]])
    model(tokens).sum().backward()
    assert torch.all(model.embedding.weight.grad[0] == 0)
    assert model.embedding.weight.grad[3].abs().sum() > 0


@pytest.mark.parametrize("index", range(len(TINY)), ids=IDS)
def test_shapes_features_and_no_buffers(index: int) -> None:
    model = tiny(index)
    _, shape, classes, _ = TINY[index]
    x = make_input(model, (3,))
    out, feats = model(x), model.features(x)
    assert out.shape == (3, classes)
    assert feats.shape == (3, model.feature_dim)
    torch.testing.assert_close(model.head(feats), out)
    assert list(model.buffers()) == []
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())


@pytest.mark.parametrize("index", range(len(TINY)), ids=IDS)
def test_initialisation_is_deterministic_given_seed(index: int) -> None:
    a, b, c = tiny(index, seed=1), tiny(index, seed=1), tiny(index, seed=2)
    for (ka, pa), (kb, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters()):
        assert ka == kb and torch.equal(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def _stack_params(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Stack the parameters of ``models`` along a new leading client dimension."""
    named = [dict(m.named_parameters()) for m in models]
    return {k: torch.stack([p[k].detach() for p in named]) for k in named[0]}


@pytest.mark.parametrize("index", range(len(TINY)), ids=IDS)
def test_vmap_functional_call_matches_loop(index: int) -> None:
    """Logits and cross-entropy gradients of vmapped clients equal a plain loop: vmap's batching rules compute
    the same function.

    In float64: a float32 gradient of a ReLU network is not a continuous function of the rounding (a
    pre-activation within rounding of zero flips its gate, and ResNet-50's gradient then moves by 6e-4 relative
    under a one-ulp change of its parameters), so two float32 orders can legitimately differ by far more than
    float32's rounding. In float64 no gate sits that close to zero, and two orders agree to float64's rounding
    amplified by the network's conditioning: ``2^20 u64 = 1.2e-10`` relative (normwise) leaves a factor of 1e5
    below what float32 would need, and any semantic difference is of order one."""
    clients = [tiny(index, seed=10 + c).double() for c in range(2)]
    base, classes = clients[0], TINY[index][2]
    torch.manual_seed(0)
    x = make_input(base, (2, 3))
    x = x if x.dtype == torch.long else x.double()
    y = torch.randint(0, classes, (2, 3))
    params = _stack_params(clients)

    def logits(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
        return functional_call(base, p, (xb,))

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits(p, xb), yb)

    out = vmap(logits, in_dims=(0, 0))(params, x)
    grads = vmap(grad(loss), in_dims=(0, 0, 0))(params, x, y)
    for c, model in enumerate(clients):
        assert_close_normwise(out[c], model(x[c]), 2 ** 20 * U64, f"logits of client {c}")
        names, tensors = zip(*model.named_parameters())
        expected = torch.autograd.grad(F.cross_entropy(model(x[c]), y[c]), tensors)
        for name, g in zip(names, expected):
            assert_close_normwise(grads[name][c], g, 2 ** 20 * U64, f"gradient of {name}, client {c}")


def test_textcnn_optional_dropout_sits_in_head() -> None:
    model = build_model("textcnn", (8,), 3, vocab_size=20, embed_dim=4, dropout=0.5).eval()
    assert any(isinstance(m, nn.Dropout) for m in model.head.modules())
    tokens = torch.randint(0, 20, (2, 8))
    torch.testing.assert_close(model.head(model.features(tokens)), model(tokens))


# ----------------------------------------------------------------------------- pretrained weights

def _as_torchvision(model: nn.Module) -> dict[str, torch.Tensor]:
    """A fedflat ResNet's parameters under torchvision's names, spelled out here, plus BatchNorm statistics."""
    out = {}
    for name, value in model.state_dict().items():
        tv = (name.replace("stem.0.", "conv1.").replace("stem.1.", "bn1.").replace("head.", "fc.")
              .replace(".shortcut.", ".downsample."))
        parts = tv.split(".")
        if parts[0] == "stages":
            tv = ".".join([f"layer{int(parts[1]) + 1}", *parts[2:]]).replace(".norm", ".bn")
        out[tv] = value.clone()
        if (tv.startswith("bn1.") or ".bn" in tv) and tv.endswith(".weight"):
            out[tv.replace(".weight", ".running_mean")] = torch.zeros_like(value)
    return out


def test_a_torchvision_resnet_checkpoint_loads_with_a_new_head(tmp_path) -> None:
    torch.manual_seed(1)
    source = build_model("resnet18", (3, 224, 224), 1000, stem="imagenet")
    path = tmp_path / "resnet18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in _as_torchvision(source).items()}}, path)
    torch.manual_seed(2)
    fresh_head = build_model("resnet18", (3, 64, 64), 7, stem="imagenet").head.weight.clone()
    torch.manual_seed(2)
    model = build_model("resnet18", (3, 64, 64), 7, stem="imagenet", pretrained=str(path))
    for (name, p), q in zip(model.named_parameters(), source.parameters()):
        if not name.startswith("head."):
            assert torch.equal(p, q), name
    assert torch.equal(model.head.weight, fresh_head)  # 7 classes: the head is replaced, not loaded
    from fedflat.models.pretrained import load_pretrained
    report = load_pretrained(build_model("resnet18", (3, 64, 64), 7, stem="imagenet"), path)
    assert report["replaced"] == ["head.weight", "head.bias"] and "bn1.running_mean" in report["unused"]


def test_a_runs_model_pt_starts_another_run(tmp_path) -> None:
    import fedflat
    from fedflat.config import load_config
    from fedflat.engine.simulation import Simulation

    hist = fedflat.run(None, overrides=["rounds=2", "threads=1"], out=tmp_path, progress=False)
    cfg = load_config(None, ["rounds=2", f"model.pretrained={hist.run_dir / 'model.pt'}"])
    assert torch.equal(Simulation(cfg).server.w.cpu(), hist.final_parameters)


def test_a_checkpoint_that_does_not_fit_names_the_parameters(tmp_path) -> None:
    from fedflat.core import ConfigError

    path = tmp_path / "r18.pt"
    torch.save(build_model("resnet18", (3, 32, 32), 10).state_dict(), path)
    with pytest.raises(ConfigError, match=r"does not fit this model: stages\.0\.2\.conv1\.weight .*missing"):
        build_model("resnet34", (3, 32, 32), 10, pretrained=str(path))
    with pytest.raises(ConfigError, match="not found .*give a local file"):
        build_model("resnet18", (3, 32, 32), 10, pretrained=str(tmp_path / "nope.pt"))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ConfigError, match="model.pretrained: .*junk.pt: unreadable pretrained checkpoint"):
        build_model("resnet18", (3, 32, 32), 10, pretrained=str(tmp_path / "junk.pt"))


@pytest.mark.parametrize("variant, expected", [("tiny16", 5_717_416), ("base32", 88_224_232)])
def test_vit_has_timms_parameter_count_and_names(variant: str, expected: int) -> None:
    """timm's vit_tiny_patch16_224 and vit_base_patch32_224 counts, under timm's state-dict keys."""
    model = build_model("vit", (3, 224, 224), 1000, variant=variant)
    assert count_parameters(model) == expected
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.11.mlp.fc2.bias",
            "norm.weight", "head.weight"} <= set(model.state_dict())


def test_vit_attention_is_scaled_dot_product_attention() -> None:
    from fedflat.models.vit import Attention

    torch.manual_seed(0)
    attn, x = Attention(12, 3), torch.randn(2, 5, 12)
    q, k, v = attn.qkv(x).view(2, 5, 3, 3, 4).permute(2, 0, 3, 1, 4)
    expected = attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_a_vit_checkpoint_in_timms_names_fine_tunes_with_a_new_head(tmp_path) -> None:
    source = build_model("vit", (3, 64, 64), 1000)
    torch.save(source.state_dict(), tmp_path / "vit.pt")
    model = build_model("vit", (3, 64, 64), 65, pretrained=str(tmp_path / "vit.pt"))
    assert torch.equal(model.pos_embed, source.pos_embed) and model.head.weight.shape == (65, 192)
    # another resolution: the 4 x 4 grid of position embeddings resampled to 2 x 4, the class token's row kept
    from fedflat.models.pretrained import load_pretrained
    small = build_model("vit", (3, 32, 64), 65)
    assert load_pretrained(small, tmp_path / "vit.pt")["resized"] == ["pos_embed"]
    grid = source.pos_embed[:, 1:].reshape(1, 4, 4, 192).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(2, 4), mode="bicubic", align_corners=False, antialias=True)
    assert torch.equal(small.pos_embed[:, 0], source.pos_embed[:, 0])
    torch.testing.assert_close(small.pos_embed[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 8, 192))
    assert torch.equal(small.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    from fedflat.core import ConfigError
    torch.save({**source.state_dict(), "pos_embed": source.pos_embed[:, :-1]}, tmp_path / "odd.pt")  # no square grid
    with pytest.raises(ConfigError, match=r"pos_embed \(1, 9, 192\): checkpoint has \(1, 16, 192\)"):
        build_model("vit", (3, 32, 64), 65, pretrained=str(tmp_path / "odd.pt"))
