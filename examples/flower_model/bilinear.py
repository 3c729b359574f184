"""A model of your own on a deployed Flower federation: a plugin that registers it (docs/flower.md).

`fedflat.flower.simulate(cfg, model_fn=...)` takes a model factory directly; a deployment's SuperLink and SuperNodes
are other processes, on other machines, that build the model from the config. This module registers the model by
name; the config names the module in `plugins:` and the model in `model:`, and `fedflat flower-app` copies the module
into the app's package, so every SuperNode that runs the app builds the same model.
"""
import torch
from torch import nn

from fedflat.models import register_model


class Bilinear(nn.Module):
    """Two linear maps of the flattened input, mixed by a bilinear layer, then a linear head."""

    def __init__(self, input_shape, num_classes, width: int = 8):
        super().__init__()
        features = int(torch.tensor(input_shape).prod())
        self.a, self.b = nn.Linear(features, width), nn.Linear(features, width)
        self.mix = nn.Bilinear(width, width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.head(torch.tanh(self.mix(self.a(x), self.b(x))))


register_model("bilinear", Bilinear, "two linear maps mixed by a bilinear layer, then a linear head (an example)")
