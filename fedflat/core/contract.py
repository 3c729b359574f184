"""The contract's watcher: a plugin's parts are watched in every run, fedflat's own with ``FEDFLAT_CHECK_CONTRACT=1``.

Rule 1 of the contract (:mod:`fedflat.core.part`): a part never modifies in place a tensor it did not make in that
call — the broadcast, the server state, the held rows, the uploads, a cohort's state and personal rows, another
part's values, or the tensors handed to it (``W``, ``grad``, ``eps``, ``w_new``), except the ``grad`` handed over to
``direction`` (:data:`OWNED_ARGUMENTS`), which it may overwrite and return (returning a tensor it does not own, which
the engine would then overwrite, is an error too). It assigns new tensors instead, so a round stays a
transaction and the same client code gives the same numbers on every engine and executor.

A watched hook records the version counter of every tensor it can reach before it runs (PyTorch bumps it on every
in-place operation, on the tensor or any view of it) and compares after: a change is a :class:`ContractError`
naming the part, the hook and the tensor. It costs a few microseconds per hook call: 15-20% of a run of the tiny
test problem (a paired benchmark of watched and unwatched runs of FedAvg and SCAFFOLD, docs/extending.md), far over
the 2% a default may cost, so fedflat's own parts (whose tests run watched) are watched only with
``FEDFLAT_CHECK_CONTRACT=1``, and a part defined outside fedflat (a plugin's, a test's) in every run unless
``FEDFLAT_CHECK_CONTRACT=0``.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Iterator

import torch

from fedflat.core.errors import ContractError
from fedflat.core.hooks import HOOK_NAMES
from fedflat.core.round import ClientContext, Cohort, RoundContext

CHECK_ENV = "FEDFLAT_CHECK_CONTRACT"
HOOKS = HOOK_NAMES  # every hook of every role (fedflat/core/hooks.py)
# handed over: the hook may overwrite them (part.py)
OWNED_ARGUMENTS = {"direction": frozenset({"grad"}), "perturbed_point": frozenset({"out"})}


def checking() -> bool:
    """Whether the debug mode is on (``FEDFLAT_CHECK_CONTRACT`` set to anything but ``""`` or ``0``)."""
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def watched(part: Any) -> Any:
    """``part`` watched (:class:`Checked`) where the mode says so: every part with ``FEDFLAT_CHECK_CONTRACT=1``, a part
    defined outside fedflat unless it is ``0``."""
    setting = os.environ.get(CHECK_ENV, "")
    if checking() or (setting == "" and not type(part).__module__.startswith("fedflat.")):
        return Checked(part)
    return part


def _reachable(value: Any, where: str, owner: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor a hook receives through ``value`` (a context, a cohort, a tensor)."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, RoundContext):
        yield from (("ctx.w", value.w), ("ctx.w_start", value.w_start), ("ctx.weights", value.weights))
        for group in ("server", "held", "held_known", "uploads"):
            yield from ((f"ctx.{group}[{k!r}]", v) for k, v in getattr(value, group).items())
    elif isinstance(value, ClientContext):
        yield from (("ctx.w_start", value.w_start), ("ctx.w_broadcast", value.w_broadcast))
        yield from ((f"ctx.server[{k!r}]", v) for k, v in value.server.items())
    elif isinstance(value, Cohort):
        for group in ("state", "known", "personal"):
            yield from ((f"cohort.{group}[{k!r}]", v) for k, v in getattr(value, group).items())
        yield from ((f"cohort.shared[{s.name!r}]", v) for s, v in value.shared._values.items())
        for part_id, own in value._own.items():
            if part_id != owner:  # a part may update its own working values in place
                yield from ((f"another part's own value {k!r}", v) for k, v in own.items())
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _reachable(v, f"{where}[{k!r}]", owner)


def _versions(hook: Any, args: tuple, kwargs: dict, owner: int,
              owned: frozenset[str]) -> dict[str, tuple[torch.Tensor, int]]:
    seen: dict[str, tuple[torch.Tensor, int]] = {}
    for argument, value in inspect.signature(hook).bind(*args, **kwargs).arguments.items():
        if argument in owned:
            continue
        for name, tensor in _reachable(value, argument, owner):
            if isinstance(tensor, torch.Tensor) and name not in seen:
                seen[name] = (tensor, tensor._version)
    return seen


def _shares_memory(result: Any, tensor: torch.Tensor) -> bool:
    if isinstance(result, tuple) and result:  # a Direction: its loss tensor is what the engine overwrites
        result = result[0]
    return (isinstance(result, torch.Tensor) and result.device == tensor.device
            and result.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr())


class Checked:
    """A part whose hooks are watched for in-place changes of what they do not own (everything else forwarded)."""

    def __init__(self, part: Any):
        object.__setattr__(self, "_part", part)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._part, name)
        if name not in HOOKS or not callable(value):
            return value
        owner = id(self._part)

        @functools.wraps(value)
        def watched(*args: Any, **kwargs: Any) -> Any:
            before = _versions(value, args, kwargs, owner, OWNED_ARGUMENTS.get(name, frozenset()))
            result = value(*args, **kwargs)
            for what, (tensor, version) in before.items():
                if tensor._version != version:
                    raise ContractError(f"{self._part!r}.{name} modified {what} in place; a part assigns new "
                                        "tensors instead (the contract's rule 1, fedflat/core/part.py)")
                if name in OWNED_ARGUMENTS and _shares_memory(result, tensor):
                    raise ContractError(f"{self._part!r}.{name} returned {what}, which the engine then overwrites; "
                                        "it returns its grad argument or a new tensor (fedflat/core/part.py)")
            return result
        return watched

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._part, name, value)

    def __repr__(self) -> str:
        return repr(self._part)
