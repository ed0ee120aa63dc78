"""Exceptions raised by fusedlayer.Client: one class per gRPC status code the service returns.

Every exception keeps the gRPC ``code`` (a ``grpc.StatusCode``) and the server's ``message``, so
callers can branch on the class (``except fusedlayer.NotFound``) or on ``err.code``. The codes and
their meaning are listed at the top of proto/fusedlayer/v1/fusedlayer.proto.
"""

import re
from typing import Dict, Type

import grpc


class FusedLayerError(Exception):
    """Base class: a call failed with a non-OK gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgument(FusedLayerError):
    """Bad dtype, shape, byte length, missing tensor or hyper-parameter."""


class NotFound(FusedLayerError):
    """Unknown weight set, or the set has no part for this op."""


class AlreadyExists(FusedLayerError):
    """LoadWeights of a name that is loaded, without replace=True."""


class FailedPrecondition(FusedLayerError):
    """The request cannot run in the server's current state."""


class FusedUnavailable(FailedPrecondition):
    """path="require_fused" and the fused path cannot run (or failed).

    ``reason`` is the fallback reason's name as in ExecutionReport / metrics (e.g.
    "hc_mult_unsupported"), ``detail`` the server's explanation.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str, detail: str) -> None:
        super().__init__(code, message)
        self.reason = reason
        self.detail = detail


class ResourceExhausted(FusedLayerError):
    """Message over the size limit, executor queue full, or device/host out of memory (retryable)."""


class DeadlineExceeded(FusedLayerError):
    """The deadline passed before the op was launched."""


class DataLoss(FusedLayerError):
    """LoadWeights checksum mismatch or truncated stream."""


class Unavailable(FusedLayerError):
    """Server unreachable, draining, TLS handshake failed, or op not warmed up yet."""


class Unauthenticated(FusedLayerError):
    """No bearer token, or one the server does not know."""


class PermissionDenied(FusedLayerError):
    """A known token without the method's right (compute / admin)."""


class Internal(FusedLayerError):
    """A kernel failed on both paths: a server bug."""


class Cancelled(FusedLayerError):
    """The call was cancelled (CANCELLED): by this client (an RPC cancelled, a channel closed under a
    call in flight) or by the server. An asyncio task cancelled while awaiting a call of
    fusedlayer.aio raises asyncio.CancelledError, as every coroutine does; the RPC is cancelled with it."""


_BY_CODE: Dict[grpc.StatusCode, Type[FusedLayerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.CANCELLED: Cancelled,
}

# server/dispatcher.cc: "REQUIRE_FUSED: the fused mhc path cannot run (hc_mult_unsupported): <detail>"
# (or "... path failed (fused_kernel_error): <detail>").
_REQUIRE_FUSED = re.compile(r"^REQUIRE_FUSED: the fused \w+ path (?:cannot run|failed) \(([a-z_]+)\): (.*)$", re.S)


def from_rpc_error(err: grpc.RpcError) -> FusedLayerError:
    """grpc.RpcError -> the matching FusedLayerError subclass."""
    # The RpcErrors gRPC raises are also grpc.Call objects.
    return from_status(err.code(), err.details() or "")


# A status code's number (absl and gRPC share them) -> grpc.StatusCode.
_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: grpc.StatusCode, message: str) -> FusedLayerError:
    """A status code and message -> the FusedLayerError subclass for them: an RPC's status, or one a
    call ring's completion record carries (the same class as the RPC of that call would raise)."""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        m = _REQUIRE_FUSED.match(message)
        if m:
            return FusedUnavailable(code, message, reason=m.group(1), detail=m.group(2))
    return _BY_CODE.get(code, FusedLayerError)(code, message)


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a status number (UNKNOWN for a number gRPC does not define)."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
