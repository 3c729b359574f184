"""Secure aggregation of a Flower run: fedflat's uploads travel under Flower's SecAgg+ (Bell et al., CCS 2020), so
the server learns only their sum (``secure_aggregation`` in the config; docs/flower.md, docs/security.md).

The cryptography is Flower's own: :func:`secure_aggregation_mod` hands every ``train`` message of a node to Flower's
``secaggplus_mod``, and the server runs Flower's ``SecAggPlusWorkflow`` (setup, key sharing, masked vectors, unmask)
for each round (:func:`secure_round`). That workflow speaks Flower's legacy strategy interface (``FitIns`` out,
``FitRes`` back, ``aggregate_fit`` given the unmasked sum): :class:`OneRound` is the small legacy ``Strategy`` that
hands it the round's ``FitIns`` (fedflat's task, :func:`fit_ins`) and receives the result. Adapting to it, rather than
re-implementing the protocol's stages on fedflat's messages, keeps every step of the protocol Flower's.

What a node sends (:func:`node_vector`): for every upload entry ``e`` its clients' mean ``m_e = sum_i x_{i,e} / C``
over its ``C`` clients, with ``x_{i,model} = Delta_i = w_i - w^t`` (an update, small, so that ``clipping_range``
bounds it), and ``C`` as the ``num_examples`` Flower weighs by (``max_weight = N``, the number of clients, so that
``C / N <= 1``). The mod quantizes the weight ``d = round(C Q / N) / Q`` and ``d m_e`` (clipped to ``[-c, c]``), and
the workflow returns ``sum_n d_n m_{n,e} / sum_n d_n`` over the nodes whose masked vector arrived: the mean
``sum_i x_i / K`` over the ``K`` clients that answered, up to the quantization error (tests/test_secagg.py derives
its bound).

The weights are uniform, ``p_i = 1/K`` (fedflat's default, ``algo.weighting: uniform``): then every row equal to
the mean gives both what the aggregation reads (``sum_i p_i x_i``) and the plain sums other parts read (SCAFFOLD's
``sum_i Delta c_i``, FedDyn's ``sum_i Delta_i``: ``K`` times the mean). Under other weights those two differ and no
rows equal to one mean give both, so sample weights are refused (fedflat.config, and here for a plugin's part).

The round is finished from that mean alone, as central DP does (:mod:`fedflat.privacy.stage`): every client that
answered gets the mean as its row, so that a method whose server reads only the mean and sums of the uploads (no
part declares :attr:`~fedflat.core.Part.individual`, which fedflat.config refuses) computes what it computes from the
plain uploads. The training loss travels the same way (the metrics' ``train_loss`` is the clients' mean, as without
it); ``drift``, the clients' mean update norm without it, is the norm of the mean update.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from fedflat.config import Config, SecureAggregationConfig
from fedflat.core import BUFFERS, MODEL, ClientResult, ConfigError, NoClients
from fedflat.engine.simulation import RoundResult
from fedflat.flower.protocol import (UploadLayout, array_record, most_backprops, npy_header, task_content, tensors,
                                     upload_layout)

log = logging.getLogger("fedflat.flower")

WEIGHTS = "weights"  # the task's extra field under secure aggregation: the clients' weights in the node's mean
BROADCAST_NAMES, PERSONAL_NAMES = "fedflat.broadcast", "fedflat.personal"  # the FitIns arrays' names, in order
FLOATS = {"float16", "bfloat16", "float32", "float64"}  # the dtypes an upload entry may name


# -- the node's side -----------------------------------------------------------------------------------------------
def secure_aggregation_mod(config: Callable[[Context], Config]):
    """A ClientApp mod: under ``secure_aggregation`` (the run's config, ``config(context)``), every ``train`` message
    goes through Flower's ``secaggplus_mod``, and a plain ``train`` message is refused, so that a node of such a run
    releases its upload only masked; other runs' messages pass as they are."""
    def mod(message: Message, context: Context, call_next) -> Message:
        if message.metadata.message_type != MessageType.TRAIN or config(context).secure_aggregation is None:
            return call_next(message, context)
        if RECORD_KEY_CONFIGS not in message.content.config_records:
            raise ConfigError("this run's config turns on secure_aggregation: the node sends its upload only through "
                              "Flower's SecAgg+ protocol, not in a plain train message")
        return secaggplus_mod(message, context, call_next)

    return mod


def read_fit_ins(content: RecordDict) -> tuple[RecordDict, list[float]]:
    """fedflat's task content (:func:`fedflat.flower.protocol.task_content`) and the clients' weights in the node's
    mean from the ``FitIns`` of :func:`fit_ins`."""
    # (read as records: Flower's FitIns conversion takes scalars only, fedflat's task holds lists)
    parameters = compat.arrayrecord_to_parameters(content.array_records["fitins.parameters"], keep_input=True)
    arrays = [torch.from_numpy(np.array(a)) for a in parameters_to_ndarrays(parameters)]
    config = dict(content.config_records["fitins.config"])
    names, personal = list(config.pop(BROADCAST_NAMES)), list(config.pop(PERSONAL_NAMES))
    weights = [float(p) for p in config.pop(WEIGHTS)]
    if len(arrays) != len(names) + len(personal):
        raise ConfigError(f"the task has {len(arrays)} arrays for {len(names) + len(personal)} names")
    task = RecordDict({"broadcast": array_record(dict(zip(names, arrays[:len(names)]))),
                       "task": ConfigRecord(config)})
    if personal:
        task["personal"] = array_record(dict(zip(personal, arrays[len(names):])))
    return task, weights


def node_vector(upload: dict[str, torch.Tensor], weights: list[float], w_start: torch.Tensor | None
                ) -> tuple[dict[str, np.ndarray], float]:
    """``{e: m_e}``, the node's mean of each upload entry over its clients weighted by ``weights``, and their sum
    ``P`` (module docstring: the weights are ones and ``P`` is the node's client count). ``w_start``: the model the
    clients started from, subtracted from the model rows so that they travel as ``Delta_i``; None when they are
    ``Delta_i`` already (an upload path's release)."""
    if BUFFERS in upload:
        raise ConfigError("secure_aggregation: a model with buffers (BatchNorm statistics) cannot be summed under "
                          "SecAgg+'s clipping range; use a model without them (e.g. model.norm=group)")
    p = torch.tensor(weights, dtype=torch.float64)
    P = float(p.sum())
    means = {}
    for name in sorted(upload):
        rows = upload[name].double()
        if name == MODEL and w_start is not None:
            rows = rows - w_start.double()
        means[name] = (p @ rows.reshape(rows.shape[0], -1) / P).numpy()
    return means, P


def beyond_range(means: dict[str, np.ndarray], ratio: float, s: SecureAggregationConfig) -> int:
    """How many values SecAgg+'s clip changes: ``|d m_e| > c`` with ``d = round(ratio Q) / Q``, the weight the mod
    multiplies by before it clips to ``[-c, c]`` (``ratio``: the node's weight over ``max_weight``)."""
    d = round(ratio * s.quantization_range) / s.quantization_range
    return int(sum((np.abs(d * m) > s.clipping_range).sum() for m in means.values()))


def secure_reply(node, content: RecordDict) -> RecordDict:
    """A node's answer to the masked-vector stage, before Flower's mod masks it: it trains its clients
    (:meth:`fedflat.flower.node.Node.fit`) and returns ``FitRes`` of its means and weight (client count), and, in
    the clear, what the server needs to read the sum (its clients, backward passes, the entries' names, row
    shapes and dtypes) and how many values the clip changes."""
    task, weights = read_fit_ins(content)
    job, result = node.fit(task)
    if len(weights) != len(result.ids):
        raise ConfigError(f"the task has {len(weights)} weights for {len(result.ids)} clients")
    released = bool(node.sim.algorithm.path.stages)  # an upload path sends Delta_i already (fedflat.core.upload)
    means, P = node_vector(result.upload, weights, None if released else job.broadcast.w.cpu())
    broken = [name for name, m in means.items() if not np.isfinite(m).all()]
    if broken:  # (quantized, NaN would add garbage to the sum unseen: the node leaves the round, Flower recovers)
        raise ValueError(f"this node's upload entries {broken} hold NaN or infinite values: it leaves the round")
    s = node.sim.cfg.secure_aggregation
    clipped = beyond_range(means, P / node.sim.cfg.data.num_clients, s)
    if clipped:
        log.warning("secure aggregation: %d values of this node's upload lie beyond clipping_range=%g and are "
                    "clipped: raise secure_aggregation.clipping_range", clipped, s.clipping_range)
    names = sorted(result.upload)
    layout = {"clients": result.ids.tolist(), "entries": names,
              "shapes": [list(result.upload[n].shape[1:]) for n in names],
              "dtypes": [str(result.upload[n].dtype).removeprefix("torch.") for n in names]}
    # (FitRes metrics are scalars: the lists travel as one JSON string)
    metrics = {"layout": json.dumps(layout), "backprops": int(result.backprops), "beyond-range": clipped}
    fit_res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([means[n] for n in names]), round(P), metrics)
    return compat.fitres_to_recorddict(fit_res, keep_input=True)


