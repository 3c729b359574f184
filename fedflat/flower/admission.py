"""Who the gate lets in, and for how long: its limits on connections, request heads and bodies.

``fedflat flower-gate`` serves with uvicorn's h11 protocol (:mod:`fedflat.flower.gate`), which caps a request's head
(``h11_max_incomplete_event_size``) and closes a connection idle between requests (``timeout_keep_alive``). What
uvicorn lacks, this module adds to its protocol (:func:`admission_protocol`), within the
:class:`~fedflat.flower.limits.GateLimits`:

- **connections, overall and per address**, counted from the moment a TCP connection is accepted, before its TLS
  handshake: one beyond ``max_connections``, or beyond ``max_connections_per_address`` from one address (IPv4, or an
  IPv6 /64: one host holds a whole /64), is closed at once. (uvicorn's ``limit_concurrency`` answers 503 only once a
  request's head has arrived, holding the connection, and its open file, until then; its TLS handshakes are not
  counted at all.)
- **the time of a request's head**: TLS is started here with a handshake timeout, and a connection whose head has
  not arrived whole within ``header_timeout`` of its opening (or of a new request's first byte) is closed; a slow
  client cannot hold a connection by trickling its headers.
- **the size and pace of a body** (:func:`read_body`): a declared or streamed body beyond ``max_body_bytes`` is
  refused with 413 before more of it is read, and a body that pauses longer than ``header_timeout`` with 408.

Refused connections are written to standard error, one line per address and reason at most every
:data:`QUIET_S` seconds (with the count of those not written), so a flood cannot fill the operator's disk either.
"""
from __future__ import annotations

import asyncio
import ipaddress
import ssl
import sys
import time
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fedflat.flower.limits import GateLimits

QUIET_S = 10.0  # seconds between two lines about the same address and reason
RECORD_ENTRIES = 4096  # (address, reason) pairs the record remembers; older ones are dropped beyond it


def address_key(host: str) -> str:
    """What a connection from ``host`` counts against: its IPv4 address (an IPv4-mapped IPv6 one too), or its IPv6
    /64 network (one host is given a whole /64)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.version == 6:
        return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Ledger:
    """The gate's open connections (accepted, in their TLS handshake or served), overall and per address."""

    def __init__(self, limits: GateLimits):
        self.limits, self.total, self.by_address = limits, 0, {}

    def admit(self, address: str) -> str:
        """Counts a new connection from ``address``; or, when a limit is reached, why not ('' when admitted)."""
        if self.total >= self.limits.max_connections:
            return f"{self.total} connections are open (--max-connections {self.limits.max_connections})"
        if self.by_address.get(address, 0) >= self.limits.max_connections_per_address:
            return (f"{self.by_address[address]} connections from this address are open "
                    f"(--max-connections-per-address {self.limits.max_connections_per_address})")
        self.total += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return ""

    def release(self, address: str) -> None:
        self.total -= 1
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]


class Record:
    """The gate's standard error: one line per refusal, but at most one per (address, reason) every ``QUIET_S``
    seconds, the next one saying how many were not written meanwhile."""

    def __init__(self, stream=None):
        self.stream = stream
        self.last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (when written, refusals not written since)

    def write(self, address: str, reason: str, line: str) -> None:
        now = time.monotonic()
        written, quiet = self.last.get((address, reason), (-QUIET_S, 0))
        if now - written < QUIET_S:
            self.last[(address, reason)] = (written, quiet + 1)
            return
        if len(self.last) >= RECORD_ENTRIES:
            self.last = {k: v for k, v in self.last.items() if now - v[0] < QUIET_S}
            if len(self.last) >= RECORD_ENTRIES:
                self.last.clear()
        self.last[(address, reason)] = (now, 0)
        more = f" (and {quiet} more like it from this address in the last {now - written:.0f} s)" if quiet else ""
        print(line + more, file=self.stream or sys.stderr, flush=True)


def admission_protocol(limits: GateLimits, tls: ssl.SSLContext, record: Record) -> type:
    """uvicorn's h11 protocol class with the gate's admission (module docstring): what ``uvicorn.Config(http=...)``
    is given. Its TLS comes from ``tls`` (uvicorn itself is given none: the handshake is started here, after the
    connection is counted)."""
    return type("GateProtocol", (Admission,), {"limits": limits, "tls": tls, "record": record,
                                               "ledger": Ledger(limits)})


