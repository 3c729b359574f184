"""A module run at a flat parameter vector and a flat buffer vector.

:class:`FlatModel` runs an ``nn.Module`` at any flat vector ``w[P]`` (:class:`fedflat.core.ParamLayout` says
where each tensor lives in it), batched or not, without copying parameters (views are bound into the
module), which also works under ``torch.func.vmap``. A module's persistent buffers (BatchNorm's running
statistics, any registered buffer) travel as a second flat vector ``b[Q]`` (:class:`fedflat.core.BufferLayout`):
every forward pass binds the buffers it runs with, so one module serves every client and the global model.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from fedflat.core.vectors import BufferLayout, ParamLayout, persistent_buffers, trainable_parameters

__all__ = ["BufferLayout", "FlatModel", "ParamLayout"]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attr = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), attr


class FlatModel:
    """Evaluates an ``nn.Module`` at a flat parameter vector (and, for a module with buffers, a buffer vector).

    The module's ``nn.Parameter`` objects are removed once; before each call, views of the given flat
    vector are bound in their place (in every module that shares a parameter). Gradients with respect to that
    vector are then one ``autograd.grad`` call, with no concatenation, and the same code runs batched under
    ``vmap``. Evaluations (:meth:`__call__`, :meth:`features`) run the module in ``eval()`` mode with the buffers
    they are given; the engine's training passes set ``train()`` mode and bind each client's buffers themselves.
    """

    def __init__(self, module: nn.Module):
        self.layout = ParamLayout.of(module)
        self.buffer_layout = BufferLayout.of(module)
        self.initial = self.layout.flatten(module)
        self.initial_buffers = self.buffer_layout.flatten(module).to(self.initial.device)
        self.module = module
        state = module.state_dict(keep_vars=True)
        param_index = {id(p): j for j, (_, p) in enumerate(trainable_parameters(module))}
        buffer_index = {id(b): j for j, (_, b) in enumerate(persistent_buffers(module))}
        # every (owner, attribute) that holds parameter / buffer j: a shared tensor has several
        self._slots = [(*_owner(module, n), param_index[id(p)])
                       for n, p in module.named_parameters(remove_duplicate=False) if id(p) in param_index]
        self._buffer_slots = [(*_owner(module, n), buffer_index[id(b)])
                              for n, b in module.named_buffers(remove_duplicate=False) if id(b) in buffer_index]
        # what each state_dict key is (strict loading of model.pt wants every key, aliases included)
        self._keys: dict[str, tuple[str, int]] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            if id(p) in param_index:
                self._keys[n] = ("param", param_index[id(p)])
        for n, b in module.named_buffers(remove_duplicate=False):
            if id(b) in buffer_index:
                self._keys[n] = ("buffer", buffer_index[id(b)])
        frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) not in param_index}
        self._extra_state = {k: v for k, v in state.items() if k not in self._keys and k not in frozen}
        # the federated state's keys: frozen parameters (a pretrained base under adapters) are the module's own
        self.state_keys = [k for k in state if k not in frozen]
        for owner, attr, _ in self._slots:
            owner._parameters.pop(attr, None)
        self.bind(self.initial)

    def bind(self, flat: torch.Tensor) -> None:
        """Makes the module's parameters views of ``flat`` (shape ``[P]``)."""
        views = self.layout.views(flat)
        for owner, attr, j in self._slots:
            owner.__dict__[attr] = views[j]

    @contextlib.contextmanager
    def materialized(self, flat: torch.Tensor, buffers: torch.Tensor | None = None) -> Iterator[nn.Module]:
        """Within it, the module is an ordinary ``nn.Module`` at ``flat`` (and ``buffers``): its trained tensors are
        registered ``nn.Parameter`` objects again (copies of ``flat``'s entries), so code that reads a module's own
        ``state_dict()`` or parameters (peft's ``save_pretrained``, ``merge_and_unload``) sees the model at ``flat``;
        on leaving, the flat-vector binding is back."""
        views = self.layout.views(flat.detach())
        params = [nn.Parameter(v.clone()) for v in views]
        for owner, attr, j in self._slots:
            owner.__dict__.pop(attr, None)
            owner._parameters[attr] = params[j]
        if self.buffer_layout.size and buffers is not None:
            self.bind_buffers(self.buffer_layout.tensors(buffers.to(flat.device)))
        try:
            yield self.module
        finally:
            for owner, attr, _ in self._slots:
                owner._parameters.pop(attr, None)
            self.bind(self.initial)

    def bind_buffers(self, tensors: list[torch.Tensor]) -> None:
        """Makes the module's buffers the given per-buffer tensors (as :meth:`BufferLayout.tensors` makes them); a
        training pass then updates them in place, as the module would its own."""
        for owner, attr, j in self._buffer_slots:
            owner._buffers[attr] = tensors[j]

    def __call__(self, flat: torch.Tensor, x: torch.Tensor, buffers: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``x`` at ``flat`` in ``eval()`` mode, with the buffers ``buffers`` (``[Q]``)."""
        return self._evaluate(self.module, flat, x, buffers)

    def features(self, flat: torch.Tensor, x: torch.Tensor, buffers: torch.Tensor | None = None) -> torch.Tensor:
        """Penultimate-layer features at ``flat`` (models expose ``features``), in ``eval()`` mode."""
        return self._evaluate(self.module.features, flat, x, buffers)

    def _evaluate(self, forward: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, x: torch.Tensor,
                  buffers: torch.Tensor | None) -> torch.Tensor:
        self.module.eval()
        self.bind(flat)
        if self.buffer_layout.size:
            if buffers is None:
                raise ValueError("this model has buffers (e.g. BatchNorm statistics): evaluating it needs its buffer "
                                 "vector b as well as its parameters")
            self.bind_buffers(self.buffer_layout.tensors(buffers.to(flat.device)))
        return forward(x)

    def call_views(self, views, x: torch.Tensor) -> torch.Tensor:
        """The module at per-tensor ``views`` (as from ``layout.views``), in its current mode with its current
        buffers: lets autograd differentiate with respect to each tensor directly (the engine's oracle), also
        under ``vmap``."""
        for owner, attr, j in self._slots:
            owner.__dict__[attr] = views[j]
        return self.module(x)

    def state_dict(self, flat: torch.Tensor, buffers: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` for ``flat`` and ``buffers``: every key of the module's own ``state_dict`` but its
        frozen parameters, so a fresh instance loads it with ``load_state_dict(strict=True)`` (one with a frozen
        base, e.g. under adapters, with ``strict=False``: the base comes from its own files)."""
        if self.buffer_layout.size and buffers is None:
            raise ValueError("this model has buffers: its state dict needs the buffer vector b")
        views = self.layout.views(flat.detach())
        tensors = self.buffer_layout.tensors(buffers.detach().cpu()) if self.buffer_layout.size else []
        out = {}
        for key in self.state_keys:
            kind, j = self._keys.get(key, ("extra", -1))
            out[key] = (views[j].clone() if kind == "param" else tensors[j].to(flat.device) if kind == "buffer"
                        else self._extra_state[key])
        return out

    def vectors(self, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w, b)`` of a state dict (as :meth:`state_dict` writes it); a missing or mis-shaped entry is a
        ``ValueError`` naming it."""
        wrong = [f"{n} {'missing' if n not in state else tuple(state[n].shape)}, expected {tuple(s)}"
                 for n, s in (*zip(self.layout.names, self.layout.shapes),
                              *zip(self.buffer_layout.names, self.buffer_layout.shapes))
                 if n not in state or state[n].shape != s]
        if wrong:
            raise ValueError("; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
        w = torch.cat([state[n].reshape(-1).to(self.initial.dtype) for n in self.layout.names])
        b = self.buffer_layout.pack([state[n] for n in self.buffer_layout.names])
        return w, b