# -- the server's side ---------------------------------------------------------------------------------------------
def fit_ins(content: RecordDict, weights: list[float]) -> FitIns:
    """fedflat's task content for one node as Flower's legacy ``FitIns`` (what SecAgg+'s workflow sends): the
    broadcast's and personal rows' arrays in order, their names and the task's fields in the config, with the
    weights of the node's clients in its mean (ones: module docstring)."""
    broadcast = tensors(content["broadcast"])
    personal = tensors(content["personal"]) if "personal" in content.array_records else {}
    config: dict[str, Any] = {**dict(content["task"]), BROADCAST_NAMES: list(broadcast),
                              PERSONAL_NAMES: list(personal), WEIGHTS: weights}
    arrays = [v.numpy() for v in (*broadcast.values(), *personal.values())]
    return FitIns(ndarrays_to_parameters(arrays), config)


class OneRound(LegacyStrategy):
    """The legacy Flower ``Strategy`` SecAgg+'s workflow drives for one round: ``configure_fit`` gives it the
    round's ``FitIns`` per node, ``aggregate_fit`` receives the nodes whose masked vector arrived, each ``FitRes``
    holding the unmasked mean (Flower sets every one's parameters to it). fedflat's server does the rest."""

    def __init__(self, instructions: list[tuple[GridClientProxy, FitIns]]):
        self.instructions = instructions
        self.results: list[tuple[Any, FitRes]] | None = None
        self.failures: list = []

    def initialize_parameters(self, client_manager) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager) -> list:
        return self.instructions

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Parameters | None, dict]:
        self.results, self.failures = list(results), list(failures)
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[float | None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict] | None:
        return None


