"""What travels between a fedflat server and its Flower nodes: the client contract as Flower records.

Server to node (``train``): ``broadcast`` (an ArrayRecord of the model the clients start from, its buffers
``b^t`` for a model that has any, and the server-state entries the parts send), ``personal`` (the node's
clients' rows of the personal entries, when the method has any) and ``task`` (a ConfigRecord: round,
``eta_l^t``, the node's sampled clients in ascending id order, their sample and local step counts, and the last
round whose aggregation used each client's upload, which tells the node which of its saved client states is the
current one).

Node to server: ``upload`` (an ArrayRecord of the clients' upload rows, ``[C, ...]`` in the order of
``clients``) and ``result`` (a ConfigRecord: the round, the clients and the backward passes they took). The server
checks a reply against what it sent and the layout the method's client side uploads (:class:`UploadLayout`), never
against the other nodes' replies.

A personalized method's evaluation (``evaluate``, its clients' private entries never leave the nodes): the
server sends ``model`` (the global model and its buffers) and ``task`` (the node's clients and the round of each one's
current state); the node answers ``scores`` (per client with a test share: correct predictions, summed loss
and test samples of its own model on its own share).

Tensors go as NumPy arrays in Flower's own serialization, bit for bit.
"""
from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedflat.core import BUFFERS, MODEL, Broadcast, ClientResult, all_finite
from fedflat.engine.runtime import RoundTask, rows_loader
from fedflat.engine.simulation import ClientScores, OpenRound, Simulation

EVALUATE = "evaluate"  # Flower's message type of a personalized evaluation on the nodes

def array_record(tensors: dict[str, torch.Tensor]):
    return ArrayRecord({k: Array(v.detach().cpu().contiguous().numpy()) for k, v in tensors.items()})


def tensors(record) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}


def wire_bytes(content) -> int:
    """Bytes of the arrays a message carries as serialized by Flower (data and array headers)."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


@dataclass
class NodeTask:
    """A node's share of a round: the broadcast with its clients' personal rows, their task, and the
    round whose saved state each client continues from (-1: none)."""

    broadcast: Broadcast
    task: RoundTask
    state_rounds: list[int]
    base: str | None = None  # the server's frozen base's digest (adapters), None where nothing is frozen


def task_content(broadcast: Broadcast, task: RoundTask, state_rounds: list[int], base: str | None = None):
    """The ``train`` message content for one node (``broadcast`` already narrowed to its clients); ``base``: the
    digest of the server's frozen base (adapters), which the node checks against its own."""
    content = RecordDict({"broadcast": array_record(with_buffers(broadcast.shared(), broadcast.buffers)),
                          "task": ConfigRecord({
        "round": broadcast.round, "lr": float(broadcast.lr), "clients": task.ids.tolist(),
        "num-samples": task.num_samples.tolist(), "steps": task.steps.tolist(), "state-rounds": state_rounds,
        **({"base": base} if base is not None else {})})})
    if broadcast.personal:
        content["personal"] = array_record(broadcast.personal)
    return content


def read_task(content) -> NodeTask:
    task = content["task"]
    shared = tensors(content["broadcast"])
    ids = torch.tensor(task["clients"], dtype=torch.long)
    personal = tensors(content["personal"]) if "personal" in content.array_records else {}
    broadcast = Broadcast(int(task["round"]), float(task["lr"]), shared.pop(MODEL), shared, ids, personal,
                          shared.pop(BUFFERS, None))
    return NodeTask(broadcast, RoundTask(ids, torch.tensor(task["num-samples"], dtype=torch.long),
                                         torch.tensor(task["steps"], dtype=torch.long)),
                    [int(r) for r in task["state-rounds"]], str(task["base"]) if "base" in task else None)


def result_content(result: ClientResult, round: int):
    """A node's reply content for the clients of ``result``, trained in ``round`` (0-based)."""
    return RecordDict({"upload": array_record(result.upload),
                       "result": ConfigRecord({"round": int(round), "clients": result.ids.tolist(),
                                               "backprops": int(result.backprops)})})


