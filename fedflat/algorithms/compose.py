"""The assembly of an :class:`Algorithm` from a config's ``algo`` section: one part per role, checked.

A recipe names one part per role plus default hyperparameters; the config's ``algo`` section names a
recipe and may override any role (``algo.filter=fft`` on ``fedlesam``) or hyperparameter
(``algo.rho=0.05``). Hyperparameters live in one flat namespace, the union of the parts' fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from fedflat.core import (PARTS, RECIPES, ROLES, AlgorithmError, Broadcast, ClientResult, Part, RoundContext, closest,
                          composition_label)


@dataclass
class Algorithm:
    """An assembled method: its parts (one per role) and resolved hyperparameters."""

    name: str
    parts: dict[str, Part]
    hyperparameters: dict[str, Any]

    @property
    def ordered(self) -> list[Part]:
        return [self.parts[role] for role in ROLES]

    @property
    def label(self) -> str:
        """The name, or the composition it is when roles were swapped (:func:`composition_label`)."""
        return composition_label(self.resolved())

    @property
    def backprops_per_step(self) -> int:
        """Declared backward passes per local step (the engines measure the real count)."""
        return 1 + sum(p.extra_backprops for p in self.ordered)

    def state_keys(self) -> list[str]:
        """Names of the state vectors each client keeps, over all parts (no repeats)."""
        return list(dict.fromkeys(name for part in self.ordered for name in part.kept()))

    def held_keys(self) -> list[str]:
        """Names of the per-client vectors the server holds, over all parts (no repeats)."""
        return list(dict.fromkeys(name for part in self.ordered for name in part.holds))

    @property
    def client_state_vectors(self) -> int:
        """Model-sized vectors stored per client, on the client or on the server."""
        return len(self.state_keys()) + len(self.held_keys())

    # -- the server side of a round (Flower's configure_fit / aggregate_fit) ------------------
    def configure(self, ctx: RoundContext) -> Broadcast:
        """The round's downlink: the point clients start from and what each part sends with it."""
        ctx.w_start = self.parts["server"].broadcast(ctx)
        shared: dict[str, torch.Tensor] = {}
        personal: dict[str, torch.Tensor] = {}
        for part in self.ordered:
            shared.update(part.downlink(ctx))
            personal.update(part.personal(ctx))
        return Broadcast(ctx.round, ctx.lr, ctx.w_start, shared, ctx.sampled.cpu(), personal)

    def aggregate(self, ctx: RoundContext, result: ClientResult) -> torch.Tensor:
        """``w^{t+1}`` from the sampled clients' uploads (``result`` holds every sampled client, rows in
        ascending id order, as :func:`merge_results` makes them): weights, then every part's
        ``finish``, the server step, every part's ``after_step``. Updates ``ctx.server``."""
        if not torch.equal(result.ids.cpu(), ctx.sampled.cpu()):
            raise ValueError(f"round {ctx.round}: results for clients {result.ids.tolist()}, "
                             f"expected exactly {ctx.sampled.tolist()} in ascending order")
        ctx.uploads = result.upload
        ctx.weights = self.parts["aggregation"].weights(ctx)
        for part in self.ordered:
            part.finish(ctx)
        w_new = self.parts["server"].step(ctx)
        for part in self.ordered:
            part.after_step(ctx, w_new)
        return w_new

    def resolved(self) -> dict[str, Any]:
        """The ``algo`` config section with every role and default filled in."""
        roles = {role: part.name for role, part in self.parts.items()}
        return {"name": self.name, **roles, **self.hyperparameters}


def _check_composition(parts: dict[str, Part]) -> None:
    provided = set().union(*(p.provides for p in parts.values()))
    for role, part in parts.items():
        missing = part.requires - provided
        if missing:
            suppliers = [f"{r} '{n}'" for r in ROLES for n, c in PARTS[r].items() if missing & c.provides]
            raise AlgorithmError(
                f"{role} '{part.name}' needs {sorted(missing)}, which no part of this combination provides"
                + (f"; use {' or '.join(suppliers)}" if suppliers else ""))


def build_algorithm(section: dict[str, Any]) -> Algorithm:
    """Assembles the algorithm of a config's ``algo`` section (``name`` + roles + hyperparameters)."""
    section = dict(section)
    name = section.pop("name", "fedavg")
    if name not in RECIPES:
        raise AlgorithmError(f"unknown algorithm '{name}'{closest(name, RECIPES)}; run `fedflat list` for all")
    recipe = RECIPES[name]
    chosen = recipe.part_names()
    for role in ROLES:
        if role in section:
            chosen[role] = section.pop(role)
        if chosen[role] not in PARTS[role]:
            raise AlgorithmError(f"algo.{role}: unknown {role} '{chosen[role]}'{closest(chosen[role], PARTS[role])}; "
                                 f"allowed: {', '.join(sorted(PARTS[role]))}")
    classes = {role: PARTS[role][chosen[role]] for role in ROLES}
    owners: dict[str, list[str]] = {}
    for role, cls in classes.items():
        for key in cls.Params.model_fields:
            owners.setdefault(key, []).append(role)
    for key in section:
        if key not in owners:
            valid = sorted(owners) + list(ROLES)
            raise AlgorithmError(f"algo.{key}: not a hyperparameter of '{name}'{closest(key, valid)}; "
                                 f"valid: {', '.join(sorted(owners)) or '(none)'}")
    values = {k: v for k, v in recipe.defaults.items() if k in owners}
    values.update(section)
    parts: dict[str, Part] = {}
    hyper: dict[str, Any] = {}
    for role, cls in classes.items():
        mine = {k: v for k, v in values.items() if k in cls.Params.model_fields}
        try:
            params = cls.Params(**mine)
        except ValidationError as err:
            problems = "; ".join(f"algo.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise AlgorithmError(problems) from None
        parts[role] = cls(params)
        hyper.update(params.model_dump())
    _check_composition(parts)
    return Algorithm(name=name, parts=parts, hyperparameters=hyper)
