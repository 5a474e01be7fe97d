"""Domain errors of the federation and the ONE table that maps them to gRPC status codes.

Handlers raise these; the servicer translates them; anything else becomes INTERNAL with
a sanitised message (the details go to the broker's log, not to the caller).
"""

from __future__ import annotations

import grpc

from graft_fed.errors import GraftFedError


class FederationError(GraftFedError):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(FederationError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(FederationError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(FederationError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(FederationError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(FederationError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(FederationError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(FederationError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Aborted(FederationError):
    """A concurrent request got in the way (the same request is still being processed): retry."""
    code = grpc.StatusCode.ABORTED


class Unavailable(FederationError):
    """The broker cannot serve the request now (its storage failed); retrying later may work."""
    code = grpc.StatusCode.UNAVAILABLE


class StorageFull(ResourceExhausted):
    """The broker's database could not grow (disk full): nothing of the request was stored."""


STATUS_OF: dict[type[FederationError], grpc.StatusCode] = {
    cls: cls.code for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition,
                              ResourceExhausted, Unauthenticated, PermissionDenied, Aborted, Unavailable)
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised by a handler."""
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal broker error (see the broker's log)"