def clear_text_problem(reply: Message, sent: list[int], layout: UploadLayout, most: int) -> str:
    """Why a node's masked-vector reply cannot join the sum ('' when it can): what it says in the clear (its clients,
    their count as its weight, the entries' names, row shapes and dtypes, its counts: at most ``most`` backward passes,
    :func:`fedflat.flower.protocol.most_backprops`) must be what it was sent and what the method uploads (``layout``,
    :func:`fedflat.flower.protocol.upload_layout`), and its masked vector must hold one integer array per entry of the
    size the layout gives (read from the arrays' headers, before Flower decodes them: Flower adds the vectors
    element-wise, so another count or shape would truncate or broadcast into the sum)."""
    try:
        fit_res = compat.recorddict_to_fitres(reply.content, keep_input=True)
        said = json.loads(str(fit_res.metrics["layout"]))
        clients = said["clients"]
        if not isinstance(clients, list) or not all(type(c) is int for c in clients) or clients != sent:
            return f"it answered for clients {clients}, it was sent {sent}"
        if type(fit_res.num_examples) is not int or fit_res.num_examples != len(sent):
            return f"its weight is {fit_res.num_examples}, its client count {len(sent)}"
        told = list(zip(said["entries"], [tuple(s) for s in said["shapes"]], said["dtypes"]))
        if told != [(n, shape, dtype) for n, shape, dtype in layout.entries]:
            return f"its upload has entries {told}, the method uploads {layout}"
        for key in ("backprops", "beyond-range"):
            if type(fit_res.metrics[key]) is not int or fit_res.metrics[key] < 0:
                return f"its {key} {fit_res.metrics[key]!r} is not a count"
        if fit_res.metrics["backprops"] > most:
            return (f"it claims {fit_res.metrics['backprops']} backward passes, more than the {most} its clients' "
                    "local steps take in this round (at most)")
        vectors = list(reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])
        expected = [(1,)] + [(max(1, int(np.prod(shape))),) for _, shape, _ in layout.entries]
        if len(vectors) != len(expected):
            return f"its masked vector has {len(vectors)} arrays, the layout {len(expected)}"
        for data, shape in zip(vectors, expected):
            declared, dtype, size = npy_header(bytes(data))
            if declared != shape or dtype.kind not in "iu" or size != int(np.prod(shape)) * dtype.itemsize:
                return f"its masked vector holds a {dtype} array of shape {list(declared)}, expected {list(shape)}"
    except Exception as err:  # noqa: BLE001 - whatever a node sends: never the server's crash
        return f"its reply cannot be read ({type(err).__name__}: {err})"
    return ""


