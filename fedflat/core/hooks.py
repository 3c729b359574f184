"""The hooks of every role, declared once: the part bases (:mod:`fedflat.core.part`, :mod:`fedflat.core.upload`)
define them, the contract's debug mode (:mod:`fedflat.core.contract`) watches them, and docs/extending.md's tables
are :func:`hook_table` of them (tests/test_contract.py checks all three against this table).

A hook's ``role`` is the role whose base class defines it; ``any`` is :class:`~fedflat.core.part.Part` itself
(every role inherits it), ``upload`` an upload stage (:class:`~fedflat.core.upload.UploadStage`) and ``attack`` a
data attack (``poison``, :class:`fedflat.algorithms.attacks.DataAttack`).
"""
from __future__ import annotations

from typing import NamedTuple


class Hook(NamedTuple):
    """One hook: its call, the role whose base defines it, where and when it runs, what it reads, what it returns or
    writes (the columns of docs/extending.md's table)."""

    call: str
    role: str
    runs_on: str
    reads: str
    returns: str

    @property
    def name(self) -> str:
        return self.call.split("(")[0]


HOOKS: tuple[Hook, ...] = (
    Hook("initial_state(w0, settings)", "any", "server, before round 0",
         "`w0[P]`, `settings`, the part's `server_state`",
         "the declared server entries at round 0 (default: each `server_state` entry's `Init` of `w0`)"),
    Hook("downlink(ctx)", "any", "server, before training", "`ctx.server`, `ctx.w`",
         "entries sent to every client (default: the `sends` entries)"),
    Hook("personal(ctx)", "any", "server, before training", "`ctx.server`, `ctx.held[K, P]`",
         "rows sent to each client alone, `{name: [K, ...]}` (FedWMSAM's personalized momentum)"),
    Hook("kept()", "any", "both", "the part's options",
         "the names of the vectors each client keeps (default: `keeps`; FedLESAM, APFL and error feedback choose by "
         "option)"),
    Hook("round_backprops(num_samples, settings)", "any", "server, checking a Flower node's reply",
         "the part's options, a client's sample count, `settings`",
         "the most backward passes a client takes once a round beyond its local steps' (default 0; FedALA's start "
         "phase: at most `ala_max_epochs` epochs of its batches)"),
    Hook("broadcast(ctx)", "server", "server, before training", "`ctx.w`, `ctx.server`",
         "the point clients start from, `[P]` (default `w^t`)"),
    Hook("begin(ctx, cohort)", "any", "client, once per chunk",
         "`ctx.w_start`, `ctx.server` (broadcast), `cohort.state/known/personal`",
         "`cohort.shared.put(slot, ...)`, `cohort.own(self)[...]`, `cohort.upload[...]`"),
    Hook("distillation(ctx)", "perturbation", "client, once per chunk", "the broadcast",
         "a `Distillation` term added to every mini-batch loss, or None (FedGMT)"),
    Hook("perturb(ctx, cohort, k, W, batch)", "perturbation", "client, every step `k`",
         "`W[C, P]`, `batch.x[C, B, ...]`, `ctx.oracle`", "`eps[C, P]` or None"),
    Hook("perturbed_point(ctx, cohort, k, W, batch, out)", "perturbation",
         "client, every step `k`, instead of `perturb`, where `fuses_point = True` and the filter is `none` or acts on "
         "the gradient", "as `perturb`; `out[C, P]`, the loop's buffer, which it may overwrite and return",
         "`W + eps` or None (default: `perturb` and the sum; SAM's native kernel: the scale and the sum in one pass, "
         "the same bits; FedWMSAM's: the point in two passes, the same bits where ATen rounds alike)"),
    Hook("apply(ctx, cohort, X)", "filter", "client, every step",
         "`X[C, P]` (`eps`, or the gradient with `acts_on = \"gradient\"`)", "the filtered `[C, P]`"),
    Hook("descent_gradient(ctx, cohort, grad)", "perturbation", "client, every step", "`grad = g(W + eps)`, `[C, P]`",
         "the gradient the step descends along (FedSpeed merges `g(W)`)"),
    Hook("direction(ctx, cohort, k, W, grad)", "correction", "client, every step",
         "`grad[C, P]` without weight decay, which it may overwrite and return; `W`",
         "`Direction(L, c)`, the local direction `d = L + c W` (default `(grad, wd)`); the engine clips `L` and adds "
         "`c W` (`train.clip_scope=loss`) or clips `L + c W` (`step`)"),
    Hook("distillation(ctx)", "correction", "client, once per chunk", "the broadcast",
         "a `Distillation` term, or None (FedNTD's); a method has at most one, the perturbation's or the "
         "correction's"),
    Hook("end(ctx, cohort, W)", "any", "client, once per chunk", "final `W[C, P]`",
         "`cohort.new_state[name] = [C, P]`, `cohort.upload[name] = [C, ...]`"),
    Hook("weights(ctx)", "aggregation", "server, after training", "`ctx.uploads[name][K, ...]`, `ctx.num_samples`",
         "`p[K]`, summing to one"),
    Hook("finish(ctx)", "any", "server, before the step", "`ctx.uploads`, `ctx.weights`",
         "`ctx.server[key] = new tensor`, `ctx.log[...]`"),
    Hook("step(ctx)", "server", "server", "`ctx.w`, `ctx.w_final[K, P]`, `ctx.aggregate(X)`, `ctx.weights`",
         "`w^{t+1}`, `[P]` (a new tensor); may write `ctx.log[...]`"),
    Hook("after_step(ctx, w_new)", "any", "server, after the step", "`w_new[P]`, everything above",
         "`ctx.server[key] = ...`, `ctx.held[name] = [K, P]`, `ctx.log[...]`"),
    Hook("private(settings)", "personalization", "both", "`settings.layout`",
         "a boolean mask `[P]` of the private entries, or None"),
    Hook("models(w, state, known, settings)", "personalization", "both", "the client rows of its `keeps`",
         "the clients' own models `[C, P]`, or None"),
    Hook("private_buffers(settings)", "personalization", "both", "`settings.buffers`, `settings.batch_norms`",
         "a boolean mask `[Q]` of the buffer entries each client keeps (FedBN's statistics), or None"),
    Hook("start(w, state, known, settings)", "personalization", "client, once per chunk", "as `models`",
         "the models `[C, P]` local training starts from (default: `models`), or None for the broadcast (Ditto, "
         "APFL: the personal model is trained beside the global one)"),
    Hook("initialize(ctx, cohort)", "personalization", "client, once per chunk, before `begin`",
         "`ctx.w_start` (the `start` models), `ctx.oracle`, `ctx.batches`, `cohort.state/known`",
         "the models `[C, P]` local training starts from, computed on the clients' data (FedALA's adaptive local "
         "aggregation), or None (default) for `ctx.w_start`"),
    Hook("local_step(ctx, cohort, k, W, batch)", "personalization",
         "client, every step, where `steps_locally = True`",
         "`W[C, P]` before the step moves it, the step's batch, `ctx.oracle`",
         "steps the personal model kept in `cohort.own(self)` (Ditto's `v_k`, APFL's `v_i`), inactive rows unchanged"),
    Hook("client(ctx, cohort, release)", "upload", "client, once per chunk, after every part's `end`",
         "the chunk's release, `ctx.server` (its `sends`), `cohort.state` (its `keeps`)",
         "the release as it leaves this stage; may write `cohort.new_state[...]` (error feedback's residual) and its "
         "`side` entries in `cohort.upload` (adaptive clipping's count)"),
    Hook("encode(ctx, cohort, release)", "upload",
         "client, after every stage's `client` (the one stage with `encodes = True`)", "the final release",
         "what travels: entries `model/<field>` (top-k's values and int32 indices); its `wire` names them"),
    Hook("decode(ctx, payload, size)", "upload", "server, first", "the received payload, `P`", "the release back"),
    Hook("malformed(payload, size)", "upload", "server, before `decode`", "the received payload, `P`",
         "`[K]` booleans: the rows `decode` cannot take (a wrong dtype or shape), which the server leaves out "
         "(default: none)"),
    Hook("server(ctx, release)", "upload", "server, before `weights`, in stage order",
         "the round's release, `ctx.uploads` as received (the `side` entries), `ctx.server`",
         "the release the method reads (central noise: every row the noised mean; a robust rule: every row its "
         "aggregate)"),
    Hook("min_clients()", "upload", "config validation", "the stage's options",
         "the fewest clients a round the stage is defined for (Krum's `2f + 3`, Bulyan's `4f + 3`); the config "
         "refuses a sampling with fewer (default 1)"),
    Hook("poison(ctx, cohort, batch)", "attack", "client, every step, before `perturb`",
         "the step's batch of a malicious client", "the batch it trains on (label flips, a backdoor's trigger)"),
    Hook("round_lr(ctx)", "server", "server, before training (before `broadcast`)", "`ctx.lr` (the run's `eta_l^t`)",
         "the round's local rate, sent with the broadcast and left in `ctx.lr` (default `ctx.lr`; server-side SWA's "
         "cyclic rate)"),
    Hook("step_lr(ctx, cohort, k)", "any", "client, every step `k`, where `schedules_steps = True`",
         "`cohort.steps` (`E_i`), `k`",
         "`[C]`: the factor of `eta_l^t` for each client's step `k` (a within-round schedule, FedSWA's); plain SGD only"),
    Hook("activation_penalty(ctx)", "any", "client, once per chunk, where `penalizes_activations = True`",
         "the part's options", "`mu`: the weight of `mu/2 sum_l mean |a_l|^2`, added to every gradient of the "
         "round's local objective (FedMAN)"),
)

ROLE_HOOKS: dict[str, tuple[str, ...]] = {}
for _hook in HOOKS:
    ROLE_HOOKS[_hook.role] = (*ROLE_HOOKS.get(_hook.role, ()), _hook.name)
HOOK_NAMES: frozenset[str] = frozenset(h.name for h in HOOKS)
PART_TABLE = ("any", "perturbation", "filter", "correction", "aggregation", "server", "personalization")
STAGE_TABLE = ("upload", "attack")


def hook_table(roles: tuple[str, ...]) -> str:
    """The markdown table of the hooks of ``roles`` (docs/extending.md's: :data:`PART_TABLE` with a role column,
    :data:`STAGE_TABLE` without)."""
    rows = [h for h in HOOKS if h.role in roles]
    if roles == STAGE_TABLE:
        lines = ["| hook | runs on | reads | returns |", "|---|---|---|---|"]
        lines += [f"| `{h.call}` | {h.runs_on} | {h.reads} | {h.returns} |" for h in rows]
    else:
        lines = ["| hook | role | runs on | reads | returns / writes |", "|---|---|---|---|---|"]
        lines += [f"| `{h.call}` | {h.role} | {h.runs_on} | {h.reads} | {h.returns} |" for h in rows]
    return "\n".join(lines)
