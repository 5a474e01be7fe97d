"""The one table between the federation's domain errors and gRPC status codes.

The broker's servicer uses `to_status` on what a handler raised; the node's client uses
`from_rpc_error` on what a call raised, so node logic sees domain errors only.
"""

from __future__ import annotations

import grpc

from graft_fed.federation.errors import BY_STATUS, FederationError
from graft_fed.federation.limits import printable

#: What a caller is told about an error the broker did not raise on purpose.
INTERNAL_MESSAGE = "internal broker error (see the broker's log)"


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised by a handler: a domain error's own
    code and message; anything else INTERNAL with a sanitised message."""
    if isinstance(exc, FederationError) and type(exc).status in BY_STATUS:
        return grpc.StatusCode[type(exc).status], str(exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def from_rpc_error(exc: grpc.RpcError, rpc: str = "") -> FederationError:
    """The domain error for a failed call; its message is the broker's, prefixed by the RPC
    (printable: a hostile broker's message ends up in the node's log and on a terminal)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = printable(str((exc.details() if hasattr(exc, "details") else "") or ""))
    name = code.name if code is not None else "UNKNOWN"
    cls = BY_STATUS.get(name)
    if cls is None:
        cls = _CONNECTION.get(name, FederationError)
    err = cls(f"{rpc}: {details}" if rpc else details)
    if name not in BY_STATUS:
        err.status = name  # keep e.g. UNKNOWN or CANCELLED for the log line
    return err


#: Codes that mean the call never got an answer from the broker's logic.
_CONNECTION: dict[str, type[FederationError]] = {
    "CANCELLED": BY_STATUS["UNAVAILABLE"],
}