def _ints(value) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _blobs(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, bytes) for v in value)


def form_problem(stage: str, reply: Message, nodes: set[int]) -> str:
    """Why a node's reply to SecAgg+'s key stages cannot be handed to Flower's workflow ('' when it can): the
    records each stage reads, of their types, naming only the round's nodes (the workflow indexes its tables by the
    node ids a reply names, so another id or a list of another length would end the round)."""
    try:
        said = reply.content.config_records[RECORD_KEY_CONFIGS]
        if stage == Stage.SETUP:
            ok = isinstance(said[Key.PUBLIC_KEY_1], bytes) and isinstance(said[Key.PUBLIC_KEY_2], bytes)
        elif stage == Stage.SHARE_KEYS:
            dsts, ciphertexts = said[Key.DESTINATION_LIST], said[Key.CIPHERTEXT_LIST]
            ok = _ints(dsts) and _blobs(ciphertexts) and len(dsts) == len(ciphertexts) and set(dsts) <= nodes
        elif stage == Stage.UNMASK:
            owners, shares = said[Key.NODE_ID_LIST], said[Key.SHARE_LIST]
            ok = _ints(owners) and _blobs(shares) and len(owners) == len(shares) and set(owners) <= nodes
        else:
            ok = True
    except Exception:  # noqa: BLE001 - a record missing, or not a record
        ok = False
    return "" if ok else f"its reply to SecAgg+'s {stage} stage is not of the protocol's form"


class Screened:
    """The grid as SecAgg+'s workflow sees it: a masked-vector reply whose clear text is inconsistent
    (:func:`clear_text_problem`) is held back, so that Flower's workflow treats its node as one that dropped out
    after sharing its keys: the node's vector is not added, and the unmask stage removes its pairwise masks from the
    others' (its own private mask stays unrevealed). A reply to another stage that is not of the protocol's form
    (:func:`form_problem`) is held back too: a dropout at that stage, which the workflow handles, where the malformed
    reply would have raised inside it and ended the run."""

    def __init__(self, grid, sent: dict[int, list[int]], layout: UploadLayout, round: int,
                 most: dict[int, int] | None = None):
        self.grid, self.sent, self.layout, self.round = grid, sent, layout, round
        self.most = most or {}  # node -> the most backward passes its clients' local steps take (most_backprops)
        self.left_out: dict[int, str] = {}

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        replies = self.grid.send_and_receive(messages, timeout=timeout)
        stages = {m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] for m in messages
                  if RECORD_KEY_CONFIGS in m.content.config_records}
        if len(stages) != 1:
            return replies
        (stage,) = stages
        kept = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                why = ""
            elif stage == Stage.COLLECT_MASKED_VECTORS:
                why = clear_text_problem(reply, self.sent.get(node, []), self.layout, self.most.get(node, 0))
            else:
                why = form_problem(stage, reply, set(self.sent))
            if why:
                self.left_out[node] = why
                log.warning("round %d: node %s's clients %s left out: %s (SecAgg+ recovers the sum without it)",
                            self.round + 1, node, self.sent.get(node), why)
                continue
            kept.append(reply)
        return kept


