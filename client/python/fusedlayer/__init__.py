"""Python client of the fusedlayer gRPC service.

    import fusedlayer
    with fusedlayer.Client("localhost:50051") as c:
        r = c.mhc_seam("v41-flash/demo", x, residual, post_mix, comb_mix, pre_mix)
        print(r.report.path, r.report.fallback_reason)

README "Python client" documents installation; docs/python-client.md the API.
"""

try:
    from .v1 import fusedlayer_pb2 as _generated  # noqa: F401  (written by setup.py at install time)
except ImportError as e:
    raise ImportError("fusedlayer's generated gRPC stubs are missing: install the package (README, 'Python "
                      "client') instead of importing it from the client/python source folder") from e

from .client import (MAX_CONNECTIONS, Client, DeviceInfo, ExecutionReport, MhcSeamResult, OpCapability,
                     OpenedResidualSession, ServerInfo, SwaNormQuantResult, Tls, TRANSPORTS, Verification,
                     WeightSetInfo, default_connections, read_token_file, target_is_local)
from .dtypes import E4M3FN, E4M3FNUZ, bf16_to_float32, float32_to_bf16, fp8_to_float32, round_to_bf16
from .errors import (AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, FusedLayerError,
                     FusedUnavailable, Internal, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
                     Unauthenticated, Unavailable)
from .weights import PackedWeightSet, pack_arrays, pack_manifest, write_safetensors
from .checkpoint import CheckpointImport, import_checkpoint
from .ring import CallRing, RingCallDescriptor, RingCallResult, RingTensorRef, ring_call_of

__version__ = "0.1.0"

# The public names (explicit, so type checkers in strict mode see them as exported); fusedlayer.aio
# (AsyncClient) and fusedlayer.reference are imported as submodules; fusedlayer.ring holds the call
# ring's layout (constants, structures) besides the names exported here.
__all__ = [
    "Client", "DeviceInfo", "ExecutionReport", "MhcSeamResult", "OpCapability", "OpenedResidualSession",
    "ServerInfo", "SwaNormQuantResult", "Tls",
    "TRANSPORTS", "Verification", "WeightSetInfo", "read_token_file", "target_is_local", "MAX_CONNECTIONS",
    "default_connections",
    "E4M3FN", "E4M3FNUZ", "bf16_to_float32", "float32_to_bf16", "fp8_to_float32", "round_to_bf16",
    "AlreadyExists", "Cancelled", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "FusedLayerError",
    "FusedUnavailable", "Internal", "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
    "Unauthenticated", "Unavailable",
    "PackedWeightSet", "pack_arrays", "pack_manifest", "write_safetensors",
    "CheckpointImport", "import_checkpoint",
    "CallRing", "RingCallDescriptor", "RingCallResult", "RingTensorRef", "ring_call_of",
]
