"""Domain errors of the federation, shared by broker and node.

Handlers raise these; the broker's servicer turns them into gRPC status codes and the
node's client turns status codes back into them (graft_fed/federation/status.py holds the
one table both use), so neither the handlers nor the node's logic import grpc. Each class
names its canonical status code as a string; anything that is not one of these becomes
INTERNAL with a sanitised message (the details go to the broker's log, not to the caller).
"""

from __future__ import annotations

from graft_fed.errors import GraftFedError


class FederationError(GraftFedError):
    """Base class; as an answer from the broker it means INTERNAL (or a code this project
    does not name, kept in `status`)."""

    #: The canonical gRPC status code name this error travels as.
    status = "INTERNAL"
    #: Retrying the same call later may succeed (the broker was not reached, or was busy).
    transient = False


class InvalidArgument(FederationError):
    status = "INVALID_ARGUMENT"


class NotFound(FederationError):
    status = "NOT_FOUND"


class AlreadyExists(FederationError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(FederationError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(FederationError):
    status = "RESOURCE_EXHAUSTED"


class Unauthenticated(FederationError):
    status = "UNAUTHENTICATED"


class PermissionDenied(FederationError):
    status = "PERMISSION_DENIED"


class Aborted(FederationError):
    """A concurrent request got in the way (the same request is still being processed): retry."""
    status = "ABORTED"
    transient = True


class Unavailable(FederationError):
    """The broker cannot serve the request now (not reachable, or its storage failed);
    retrying later may work."""
    status = "UNAVAILABLE"
    transient = True


class DeadlineExceeded(Unavailable):
    """The broker did not answer within the call's deadline (node side only)."""
    status = "DEADLINE_EXCEEDED"


class StorageFull(ResourceExhausted):
    """The broker's database could not grow (disk full): nothing of the request was stored."""


#: The errors a handler may raise on purpose, by status name (the client maps back with it).
BY_STATUS: dict[str, type[FederationError]] = {
    cls.status: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted,
                                Unauthenticated, PermissionDenied, Aborted, Unavailable, DeadlineExceeded)
}

#: Refusals that retrying cannot change: the request itself is wrong or not allowed.
PERMANENT = (InvalidArgument, FailedPrecondition, PermissionDenied, NotFound)
