"""The limits of ``fedflat flower-gate`` (:mod:`fedflat.flower.gate`), as a user reads and sets them: each one an
option of the command, with a default safe for a federation of a few hundred SuperNodes (docs/flower.md, "The gate's
limits"; docs/security.md for what they bound and what they do not stop)."""
from __future__ import annotations

from dataclasses import dataclass

from fedflat.core import ConfigError


@dataclass(frozen=True)
class GateLimits:
    """The gate's limits, each a ``fedflat flower-gate`` option (docs/flower.md, "The gate's limits").

    ``max_header_bytes``: a request's line and headers (``--max-header-bytes``; Flower's SuperNode sends about 1.5
    KiB). ``header_timeout``: seconds from a connection's opening (its TLS handshake included), or from a new
    request's first byte, until its whole head has arrived; also the longest pause within a body
    (``--header-timeout``). ``max_body_bytes``: a request's body (``--max-body-bytes``; Flower sends arrays in chunks
    of 5 MiB, ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``). ``max_connections``: open connections overall
    (``--max-connections``); ``max_connections_per_address``: from one address (``--max-connections-per-address``;
    SuperNodes behind one NAT share it; a SuperNode keeps one or two). ``idle_timeout``: seconds a connection may
    wait between a response and its next request (``--idle-timeout``). ``signature_window``: the oldest signature
    (``flwr-timestamp``) the gate accepts, in seconds (``--signature-window``; 5 s ahead are allowed for clock
    drift, as Flower does)."""

    max_header_bytes: int = 16 * 1024
    header_timeout: float = 10.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 512
    max_connections_per_address: int = 32
    idle_timeout: float = 5.0
    signature_window: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "header_timeout", "max_body_bytes", "max_connections",
                     "max_connections_per_address", "idle_timeout", "signature_window"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: a limit of the gate is positive")
        if self.max_header_bytes < 4096:
            raise ConfigError(f"--max-header-bytes {self.max_header_bytes}: a SuperNode's request head takes about "
                              "1.5 KiB; give it at least 4096")
        if self.max_connections_per_address > self.max_connections:
            raise ConfigError(f"--max-connections-per-address {self.max_connections_per_address} is above "
                              f"--max-connections {self.max_connections}")