class BadReply(ValueError):
    """A node's reply that cannot be used as a whole: an error, missing clients or a partial upload."""


def error_line(reason: str) -> str:
    """A node's error as one line. Flower's error reply carries the whole remote traceback (in a simulation Ray's,
    with colour codes) and ends with ``... occurred. Message: <the exception's text>'>``."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", reason).splitlines() if line.strip()]
    last = lines[-1] if lines else reason.strip()
    return last.split("Message: ", 1)[-1].removesuffix("'>")


def reply_content(message):
    """The content of a node's reply; an error reply or one without content is a :class:`BadReply`."""
    if message.has_error():
        raise BadReply(f"the node reported an error: {error_line(message.error.reason)}")
    if not message.has_content():
        raise BadReply("the reply has no content")
    return message.content


@dataclass(frozen=True)
class UploadLayout:
    """What one client's upload holds: each entry's name, the shape of its row and its NumPy dtype. A reply for ``C``
    clients holds exactly these entries, each ``[C, *row]`` of that dtype. ``step_backprops``: the backward passes
    one client's round of one local step took (measured by :func:`upload_layout`), part of the bound on what a reply
    may claim (:func:`most_backprops`)."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]
    step_backprops: int = 0

    @classmethod
    def of(cls, upload: dict[str, torch.Tensor], step_backprops: int = 0) -> UploadLayout:
        """The layout of ``upload`` (rows ``[C, ...]``), of a method whose client takes ``step_backprops`` backward
        passes in a round of one local step."""
        return cls(tuple(sorted((k, tuple(int(d) for d in v.shape[1:]), str(v.dtype).removeprefix("torch."))
                                for k, v in upload.items())), int(step_backprops))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]

    def __str__(self) -> str:
        return "[" + ", ".join(f"{k} {list(shape)} {dtype}" for k, shape, dtype in self.entries) + "]"


def npy_header(data: bytes) -> tuple[tuple[int, ...], np.dtype, int]:
    """The shape and dtype a serialized array (``.npy`` bytes, Flower's serialization) declares, and the bytes of
    data after its header: read without allocating the array (``np.load`` allocates the declared shape first)."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"array format version {version}")
    if fortran and len(shape) > 1:
        raise ValueError("a Fortran-ordered array")
    return tuple(shape), dtype, len(data) - stream.tell()


def checked_array(name: str, array, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The entry ``name`` of a reply as a tensor, once its declared shape, dtype and byte count are the expected
    ``shape`` and ``dtype``: nothing a node declares is allocated before it is checked."""
    if getattr(array, "stype", None) != "numpy.ndarray":
        raise BadReply(f"upload entry '{name}' is not a NumPy array (serialization {getattr(array, 'stype', None)!r})")
    try:
        declared, declared_dtype, size = npy_header(bytes(array.data))
    except Exception as err:  # noqa: BLE001 - a header numpy cannot read
        raise BadReply(f"upload entry '{name}' is not a readable array ({type(err).__name__}: {err})") from None
    if declared != shape:
        raise BadReply(f"upload entry '{name}' has shape {list(declared)}, expected {list(shape)}")
    if str(declared_dtype) != dtype:
        raise BadReply(f"upload entry '{name}' is {declared_dtype}, expected {dtype}")
    if size != math.prod(shape) * declared_dtype.itemsize:
        raise BadReply(f"upload entry '{name}' holds {size} bytes of data, its shape {list(shape)} {dtype} needs "
                       f"{math.prod(shape) * declared_dtype.itemsize}")
    return torch.from_numpy(np.array(np.load(io.BytesIO(bytes(array.data)), allow_pickle=False)))


def read_result(content, expected: list[int], layout: UploadLayout, round: int, most: int) -> ClientResult:
    """The clients' result in a node's reply, checked whole against what the node was sent and what the method
    uploads (module docstring): the reply of ``round`` (0-based), exactly the ``expected`` clients in that order, at
    most ``most`` backward passes (what their local steps take: :func:`most_backprops`), the entries of ``layout`` and
    no other, each ``[C, *row]`` of its dtype (checked before it is decoded), every floating-point value finite.
    Whatever else a node sends is a :class:`BadReply`, never the server's crash."""
    try:
        return _read_result(content, expected, layout, round, most)
    except BadReply:
        raise
    except Exception as err:  # a reply of any other form: the node's fault, said as such
        raise BadReply(f"the reply cannot be read ({type(err).__name__}: {err})") from None


def _plain_ints(values, what: str) -> list[int]:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if not all(type(v) is int for v in values):
        raise BadReply(f"the reply's {what} {values!r} are not whole numbers")
    return values


def _read_result(content, expected: list[int], layout: UploadLayout, round: int, most: int) -> ClientResult:
    if "upload" not in content.array_records or "result" not in content.config_records:
        raise BadReply("the reply has no upload")
    result = content["result"]
    said_round = _plain_ints(result.get("round", []), "round")
    if said_round != [round]:
        raise BadReply(f"the reply is for round {said_round[0] + 1 if said_round else None}, this is round {round + 1} "
                       "(a reply of another round)")
    clients = _plain_ints(result["clients"], "clients")
    if clients != expected:
        raise BadReply(f"the reply is for clients {clients}, the node was sent {expected}")
    backprops = _plain_ints(result["backprops"], "backward passes")
    if len(backprops) != 1 or backprops[0] < 0:
        raise BadReply(f"the reply's backward passes {backprops} are not one count")
    check_backprops(backprops[0], most)
    record = content["upload"]
    missing, extra = sorted(set(layout.names()) - set(record)), sorted(set(record) - set(layout.names()))
    if missing or extra:
        said = [f"lacks {missing}"] * bool(missing) + [f"has entries {extra} the method does not upload"] * bool(extra)
        raise BadReply(f"the upload {' and '.join(said)} (expected {layout})")
    upload = {name: checked_array(name, record[name], (len(expected), *shape), dtype)
              for name, shape, dtype in layout.entries}
    broken = [k for k, v in upload.items() if not all_finite(v)]
    if broken:
        raise BadReply(f"upload entries {broken} hold NaN or infinite values")
    return ClientResult(torch.tensor(clients, dtype=torch.long), upload, {}, backprops[0])


def check_backprops(claimed: int, most: int) -> None:
    """A :class:`BadReply` when a node claims more backward passes than its clients' local steps take (``most``)."""
    if claimed > most:
        raise BadReply(f"the reply claims {claimed} backward passes, more than the {most} its clients' local steps "
                       "take in this round (at most)")


def most_backprops(sim: Simulation, opened: OpenRound, layout: UploadLayout, clients: list[int]) -> int:
    """The most backward passes ``clients`` may take in the round ``opened``: per client ``b max(E_i, 1) + a_i``, with
    ``E_i`` the local steps the round asked of it, ``b`` the larger of the method's declared passes per step and those
    a round of one step took here (``layout.step_backprops``: a pass once a round, FedSCAM's pilot, is in it), and
    ``a_i`` what the parts declare they take once a round on the client's ``n_i`` samples (FedALA's start phase:
    :meth:`~fedflat.core.Part.round_backprops`). A client's passes in a round are ``a + b' E`` with ``b' <= b`` per
    step (FedSOL skips its first step's perturbation) and ``a`` once a round, either declared or taken by the round of
    one step too (then ``a + b' E <= (a + b') E``), so an honest node's count is never above it."""
    per_step = max(layout.step_backprops, sim.algorithm.backprops_per_step)
    task = {int(c): (int(e), int(n)) for c, e, n in zip(opened.task.ids.tolist(), opened.task.steps.tolist(),
                                                      opened.task.num_samples.tolist())}
    return sum(per_step * max(task[c][0], 1) + sim.algorithm.round_backprops(task[c][1], sim.settings)
               for c in clients)


def with_buffers(entries: dict[str, torch.Tensor], buffers: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """``entries`` and, for a model that has buffers, ``b`` under :data:`BUFFERS`."""
    return entries if buffers is None else {**entries, BUFFERS: buffers}


def evaluation_content(w: torch.Tensor, clients: list[int], state_rounds: list[int],
                       buffers: torch.Tensor | None = None):
    """The ``evaluate`` message content for one node: the global model (and buffers), its clients and their state
    rounds."""
    return RecordDict({"model": array_record(with_buffers({MODEL: w}, buffers)),
                       "task": ConfigRecord({"clients": clients, "state-rounds": state_rounds})})


def read_evaluation(content) -> tuple[torch.Tensor, torch.Tensor | None, list[int], list[int]]:
    task, model = content["task"], tensors(content["model"])
    return (model[MODEL], model.get(BUFFERS), [int(c) for c in task["clients"]],
            [int(r) for r in task["state-rounds"]])


def scores_content(scores: ClientScores):
    return RecordDict({"scores": ConfigRecord({"clients": scores.clients, "correct": scores.correct,
                                               "loss": scores.loss, "samples": scores.samples})})


def read_scores(content, sent: list[int]) -> ClientScores:
    """A node's scores, checked whole: clients it was sent, one value of each kind per client."""
    try:
        return _read_scores(content, sent)
    except BadReply:
        raise
    except Exception as err:  # a reply of any other form: the node's fault, said as such
        raise BadReply(f"the scores cannot be read ({type(err).__name__}: {err})") from None


def _read_scores(content, sent: list[int]) -> ClientScores:
    if "scores" not in content.config_records:
        raise BadReply("the reply has no scores")
    record = content["scores"]
    clients = [int(c) for c in record["clients"]]
    columns = [list(record[k]) for k in ("correct", "loss", "samples")]
    if any(len(column) != len(clients) for column in columns):
        raise BadReply("the scores do not have one value of each kind per client")
    foreign = sorted(set(clients) - set(sent))
    if foreign or len(set(clients)) != len(clients):
        raise BadReply(f"scores for clients {foreign or clients} the node was not sent (once each)")
    correct, loss, samples = columns
    counts = [*correct, *samples]
    if not all(type(n) is int and n >= 0 for n in counts) or any(c > n for c, n in zip(correct, samples)):
        raise BadReply("the scores' counts are not whole numbers with correct <= samples")
    if not all(isinstance(x, float) and math.isfinite(x) for x in loss):
        raise BadReply("the scores' losses are not finite numbers")
    return ClientScores(clients, [int(c) for c in correct], [float(x) for x in loss], [int(n) for n in samples])


def upload_layout(sim: Simulation, opened: OpenRound) -> UploadLayout:
    """What one client's upload holds in the round ``opened``: the method's client side (the code every node runs,
    :meth:`~fedflat.engine.runtime.ClientRuntime.fit`) run here for the round's first sampled client from a fresh
    state, one local step, and the backward passes that took. The entries (the parts' and upload stages'
    ``cohort.upload``), their row shapes and dtypes follow from the method, its options and the model, not from the
    data or the state, so every reply of the round is checked against this (:func:`read_result`), never against the
    other nodes' replies: with two nodes a vote would side with whichever sent the odd layout. Nothing of the server's
    state changes."""
    one = opened.task.rows(torch.tensor([0]))
    task = RoundTask(one.ids, one.num_samples, torch.ones_like(one.steps))
    store = sim.server.store
    names = sim.server.client_state_keys
    state = {n: torch.zeros(1, store.shape(n)[0], dtype=store.shape(n)[1]) for n in names}
    known = {n: torch.zeros(1, dtype=torch.bool) for n in names}
    counted = sim.runtime.oracle.backprops  # (the probe is not training: no backward pass of it is counted)
    try:
        result = sim.runtime.fit(opened.broadcast.for_clients(task.ids), task, rows_loader(task.ids, state, known))
    finally:
        sim.runtime.oracle.backprops = counted
    return UploadLayout.of(result.upload, result.backprops)
