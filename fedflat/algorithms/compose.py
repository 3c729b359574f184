"""The assembly of an :class:`Algorithm` from a config's ``algo`` section: one part per role, each with its own
hyperparameters, checked.

A recipe names one part per role plus default hyperparameters; the ``algo`` section names a recipe and may swap
any role (``algo.filter=fft`` on ``fedlesam``) and set any part's hyperparameter. Hyperparameters are scoped to
their part: the resolved section reads

    algo: {name: fedscam, perturbation: {name: scam, rho_max: 0.05, ...}, ..., aggregation: {name: scam, beta: 0.8}}

and ``algo.aggregation.beta=0.8`` sets one part's value. A flat key (``algo.rho=0.05``) is accepted when exactly one
part of the method owns it, or when every owner declares it shared (FedDyn's ``alpha`` on client and server); when
several parts own it separately it is an error that names them. A recipe's defaults apply only to the parts it
names, never to a part swapped in. The section of a run folder written before scoping (every role a name, every
value flat) is read as it ran: each flat value set every part that owned it (:func:`scoped_section`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from fedflat.core import (PARTS, RECIPES, ROLES, STAGES, AlgorithmError, Broadcast, ClientContext,
                          ClientResult, Cohort, Correction, Part, Perturbation, Recipe, RoundContext, Shared, Slot,
                          TrainSettings, closest, composition_label, contract)
from fedflat.algorithms.attacks import DataAttack
from fedflat.core.upload import MUST_PRECEDE, UploadPath, UploadStage


@dataclass
class Algorithm:
    """An assembled method: its parts (one per role), each holding its own hyperparameters (``part.p``), and its
    upload path (:class:`fedflat.core.upload.UploadPath`: an attack, compression, differential privacy, a robust
    rule), its stages in their order."""

    name: str
    parts: dict[str, Part]
    path: UploadPath = field(default_factory=UploadPath)

    @functools.cached_property
    def ordered(self) -> list[Part]:
        """The parts in role order, then the upload stages: every hook runs in this order (the parts and stages are
        fixed once assembled: listed once)."""
        return [self.parts[role] for role in ROLES] + list(self.path.stages)

    @property
    def label(self) -> str:
        """The name, or the composition it is when roles were swapped (:func:`composition_label`)."""
        return composition_label(self.resolved())

    @property
    def backprops_per_step(self) -> int:
        """Declared backward passes per local step (the engines measure the real count)."""
        return 1 + sum(p.extra_backprops for p in self.ordered)

    def round_backprops(self, num_samples: int, settings: TrainSettings) -> int:
        """The most backward passes a client takes once a round beyond its local steps', over the parts
        (:meth:`~fedflat.core.Part.round_backprops`)."""
        return sum(p.round_backprops(num_samples, settings) for p in self.ordered)

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

    def individual_needs(self) -> list[str]:
        """``"role 'name': reason"`` for every part that reads each client's own upload (:attr:`Part.individual`):
        what central DP and secure aggregation, which release only the sum, cannot give it."""
        return [f"{part!r}: {part.individual}" for part in self.ordered if part.individual]

    def beyond_batch_needs(self) -> list[str]:
        """``"role 'name': reason"`` for every part that computes beyond the step's batch (:attr:`Part.beyond_batch`):
        what DP-SGD cannot account."""
        return [f"{part!r}: {part.beyond_batch}" for part in self.ordered if part.beyond_batch]

    def value(self, key: str, default: Any = None) -> Any:
        """The hyperparameter ``key`` of the first part (in role order) that has it, or ``default``."""
        return next((getattr(p.p, key) for p in self.ordered if key in type(p.p).model_fields), default)

    def initial_server_state(self, w0: torch.Tensor, settings: TrainSettings) -> dict[str, torch.Tensor]:
        """Every part's declared server entries at round 0 (an entry two parts declare is made once)."""
        server: dict[str, torch.Tensor] = {}
        for part in self.ordered:
            for key, value in part.initial_state(w0, settings).items():
                server.setdefault(key, value)
        return server

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        """Opens a chunk's local work: a fresh channel (knowing which part provides each slot), then every part's
        ``begin`` in role order."""
        cohort.shared = Shared({slot: repr(part) for part in self.ordered for slot in part.provides})
        for part in self.ordered:
            part.begin(ctx, cohort)

    # -- the server side of a round (Flower's configure_fit / aggregate_fit) ------------------
    def configure(self, ctx: RoundContext) -> Broadcast:
        """The round's downlink: the point clients start from, the round's local rate and what each part sends."""
        ctx.lr = self.parts["server"].round_lr(ctx)
        ctx.w_start = self.parts["server"].broadcast(ctx)
        shared: dict[str, torch.Tensor] = {}
        personal: dict[str, torch.Tensor] = {}
        for part in self.ordered:
            shared.update(part.downlink(ctx))
            personal.update(part.personal(ctx))
        return Broadcast(ctx.round, ctx.lr, ctx.w_start, shared, ctx.sampled.cpu(), personal)

    def aggregate(self, ctx: RoundContext, result: ClientResult,
                  release: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``w^{t+1}`` from the sampled clients' uploads (``result`` holds every sampled client, rows in
        ascending id order, as :func:`merge_results` makes them; ``release``: their release where the server's
        checks decoded it already): weights, then every part's ``finish``, the server step, every part's
        ``after_step``. Updates ``ctx.server``."""
        if not torch.equal(result.ids.cpu(), ctx.sampled.cpu()):
            raise ValueError(f"round {ctx.round}: results for clients {result.ids.tolist()}, "
                             f"expected exactly {ctx.sampled.tolist()} in ascending order")
        ctx.uploads = self.path.receive(ctx, result.upload, release)
        ctx.weights = self.parts["aggregation"].weights(ctx)
        for part in self.ordered:
            part.finish(ctx)
        w_new = self.parts["server"].step(ctx)
        for part in self.ordered:
            part.after_step(ctx, w_new)
        return w_new

    def resolved(self) -> dict[str, Any]:
        """The ``algo`` config section with every part and every hyperparameter, each under its role."""
        return {"name": self.name,
                **{role: {"name": part.name, **part.p.model_dump()} for role, part in self.parts.items()}}



# State entries renamed to the ``<part>.<symbol>`` convention: checkpoints and node state written before it still
# load (:func:`renamed_state`).
RENAMED_STATE = {"lesam_w_old": "lesam.w_old", "lesam_global": "lesam.global", "lesam_has_prev": "lesam.has_prev",
                 "personal_model": "fedper.w_i"}


def renamed_state(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` (server state, a store's slots, a client's saved state) under today's names."""
    return {RENAMED_STATE.get(k, k): v for k, v in entries.items()}


