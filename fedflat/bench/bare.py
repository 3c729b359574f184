"""The bare loop of ``fedflat bench``: the plainest per-client PyTorch loop doing a fedflat round's work.

One ``nn.Module``, the global weights copied into it for each client, ``torch.optim.SGD`` with coupled weight decay,
``clip_grad_norm_``, the same clients and the same batch indices as fedflat's round, a second backward pass per
step for two-backprop (SAM-type) methods, and the clients' final weights averaged (FedAvg).

Under an ``adapter`` section (LoRA, AdaLoRA) the loop is what a user of PyTorch and peft writes: the same base (the
model the config names, drawn from the run's seed as fedflat draws it), peft's ``get_peft_model`` with the same
``LoraConfig`` (:func:`fedflat.models.lora.peft_config`), ``torch.optim.SGD`` over the parameters that train (the
adapters and the head) and only those copied in and averaged; the frozen base stays in the module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedflat.core import ConfigError


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a timed round ends when its kernels have run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BARE_LOOPS = ("bare", "plain")  # the engine names of the two reference loops


class BareLoop:
    """The plainest per-client PyTorch loop doing a fedflat round's work (same clients, batches, steps), with the
    run's ``precision`` and ``channels_last`` as a plain loop would write them, or (``plain``) in float32 and NCHW
    order whatever the run sets: the loop a user writes without those options, which an option's speed-up is
    measured against."""

    def __init__(self, sim, backprops: int, rho: float = 0.01, plain: bool = False):
        self.sim, self.backprops, self.rho, self.plain = sim, backprops, rho, plain
        self.module = self._fresh_module()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        if names != list(sim.model.layout.names):  # (the loop copies w in by fedflat's layout)
            raise ValueError(f"the bare loop's trained parameters ({len(names)}) are not the run's "
                             f"({len(sim.model.layout.names)}): {names[:3]} vs {list(sim.model.layout.names)[:3]}")
        self.w = sim.server.w.clone()

    def _fresh_module(self) -> torch.nn.Module:
        from fedflat.models import assemble, build_model

        cfg, data = self.sim.cfg, self.sim.dataset
        options = {k: v for k, v in cfg.model.items() if k != "name"}
        # the base as fedflat draws it (the run's init stream), so that both train the same frozen weights
        module = assemble(lambda: build_model(cfg.model["name"], data.input_shape, data.num_classes, **options),
                          cfg.seed)
        if cfg.adapter is not None:
            module = with_peft(module, cfg.adapter)
        return module.to(self.sim.device)

    def run_round(self, round: int) -> None:
        sim, module, params = self.sim, self.module, self.params
        ctx = sim.server.new_context(round)
        ids, steps = ctx.sampled.tolist(), ctx.steps.tolist()
        schedules = sim.batches.schedules(round, ids, steps)
        x_all, y_all = sim.dataset.x_train, sim.dataset.y_train
        module.train()
        finals = []
        for schedule in schedules:
            with torch.no_grad():  # (vector_to_parameters would alias self.w and let SGD overwrite it)
                for p, v in zip(params, sim.model.layout.views(self.w)):
                    p.copy_(v)
            opt = torch.optim.SGD(params, lr=ctx.lr, weight_decay=sim.cfg.train.weight_decay)
            for idx in schedule:
                x, y = sim.dataset.features(x_all[idx]), y_all[idx]
                if self.backprops == 2:
                    self._sam_ascent(params, x, y)
                opt.zero_grad()
                self._loss(x, y).backward()
                if self.backprops == 2:
                    self._sam_descent(params)
                if sim.cfg.train.clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, sim.cfg.train.clip)
                opt.step()
            finals.append(torch.nn.utils.parameters_to_vector(params).detach())
        self.w = torch.stack(finals).mean(0)
        sync(sim.device)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch loss with the run's ``precision`` (autocast) and ``channels_last`` input, as a plain loop
        would write them."""
        cfg = self.sim.cfg
        if cfg.channels_last and x.dim() == 4 and not self.plain:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16" and not self.plain):
            logits = self.module(x)
        return F.cross_entropy(logits.float(), y)

    def _sam_ascent(self, params, x, y) -> None:
        grads = torch.autograd.grad(self._loss(x, y), params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        self._eps = [self.rho * g / (norm + 1e-12) for g in grads]
        with torch.no_grad():
            for p, e in zip(params, self._eps):
                p.add_(e)

    def _sam_descent(self, params) -> None:
        with torch.no_grad():
            for p, e in zip(params, self._eps):
                p.sub_(e)


def with_peft(module: torch.nn.Module, settings) -> torch.nn.Module:
    """``module`` under peft's ``get_peft_model`` with the ``LoraConfig`` (or ``AdaLoraConfig``) fedflat builds from
    the ``adapter`` section; a Hugging Face classifier's transformers model is adapted inside its one-tensor wrapper
    (with peft's sequence-classification task for a text model), as fedflat adapts it. FFA-LoRA's ``freeze_a``
    leaves every ``lora_A`` frozen."""
    from peft import get_peft_model

    from fedflat.models.hub import TASK_TYPES, Classifier
    from fedflat.models.lora import peft_config

    if settings.init is not None:
        raise ConfigError("the bench's bare loop builds fresh adapters: leave adapter.init unset")
    inner = module.model if isinstance(module, Classifier) else module
    task = TASK_TYPES[module.kind] if isinstance(module, Classifier) else None
    adapted = get_peft_model(inner, peft_config(settings, inner, task))
    if settings.freeze_a:
        for name, p in adapted.named_parameters():
            if ".lora_A." in name:
                p.requires_grad_(False)
    if isinstance(module, Classifier):
        module.model = adapted
        return module
    return adapted