def workflow(s: SecureAggregationConfig, num_clients: int, round_timeout: float) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow with the config's parameters; a node's weight, its client count, is at most
    ``max_weight = N``."""
    return SecAggPlusWorkflow(s.num_shares, s.reconstruction_threshold, max_weight=float(num_clients),
                              clipping_range=s.clipping_range, quantization_range=s.quantization_range,
                              modulus_range=s.modulus_range, timeout=s.timeout or round_timeout)


def secure_round(strategy, grid, t: int) -> RoundResult:
    """Round ``t`` of :class:`~fedflat.flower.server.FedflatStrategy` under SecAgg+: sample, one ``FitIns`` per node
    hosting sampled clients, Flower's workflow, and the round finished from the clients' mean (module docstring).
    Fewer than two nodes, or too many dropouts for the threshold, is a :class:`~fedflat.core.NoClients`."""
    sim = strategy.sim
    strategy.check_deployment(grid)
    opened = sim.server.begin_round(t)
    p = sim.algorithm.parts["aggregation"].weights(opened.ctx)
    if not torch.allclose(p, p.mean().expand_as(p)):
        raise ConfigError(f"secure_aggregation: aggregation '{sim.algorithm.parts['aggregation'].name}' weighs the "
                          "clients unequally; SecAgg+ finishes a round from the clients' mean "
                          "(fedflat/flower/secagg.py)")
    by_node = strategy.federation.by_host(grid, opened.task.ids.tolist(), strategy.wait_s)
    if len(by_node) < 2:
        raise NoClients(f"round {t + 1}: SecAgg+ needs at least two nodes with sampled clients, "
                        f"{len(by_node)} hold{'s' if len(by_node) == 1 else ''} them: "
                        + (strategy.federation.absence(strategy.wait_s) if not by_node else
                           "start more SuperNodes (num-partitions >= 2) or sample more clients"))
    instructions, strategy.sent = [], {}
    for node, rows in by_node.items():
        picked = torch.tensor(rows, dtype=torch.long)
        task = opened.task.rows(picked)
        content = task_content(opened.broadcast.for_clients(task.ids), task,
                               sim.server.aggregated_round[task.ids].tolist(), sim.report.base_hash)
        instructions.append((GridClientProxy(node, grid, 0), fit_ins(content, [1.0] * len(rows))))
        strategy.sent[node] = task.ids.tolist()
    adapter = OneRound(instructions)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: t + 1}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=adapter)

    strategy.layout = layout = upload_layout(sim, opened)
    integral = [name for name, _, dtype in layout.entries if dtype not in FLOATS]
    if integral:
        raise ConfigError(f"secure_aggregation: this method uploads {integral} as integers (an encoder's), which "
                          "SecAgg+ cannot average; remove the compression")
    screened = Screened(grid, strategy.sent, layout, t,
                        {node: most_backprops(sim, opened, layout, clients) for node, clients in strategy.sent.items()})
    workflow(sim.cfg.secure_aggregation, sim.cfg.data.num_clients, strategy.round_timeout)(screened, context)
    if adapter.results is None:
        left_out = "".join(f"; node {n} left out: {why}" for n, why in sorted(screened.left_out.items()))
        raise NoClients(f"round {t + 1}: Flower's SecAgg+ halted (too few nodes answered for reconstruction_threshold="
                        f"{sim.cfg.secure_aggregation.reconstruction_threshold}{left_out}; Flower's log above says at "
                        "which stage): the sum cannot be unmasked")
    result, clipped = mean_result(strategy.sent, adapter.results, layout, opened.broadcast.w,
                                  bool(sim.algorithm.path.stages), t)
    round = sim.server.finish_round(opened, result)
    if clipped:
        round.log["secagg_clipped"] = float(clipped)
    return round


def mean_result(sent: dict[int, list[int]], results: list, layout: UploadLayout, w_start: torch.Tensor,
                released: bool, t: int) -> tuple[ClientResult, int]:
    """The :class:`~fedflat.core.ClientResult` of the nodes whose masked vector arrived (each checked in the clear
    against what it was sent and the method's ``layout``: :class:`Screened`): every one of their clients with the
    unmasked mean as its row (the model's as ``w^t + mean Delta`` unless the upload path sends ``Delta_i`` itself),
    and how many values the nodes' clip changed."""
    if not results:
        raise NoClients(f"round {t + 1}: no node's masked vector arrived")
    ids, backprops, clipped = [], 0, 0
    for proxy, res in results:
        ids += sent[proxy.node_id]
        backprops += int(res.metrics["backprops"])
        if int(res.metrics["beyond-range"]):
            clipped += int(res.metrics["beyond-range"])
            log.warning("round %d: node %s clipped %d values to secure_aggregation.clipping_range: the sum is biased",
                        t + 1, proxy.node_id, int(res.metrics["beyond-range"]))
    order = sorted(ids)
    K = len(order)
    means = parameters_to_ndarrays(results[0][1].parameters)
    upload = {}
    for (name, shape, dtype), mean in zip(layout.entries, means):
        row = torch.from_numpy(np.asarray(mean, dtype=np.float64)).reshape(shape)
        if name == MODEL and not released:
            row = w_start.double().cpu() + row
        upload[name] = row.to(getattr(torch, dtype)).expand(K, *row.shape).clone()
    return ClientResult(torch.tensor(order, dtype=torch.long), upload, {}, backprops), clipped