# -- reading an ``algo`` section -------------------------------------------------------------------------------

LEGACY_ROLES = ROLES[:5]  # the roles of every resolved section before scoping (personalization came later)


def scoped_section(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with every role a dict ``{name?, key: value}`` and the flat keys left at the top; a legacy
    section, the resolved form written before hyperparameters were scoped (every role a part's name,
    ``personalization`` possibly missing, and the hyperparameters flat beside them), becomes the scoped form of what
    it ran: each flat value under every role whose part owns it."""
    section = dict(section)
    legacy = (all(isinstance(section.get(role), str) for role in LEGACY_ROLES)
              and not any(isinstance(section.get(role), dict) for role in ROLES)
              and any(k not in ROLES and k != "name" for k in section))
    for role in ROLES:
        value = section.get(role)
        if isinstance(value, str):
            section[role] = {"name": value}
        elif isinstance(value, dict):
            section[role] = dict(value)
        elif value is not None:
            raise AlgorithmError(f"algo.{role}: a part's name or a mapping of its hyperparameters, got {value!r}")
    if legacy:
        for key in [k for k in section if k not in ROLES and k != "name"]:
            value = section.pop(key)
            for role in ROLES:
                part = PARTS[role].get(section.get(role, {}).get("name", ""))
                if part is not None and key in part.Params.model_fields:
                    section[role][key] = value
    return section


PLUGIN_HINT = ("a plugin's parts and recipes exist once its module is imported: name it in the config's `plugins:` "
               "(docs/extending.md#using-a-plugin)")


def _chosen_parts(name: str, recipe: Recipe, section: dict[str, Any]) -> dict[str, type[Part]]:
    classes = {}
    for role in ROLES:
        part_name = section.get(role, {}).get("name", recipe.part_names()[role])
        if part_name not in PARTS[role]:
            raise AlgorithmError(f"algo.{role}: unknown {role} '{part_name}'{closest(part_name, PARTS[role])}; "
                                 f"allowed: {', '.join(sorted(PARTS[role]))}; {PLUGIN_HINT}")
        classes[role] = PARTS[role][part_name]
    return classes


def _flat_owners(name: str, classes: dict[str, type[Part]], key: str, where: str) -> list[str]:
    """The roles a flat ``key`` sets: its one owner, or every owner when all of them share it."""
    owners = [role for role, cls in classes.items() if key in cls.Params.model_fields]
    if not owners:
        valid = sorted({k for cls in classes.values() for k in cls.Params.model_fields})
        raise AlgorithmError(f"{where}: not a hyperparameter of '{name}'{closest(key, valid + list(ROLES))}; "
                             f"valid: {', '.join(valid) or '(none)'}")
    if len(owners) > 1 and not all(key in classes[r].Params.shared_fields() for r in owners):
        named = " and ".join(f"{r} '{classes[r].name}'" for r in owners)
        raise AlgorithmError(f"{where}: {named} each have a '{key}'; say whose: "
                             + " or ".join(f"algo.{r}.{key}" for r in owners))
    return owners


def _recipe_defaults(recipe: Recipe, classes: dict[str, type[Part]]) -> dict[str, dict[str, Any]]:
    """The recipe's defaults for the roles whose part is the recipe's own (a swapped-in part keeps its own)."""
    own = {role: cls for role, cls in classes.items() if cls.name == recipe.part_names()[role]}
    values: dict[str, dict[str, Any]] = {role: {} for role in ROLES}
    recipe_classes = {role: PARTS[role][n] for role, n in recipe.part_names().items()}
    for key, value in recipe.defaults.items():
        role, _, leaf = key.rpartition(".")
        roles = [role] if role else _flat_owners(recipe.name, recipe_classes, leaf, f"recipe {recipe.name}: {key}")
        for r in roles:
            if r in own:
                values[r][leaf] = value
    return values


def build_algorithm(section: dict[str, Any], stages: list[dict[str, Any]] | tuple = ()) -> Algorithm:
    """Assembles the algorithm of a config's ``algo`` section (``name``, roles, hyperparameters flat or scoped) with
    the upload ``stages`` (``{name, **hyperparameters}`` each, e.g. :meth:`fedflat.config.Config.stage_specs`)."""
    return assemble(*build_parts(section), stages)


def assemble(name: str, parts: dict[str, Part], stages: list[dict[str, Any]] | tuple = ()) -> Algorithm:
    """The algorithm of the method ``name`` made of ``parts`` (:func:`build_parts`) and the upload ``stages``; every
    hook watched where the contract's mode says so (:func:`fedflat.core.contract.watched`)."""
    built = build_stages(stages)
    # hooks watched for in-place changes: a plugin's parts always, every part with FEDFLAT_CHECK_CONTRACT=1 (the tests)
    watched = {role: contract.watched(part) for role, part in parts.items()}
    return Algorithm(name=name, parts=watched, path=UploadPath(tuple(contract.watched(stage) for stage in built)))


def build_parts(section: dict[str, Any]) -> tuple[str, dict[str, Part]]:
    """The method of an ``algo`` section: its recipe's name and its parts, one per role, with their hyperparameters,
    checked together (shared hyperparameters, slots and server entries). Parts keep no state (the contract's rule
    4), so one method's parts serve every run of its config."""
    section = scoped_section(section)
    name = section.pop("name", "fedavg")
    if name not in RECIPES:
        raise AlgorithmError(f"unknown algorithm '{name}'{closest(name, RECIPES)}; run `fedflat list` for all; "
                             f"{PLUGIN_HINT}")
    recipe = RECIPES[name]
    classes = _chosen_parts(name, recipe, section)
    values = _recipe_defaults(recipe, classes)
    for key in [k for k in section if k not in ROLES]:
        for role in _flat_owners(name, classes, key, f"algo.{key}"):
            values[role][key] = section[key]
    for role in ROLES:
        for key, value in section.get(role, {}).items():
            if key != "name":
                if key not in classes[role].Params.model_fields:
                    valid = sorted(classes[role].Params.model_fields)
                    raise AlgorithmError(f"algo.{role}.{key}: not a hyperparameter of {role} '{classes[role].name}'"
                                         f"{closest(key, valid)}; valid: {', '.join(valid) or '(none)'}")
                values[role][key] = value
    parts = {role: cls(_params(cls, role, values[role])) for role, cls in classes.items()}
    _check_shared(parts)
    _check_composition(parts)
    return name, parts


def build_stages(specs: list[dict[str, Any]] | tuple) -> list[UploadStage]:
    """The upload stages of ``specs``, in their order, which must make sense
    (:func:`order_problem`); at most one stage changes what travels."""
    stages = []
    for spec in specs:
        spec = dict(spec)
        name = spec.pop("name", None)
        if name not in STAGES:
            raise AlgorithmError(f"upload stage '{name}'{closest(str(name), STAGES)}; "
                                 f"allowed: {', '.join(sorted(STAGES))}")
        if callable(getattr(STAGES[name], "poison", None)) and not issubclass(STAGES[name], DataAttack):
            raise AlgorithmError(f"upload stage '{name}' defines poison but is no data attack: subclass "
                                 "fedflat.algorithms.attacks.DataAttack, whose poison the engine calls every step")
        stages.append(STAGES[name](_params(STAGES[name], f"upload.{name}", spec)))
    problem = order_problem(stages)
    if problem is not None:
        raise AlgorithmError(f"{problem}; a config's upload path runs attack, compression, privacy, the upload list in "
                             "its order, then robust (docs/extending.md#the-upload-path)")
    encoders = [s.name for s in stages if s.encodes]
    if len(encoders) > 1:
        raise AlgorithmError(f"upload stages {encoders} each encode the upload: choose one compression")
    return stages


def order_problem(stages: list[UploadStage]) -> str | None:
    """Why the upload path ``stages`` (in the config's order) makes no sense, or None: the first stage that comes
    after a stage of a kind it must precede (:data:`fedflat.core.upload.MUST_PRECEDE`)."""
    for i, later in enumerate(stages):
        for earlier in stages[:i]:
            reason = MUST_PRECEDE.get((later.kind, earlier.kind))
            if reason is not None:
                return (f"upload stage {later.kind} '{later.name}' comes after {earlier.kind} '{earlier.name}', but "
                        f"must run before it: {reason}")
    return None


def _params(cls: type[Part], role: str, values: dict[str, Any]):
    try:
        return cls.Params(**values)
    except ValidationError as err:
        where = role if role.startswith("upload.") else f"algo.{role}"
        problems = "; ".join(f"{where}{''.join('.' + str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors())
        raise AlgorithmError(problems) from None


def _check_shared(parts: dict[str, Part]) -> None:
    """Parts that share a hyperparameter hold one value of it."""
    seen: dict[str, tuple[str, Any]] = {}
    for role, part in parts.items():
        for key in part.Params.shared_fields():
            value = getattr(part.p, key)
            if key in seen and seen[key][1] != value:
                other, first = seen[key]
                raise AlgorithmError(f"algo.{key}: {other} and {role} '{part.name}' share it, so they take one value "
                                     f"(got {first!r} and {value!r}); set algo.{key}")
            seen.setdefault(key, (f"{role} '{part.name}'", value))


def _check_composition(parts: dict[str, Part]) -> None:
    """Every slot and server entry a part requires has a provider; an entry two parts declare has one init; at most
    one distillation term (the perturbation's or the correction's, fedflat.engine.client.objective_term)."""
    if type(parts["correction"]).distillation is not Correction.distillation and \
            type(parts["perturbation"]).distillation is not Perturbation.distillation:
        raise AlgorithmError(f"{parts['perturbation']!r} and {parts['correction']!r} each add a distillation term "
                             "to the local objective, which needs at most one: choose another correction")
    slots = set().union(*(p.provides for p in parts.values()))
    declared: dict[str, tuple[Part, Any]] = {}
    for part in parts.values():
        for key, init in part.server_state.items():
            if key in declared and declared[key][1] is not init:
                raise AlgorithmError(f"server state '{key}': {declared[key][0]!r} and {part!r} declare it with "
                                     "different initial values")
            declared.setdefault(key, (part, init))
    for role, part in parts.items():
        missing = sorted((r.name if isinstance(r, Slot) else r) for r in part.requires
                         if (r not in slots if isinstance(r, Slot) else r not in declared))
        if missing:
            suppliers = [f"{r} '{n}'" for r in ROLES for n, c in PARTS[r].items()
                         if any(m in c.server_state or m in {s.name for s in c.provides} for m in missing)]
            raise AlgorithmError(
                f"{role} '{part.name}' needs {missing}, which no part of this combination provides"
                + (f"; use {' or '.join(suppliers)}" if suppliers else ""))
