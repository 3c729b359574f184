"""What travels between a fedflat server and its Flower nodes: the client contract as Flower records.

Server to node (``train``): ``broadcast`` (an ArrayRecord of the model the clients start from, its buffers
``b^t`` for a model that has any, and the server-state entries the parts send), ``personal`` (the node's
clients' rows of the personal entries, when the method has any) and ``task`` (a ConfigRecord: round,
``eta_l^t``, the node's sampled clients in ascending id order, their sample and local step counts, and the last
round whose aggregation used each client's upload, which tells the node which of its saved client states is the
current one).

Node to server: ``upload`` (an ArrayRecord of the clients' upload rows, ``[C, ...]`` in the order of
``clients``) and ``result`` (a ConfigRecord: the clients and the backward passes they took).

A personalized method's evaluation (``evaluate``, its clients' private entries never leave the nodes): the
server sends ``model`` (the global model and its buffers) and ``task`` (the node's clients and the round of each one's
current state); the node answers ``scores`` (per client with a test share: correct predictions, summed loss
and test samples of its own model on its own share).

Tensors go as NumPy arrays in Flower's own serialization, bit for bit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedflat.core import BUFFERS, MODEL, TRAIN_LOSS, Broadcast, ClientResult
from fedflat.engine.runtime import RoundTask
from fedflat.engine.simulation import ClientScores

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


def task_content(broadcast: Broadcast, task: RoundTask, state_rounds: list[int]):
    """The ``train`` message content for one node (``broadcast`` already narrowed to its clients)."""
    content = RecordDict({"broadcast": array_record(with_buffers(broadcast.shared(), broadcast.buffers)),
                          "task": ConfigRecord({
        "round": broadcast.round, "lr": float(broadcast.lr), "clients": task.ids.tolist(),
        "num-samples": task.num_samples.tolist(), "steps": task.steps.tolist(), "state-rounds": state_rounds})})
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
                    [int(r) for r in task["state-rounds"]])


def result_content(result: ClientResult):
    return RecordDict({"upload": array_record(result.upload),
                       "result": ConfigRecord({"clients": result.ids.tolist(), "backprops": int(result.backprops)})})


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


def read_result(content, expected: list[int], size: int, wire: tuple[str, ...] = (MODEL,)) -> ClientResult:
    """The clients' result in a node's reply, checked whole: exactly the ``expected`` clients, a float32 model row
    of ``size`` parameters (or, for a compressed upload, the ``wire`` entries that carry it:
    :meth:`fedflat.algorithms.Algorithm.wire_entries`) and a training loss for each, every other upload entry a finite
    floating-point tensor with one row per client. Whatever else a node sends is a :class:`BadReply`, never the
    server's crash."""
    try:
        return _read_result(content, expected, size, wire)
    except BadReply:
        raise
    except Exception as err:  # a reply of any other form: the node's fault, said as such
        raise BadReply(f"the reply cannot be read ({type(err).__name__}: {err})") from None


def _read_result(content, expected: list[int], size: int, wire: tuple[str, ...]) -> ClientResult:
    if "upload" not in content.array_records or "result" not in content.config_records:
        raise BadReply("the reply has no upload")
    clients = [int(c) for c in content["result"]["clients"]]
    if clients != expected:
        raise BadReply(f"the reply is for clients {clients}, the node was sent {expected}")
    upload = tensors(content["upload"])
    missing = sorted({TRAIN_LOSS, *wire} - set(upload))
    if missing:
        raise BadReply(f"the upload lacks {missing}")
    if MODEL in wire and tuple(upload[MODEL].shape) != (len(expected), size):
        raise BadReply(f"the uploaded models have shape {tuple(upload[MODEL].shape)}, "
                       f"expected ({len(expected)}, {size})")
    if MODEL in wire and upload[MODEL].dtype != torch.float32:
        raise BadReply(f"the uploaded models are {upload[MODEL].dtype}, expected torch.float32")
    short = [k for k, v in upload.items() if v.dim() == 0 or v.shape[0] != len(expected)]
    if short:
        raise BadReply(f"upload entries {short} do not have one row per client")
    # (an encoder's integer entries, top-k's indices and QSGD's levels, the server's decoder checks: Algorithm.malformed)
    unusable = [k for k, v in upload.items() if not v.is_floating_point() and k not in wire]
    if unusable:
        raise BadReply(f"upload entries {unusable} are not floating-point tensors")
    broken = [k for k, v in upload.items() if not bool(torch.isfinite(v).all())]
    if broken:
        raise BadReply(f"upload entries {broken} hold NaN or infinite values")
    return ClientResult(torch.tensor(clients, dtype=torch.long), upload, {},
                        int(content["result"]["backprops"]))


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
    return ClientScores(clients, [int(c) for c in correct], [float(x) for x in loss], [int(n) for n in samples])
