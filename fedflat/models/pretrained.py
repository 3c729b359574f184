"""``model.pretrained=PATH``: start from a local checkpoint (nothing is downloaded).

Reads a PyTorch state dict (``torch.save``; also nested under ``state_dict`` / ``model``, with DataParallel's
``module.`` prefix) or a ``.safetensors`` file. Keys are fedflat's own, or torchvision's ResNet names
(``conv1``, ``bn1``, ``layerL.B.bnK``, ``downsample``, ``fc``), translated: BatchNorm's affine weights load into
the GroupNorm that replaces it, whose model drops the running statistics (GroupNorm keeps none); a BatchNorm model
(``model.norm=batch``) loads them too. Buffers the checkpoint lacks keep their fresh values (reported). The classifier
head is replaced when its shape differs (another number of classes). A ViT's position embedding learnt on another
input size is resampled to the model's patch grid (bicubic, as timm's ``resample_abs_pos_embed``; the class
token's row is kept). Every model parameter must be found
with its shape: a missing or mis-shaped one is an error naming it; checkpoint entries the model has no use
for are listed in the returned report.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from fedflat.core import ConfigError, persistent_buffers

HEADS = ("head.weight", "head.bias")
_NORM = "weight|bias|running_mean|running_var|num_batches_tracked"  # a BatchNorm's parameters and buffers
_TORCHVISION_RESNET = [  # (torchvision's name, fedflat's)
    (re.compile(r"^conv1\.weight$"), "stem.0.weight"),
    (re.compile(rf"^bn1\.({_NORM})$"), r"stem.1.\1"),
    (re.compile(r"^layer(\d)\.(\d+)\.conv(\d)\.weight$"), r"stages.<\1>.\2.conv\3.weight"),
    (re.compile(rf"^layer(\d)\.(\d+)\.bn(\d)\.({_NORM})$"), r"stages.<\1>.\2.norm\3.\4"),
    (re.compile(rf"^layer(\d)\.(\d+)\.downsample\.(\d)\.({_NORM})$"), r"stages.<\1>.\2.shortcut.\3.\4"),
    (re.compile(r"^fc\.(weight|bias)$"), r"head.\1"),
]


def torchvision_key(key: str) -> str | None:
    """fedflat's name for a torchvision ResNet parameter or BatchNorm buffer (None: nothing fedflat has);
    torchvision's ``layer1`` is fedflat's stage 0."""
    for pattern, target in _TORCHVISION_RESNET:
        if pattern.match(key):
            name = pattern.sub(target, key)
            return re.sub(r"<(\d)>", lambda m: str(int(m.group(1)) - 1), name)
    return None


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (see the module docstring for the formats)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"model.pretrained: {path} not found (fedflat downloads no weights: give a local file)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            from fedflat.files import safe_load

            state = safe_load(path, "pretrained checkpoint", "give model.pretrained a state dict of tensors "
                                                             "(.pt of torch.save(model.state_dict()), or .safetensors)")
    except ImportError:
        raise ConfigError("model.pretrained: reading .safetensors needs the safetensors package "
                          "(pip install safetensors)") from None
    except ConfigError as err:  # (safe_load's one line: the file, what was wrong, what to do)
        raise ConfigError(f"model.pretrained: {err}") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ConfigError(f"model.pretrained: {path} is not a readable checkpoint ({type(err).__name__})") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"model.pretrained: {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def resample_pos_embed(value: torch.Tensor, grid: tuple[int, int] | None,
                       shape: torch.Size) -> torch.Tensor | None:
    """A ViT position embedding ``[1, 1 + g*g, D]`` (class token first, a square grid) resampled bicubically to
    the model's ``grid`` (``[1, 1 + h*w, D]``); None when the shapes do not allow it."""
    if grid is None or value.dim() != 3 or value.shape[-1] != shape[-1]:
        return None
    side = int(round((value.shape[1] - 1) ** 0.5))
    if side * side != value.shape[1] - 1 or 1 + grid[0] * grid[1] != shape[1]:
        return None
    patches = value[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2).float()
    patches = torch.nn.functional.interpolate(patches, size=grid, mode="bicubic", align_corners=False,
                                              antialias=True)
    return torch.cat([value[:, :1], patches.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)], dim=1)


def load_pretrained(model: nn.Module, path: str | Path) -> dict[str, list[str]]:
    """Loads ``path`` into ``model`` in place; returns ``{"loaded", "replaced", "resized", "fresh", "unused"}`` key
    lists (``fresh``: buffers the checkpoint does not have, left as initialized)."""
    state = read_checkpoint(path)
    own = dict(model.named_parameters())
    untranslated: list[str] = []
    origin: dict[str, str] = {}  # fedflat's name -> the checkpoint's (reports name the checkpoint's keys)
    if not set(state) & set(own):  # not fedflat's names: try torchvision's
        translated = {}
        for key, value in state.items():
            name = torchvision_key(key)
            if name is None:
                untranslated.append(key)
            else:
                translated[name], origin[name] = value, key
        state = translated
    report: dict[str, list[str]] = {"loaded": [], "replaced": [], "resized": [], "fresh": [], "unused": []}
    wrong = []
    with torch.no_grad():
        for name, param in own.items():
            value = state.get(name)
            if name == "pos_embed" and value is not None and value.shape != param.shape:
                resized = resample_pos_embed(value, getattr(model, "grid", None), param.shape)
                if resized is not None:
                    value = resized
                    report["resized"].append(name)
            if value is not None and value.shape == param.shape:
                param.copy_(value)
                report["loaded"].append(name)
            elif name in HEADS and value is not None:
                report["replaced"].append(name)  # another number of classes: the fresh head stays
            else:
                wrong.append(f"{name} {tuple(param.shape)}: "
                             + ("missing" if value is None else f"checkpoint has {tuple(value.shape)}"))
        buffers = dict(persistent_buffers(model))
        for name, buffer in buffers.items():
            value = state.get(name)
            if value is not None and value.shape == buffer.shape:
                buffer.copy_(value)
                report["loaded"].append(name)
            else:
                report["fresh"].append(name)
    if wrong:
        shown = "; ".join(wrong[:5]) + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise ConfigError(f"model.pretrained: {path} does not fit this model: {shown}")
    report["unused"] = sorted(untranslated + [origin.get(k, k) for k in state if k not in own and k not in buffers])
    return report
