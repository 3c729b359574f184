"""The contract's watcher: a plugin's parts are watched in every run, fedflat's own with ``FEDFLAT_CHECK_CONTRACT=1``.

Rule 1 of the contract (:mod:`fedflat.core.part`): a part never modifies in place a tensor it did not make in that
call — the broadcast, the server state, the held rows, the uploads, a cohort's state and personal rows, another
part's values, or the tensors handed to it (``W``, ``grad``, ``eps``, ``w_new``), except the ``grad`` handed over to
``direction`` (:data:`OWNED_ARGUMENTS`), which it may overwrite and return (returning a tensor it does not own, which
the engine would then overwrite, is an error too). It assigns new tensors instead, so a round stays a
transaction and the same client code gives the same numbers on every engine and executor.

A watched hook records the version counter of every tensor it can reach before it runs (PyTorch bumps it on every
in-place operation, on the tensor or any view of it) and compares after: a change is a :class:`ContractError`
naming the part, the hook and the tensor. A watched part is a twin of the part whose class subclasses the part's own
(:func:`checked`), so it is still what it is to ``isinstance`` (an attack, a data attack, a robust rule). It costs a
few microseconds per hook call: 15-20% of a run of the tiny test problem (a paired benchmark of watched and unwatched
runs of FedAvg and SCAFFOLD, docs/extending.md), far over the 2% a default may cost, so fedflat's own parts (whose
tests run watched) are watched only with ``FEDFLAT_CHECK_CONTRACT=1``, and a part defined outside fedflat (a
plugin's, a test's) in every run unless ``FEDFLAT_CHECK_CONTRACT=0``.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Iterator

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
    """``part`` watched (:func:`checked`) where the mode says so: every part with ``FEDFLAT_CHECK_CONTRACT=1``, a part
    defined outside fedflat unless it is ``0``."""
    setting = os.environ.get(CHECK_ENV, "")
    if checking() or (setting == "" and not type(part).__module__.startswith("fedflat.")):
        return checked(part)
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
    """The base a watched part's class adds (:func:`checked`): the part's own class stays its base, so
    ``isinstance`` sees the part as what it is (an attack, a backdoor, a robust rule), and every hook the class has is
    overridden by one that watches it for in-place changes of what it does not own."""

    __slots__ = ()
    __unwatched__: type  # the part's own class

    def __reduce__(self) -> tuple:
        plain = object.__new__(self.__unwatched__)
        plain.__dict__.update(self.__dict__)
        return checked, (plain,)


def _watching(cls: type, name: str) -> Callable[..., Any]:
    """The hook ``name`` of the watched class ``cls``: the part's own hook (looked up at each call, so that a hook
    patched on the part's class is the one watched), its reachable tensors' versions compared before and after."""
    owned = OWNED_ARGUMENTS.get(name, frozenset())

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        own = getattr(super(cls, self), name)
        before = _versions(own, args, kwargs, id(self), owned)
        result = own(*args, **kwargs)
        for what, (tensor, version) in before.items():
            if tensor._version != version:
                raise ContractError(f"{self!r}.{name} modified {what} in place; a part assigns new "
                                    "tensors instead (the contract's rule 1, fedflat/core/part.py)")
            if owned and _shares_memory(result, tensor):
                raise ContractError(f"{self!r}.{name} returned {what}, which the engine then overwrites; "
                                    "it returns its grad argument or a new tensor (fedflat/core/part.py)")
        return result
    hook.__name__ = hook.__qualname__ = name
    return hook


@functools.cache
def _watched_class(part_class: type) -> type:
    """``part_class`` with every hook it has watched (:class:`Checked` first in its bases)."""
    cls = type(part_class.__name__, (Checked, part_class), {"__module__": part_class.__module__,
                                                             "__qualname__": part_class.__qualname__,
                                                             "__unwatched__": part_class})
    for name in HOOKS:
        if callable(getattr(part_class, name, None)):
            setattr(cls, name, _watching(cls, name))
    return cls


def checked(part: Any) -> Any:
    """``part`` watched: a twin of it (the same attributes) whose class is a subclass of the part's own
    (:class:`Checked`), the part itself left as it is. A part already watched is returned as it is."""
    if isinstance(part, Checked):
        return part
    twin = object.__new__(_watched_class(type(part)))
    twin.__dict__.update(part.__dict__)
    return twin
