"""What a roster node's Fleet API requests may carry, checked by the gate (:mod:`fedflat.flower.gate`) before the
SuperLink reads them.

Flower 1.41's SuperLink binds each signed request's ``node`` field to the signer's key (its node-authentication
middleware), but not everything inside it:

- ``push-messages`` stores the messages as sent: it does not check that a message's source is the node that pushes
  it. The gate refuses a ``PushMessagesRequest`` any of whose messages has a ``src_node_id`` other than the
  request's ``node`` (which the SuperLink binds to the signer), so a node cannot push a message in another's name.
  (The SuperLink itself checks that a reply's source is the destination of the message it answers.)
- ``pull-object`` serves any object of a run to any node that names its id, and ``confirm-message-received`` deletes
  any message object a node names. An object's id is the SHA-256 of its content, so a node cannot guess another's
  upload or its personal rows, but it could read or delete one whose id it learned. The gate remembers, per roster
  key, the messages the SuperLink delivered to it (the ``pull-messages`` answers it forwarded: each message's id,
  run and object tree) and passes only a ``pull-object`` of an object of those trees, in that run, and a
  ``confirm-message-received`` of one of those messages (:class:`Deliveries`).

What remains: the gate knows only what passed through it since it started (a node that pulled a message before a
restart of the gate is refused that message's objects: it fails the message, and the round leaves its clients out);
a node may still pull the objects of its own messages as often as it likes; and what a message holds is the
ServerApp's to check (fedflat's server checks every reply: docs/security.md).
"""
from __future__ import annotations

from collections import OrderedDict

KEPT_MESSAGES = 64  # delivered messages remembered per roster key (a SuperNode holds one or two at a time)


def _object_ids(tree) -> set[str]:
    """Every object id of a Flower ``ObjectTree`` (the message's own, its records', arrays', chunks')."""
    ids, stack = set(), [tree]
    while stack:
        node = stack.pop()
        ids.add(node.object_id)
        stack.extend(node.children)
    return ids


class Deliveries:
    """Per roster key, the last :data:`KEPT_MESSAGES` messages the SuperLink delivered to that node: message id ->
    (run id, the object ids of its tree)."""

    def __init__(self, kept: int = KEPT_MESSAGES):
        self.kept = kept
        self.by_key: dict[bytes, OrderedDict[str, tuple[int, frozenset[str]]]] = {}

    def record(self, key: bytes, answer: bytes) -> None:
        """Remembers the messages of a ``PullMessagesResponse`` (``answer``, the SuperLink's) delivered to ``key``."""
        from flwr.proto.fleet_pb2 import PullMessagesResponse

        response = PullMessagesResponse()
        response.ParseFromString(answer)
        messages = self.by_key.setdefault(key, OrderedDict())
        for message, tree in zip(response.messages_list, response.message_object_trees):
            messages[message.metadata.message_id] = (message.metadata.run_id, frozenset(_object_ids(tree)))
            messages.move_to_end(message.metadata.message_id)
        while len(messages) > self.kept:
            messages.popitem(last=False)

    def refusal(self, key: bytes, name: str, body: bytes) -> str:
        """Why the Fleet API request ``name`` (``push-messages``, ``pull-object``, ...) signed by ``key`` with ``body``
        must not reach the SuperLink ('' when it may: every other request, checked by the SuperLink alone)."""
        from google.protobuf.message import DecodeError

        check = {"push-messages": self._push, "pull-object": self._pull,
                 "confirm-message-received": self._confirm}.get(name)
        if check is None:
            return ""
        try:
            return check(key, body)
        except DecodeError:
            return f"its body is not a {name} request of Flower's Fleet API"

    def _push(self, key: bytes, body: bytes) -> str:
        from flwr.proto.fleet_pb2 import PushMessagesRequest

        request = PushMessagesRequest()
        request.ParseFromString(body)
        for message in request.messages_list:
            if message.metadata.src_node_id != request.node.node_id:
                return (f"it pushes a message whose source is node {message.metadata.src_node_id}, not the node "
                        f"{request.node.node_id} that signs it")
        return ""

    def _delivered(self, key: bytes, run: int) -> list[tuple[str, frozenset[str]]]:
        return [(mid, ids) for mid, (run_id, ids) in self.by_key.get(key, {}).items() if run_id == run]

    def _pull(self, key: bytes, body: bytes) -> str:
        from flwr.proto.message_pb2 import PullObjectRequest

        request = PullObjectRequest()
        request.ParseFromString(body)
        if any(request.object_id in ids for _, ids in self._delivered(key, request.run_id)):
            return ""
        return (f"it pulls object {request.object_id[:16]}... of run {request.run_id}, which is in no message the "
                "SuperLink delivered to it through this gate")

    def _confirm(self, key: bytes, body: bytes) -> str:
        from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest

        request = ConfirmMessageReceivedRequest()
        request.ParseFromString(body)
        if any(request.message_object_id == mid for mid, _ in self._delivered(key, request.run_id)):
            return ""
        return (f"it confirms message {request.message_object_id[:16]}... of run {request.run_id}, which the "
                "SuperLink did not deliver to it through this gate")