class Admission(H11Protocol):
    """uvicorn's :class:`~uvicorn.protocols.http.h11_impl.H11Protocol`, admitted by :class:`Ledger` at the TCP
    accept, upgraded to TLS here, and timed until each request's head is in (``header_timeout``)."""

    limits: ClassVar[GateLimits]
    tls: ClassVar[ssl.SSLContext]
    record: ClassVar[Record]
    ledger: ClassVar[Ledger]

    def connection_made(self, transport) -> None:  # the TCP connection, before TLS
        self.address, self.counted, self.head_timer, self.handshake = None, False, None, None
        self.early: list[bytes] | None = []  # what TLS decrypted before uvicorn's connection was made (None: since)
        peer = transport.get_extra_info("peername")
        self.address = address_key(str(peer[0])) if peer else "?"
        refused = self.ledger.admit(self.address)
        if refused:
            self.record.write(self.address, "connections", f"refused a connection from {self.address}: {refused}")
            transport.abort()
            return
        self.counted = True
        transport.pause_reading()  # (until start_tls hands its bytes to TLS: uvloop would give them to h11 first)
        self.handshake = self.loop.create_task(self._secure(transport, self.loop.time()))

    async def _secure(self, raw, opened: float) -> None:
        """TLS on ``raw`` within ``header_timeout``, then uvicorn's connection, its first head due by then too."""
        try:
            if raw.is_closing():
                raise ConnectionResetError("closed before its TLS handshake")
            secure = await self.loop.start_tls(raw, self, self.tls, server_side=True,
                                               ssl_handshake_timeout=self.limits.header_timeout,
                                               ssl_shutdown_timeout=self.limits.header_timeout)
            if secure is None or secure.is_closing():
                raise ConnectionResetError("closed during its TLS handshake")
        except (OSError, RuntimeError) as err:  # (ssl.SSLError and TimeoutError are OSErrors)
            self.record.write(self.address, "handshake", f"closed a connection from {self.address} without a TLS "
                                                         f"handshake within {self.limits.header_timeout:g} s "
                                                         f"(--header-timeout): {type(err).__name__}")
            raw.abort()
            self._release()
            return
        super().connection_made(secure)
        self._time_head(self.limits.header_timeout - (self.loop.time() - opened))
        early, self.early = b"".join(self.early or []), None
        if early:
            self.data_received(early)

    def _time_head(self, seconds: float) -> None:
        self._head_in()
        self.head_timer = self.loop.call_later(max(seconds, 0.0), self._head_late)

    def _head_in(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.record.write(self.address, "head", f"closed a connection from {self.address}: no whole request "
                                                    f"head within {self.limits.header_timeout:g} s (--header-timeout)")
            self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 cannot read (beyond ``max_header_bytes``, or not HTTP/1.1), recorded."""
        self.record.write(self.address, "400", f"closed a connection from {self.address}: its request head is beyond "
                                               f"--max-header-bytes {self.limits.max_header_bytes} or not HTTP/1.1")
        super().send_400_response(msg)

    def data_received(self, data: bytes) -> None:
        if self.early is not None:  # (TLS hands over a request sent with its handshake before start_tls returns)
            self.early.append(data)
            return
        if self.transport.is_closing():  # (TLS still hands over what it had decrypted: h11 would refuse it again)
            return
        if self.head_timer is None and self.conn.their_state is h11.IDLE:  # a new request begins
            self._time_head(self.limits.header_timeout)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its head is in
            self._head_in()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self._head_in()
        if self.transport is not None:  # (uvicorn's connection, once TLS was up)
            super().connection_lost(exc)

    def _release(self) -> None:
        if self.counted:
            self.counted = False
            self.ledger.release(self.address)


class BodyRefused(Exception):
    """A body the gate does not read on: ``status`` 413 (too large) or 408 (paused too long)."""

    def __init__(self, status: int, why: str):
        super().__init__(why)
        self.status = status


async def read_body(receive, declared: str | None, limits: GateLimits) -> bytes:
    """A request's body, read from the ASGI ``receive`` only while it stays within ``max_body_bytes`` (its declared
    ``Content-Length`` first, then what arrives) and no pause exceeds ``header_timeout``: a :class:`BodyRefused`
    otherwise, before the rest is read (uvicorn stops reading the connection while the app does not: at most its
    64 KiB high-water mark waits beyond the bytes read)."""
    cap = limits.max_body_bytes
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise BodyRefused(413, f"its body of {declared} bytes is beyond --max-body-bytes {cap}")
    body = bytearray()
    while True:
        try:
            message = await asyncio.wait_for(receive(), limits.header_timeout)
        except asyncio.TimeoutError:
            raise BodyRefused(408, f"its body paused for more than {limits.header_timeout:g} s "
                                   "(--header-timeout)") from None
        if message["type"] == "http.disconnect":
            raise BodyRefused(400, "the connection closed during its body")
        body += message.get("body", b"")
        if len(body) > cap:
            raise BodyRefused(413, f"its body is beyond --max-body-bytes {cap}")
        if not message.get("more_body", False):
            return bytes(body)
