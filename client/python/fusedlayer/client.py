"""fusedlayer.Client: the hand-written layer over the generated gRPC stubs.

Arrays in and out are numpy: bf16 as uint16 bit patterns, fp32 as float32, fp8 as uint8 codes
(helpers in fusedlayer.dtypes). Every compute result carries the server's ExecutionReport; errors
are the classes of fusedlayer.errors.
"""

import ipaddress
import itertools
import operator
import os
import re
import secrets
import threading
import time
import weakref
from multiprocessing import shared_memory
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc
import numpy as np

from . import _torch, dtypes, errors, weights
from ._health.v1 import health_pb2
from .v1 import fusedlayer_pb2 as pb
from .v1 import fusedlayer_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from . import ring  # imports this module: the ring is imported when one is opened

TRANSPORTS = ("tcp", "shm")
MAX_CONNECTIONS = 64  # as the C++ client's kMaxConnections: a typo must not open hundreds of sockets
_SHM_ALIGNMENT = 64  # the server's rule for tensor offsets in a shared-memory object
_CHUNK_BYTES = 4 << 20  # LoadWeights data chunk: well under any message limit

_PATHS = {"auto": pb.PATH_PREFERENCE_AUTO, "require_fused": pb.PATH_PREFERENCE_REQUIRE_FUSED,
          "force_unfused": pb.PATH_PREFERENCE_FORCE_UNFUSED}
_MODES = {"shifted": pb.MHC_MODE_SHIFTED, "normal": pb.MHC_MODE_NORMAL}
_STAGES = {"seam": pb.MHC_STAGE_SEAM, "first": pb.MHC_STAGE_FIRST, "head": pb.MHC_STAGE_HEAD}
_WIRE_DTYPES: Dict[Any, Tuple[np.dtype, str]] = {  # DataType -> (numpy dtype, what the user passes)
    pb.DATA_TYPE_BF16: (np.dtype("<u2"), "bf16 as uint16 bit patterns (fusedlayer.float32_to_bf16)"),
    pb.DATA_TYPE_FP32: (np.dtype("<f4"), "float32"),
    pb.DATA_TYPE_FP8_E4M3FN: (np.dtype("u1"), "uint8 e4m3fn codes"),
    pb.DATA_TYPE_FP8_E4M3FNUZ: (np.dtype("u1"), "uint8 e4m3fnuz codes"),
}
_HEALTH_STATUS = {v.number: v.name for v in health_pb2.HealthCheckResponse.ServingStatus.DESCRIPTOR.values}


# A tensor handed to or returned by an op: a numpy array, or a torch.Tensor where torch is importable
# (torch is not a dependency, so it is not named in the annotations).
Array = Any

# ExecutionReport.stages' fields (the queue wait is queue_seconds).
_REPORT_STAGES = ("decode", "copy_in", "device", "copy_out", "response")


def _enum_suffix(enum_type: Any, value: int, prefix: str) -> str:
    """FALLBACK_REASON_HC_MULT_UNSUPPORTED -> "hc_mult_unsupported" (the metrics' label)."""
    return enum_type.Name(value)[len(prefix):].lower()


@dataclass(frozen=True)
class ExecutionReport:
    path: str                 # "fused" or "unfused"
    fallback_reason: str      # "none" when fused, else e.g. "client_forced_unfused", "hc_mult_unsupported"
    fallback_detail: str
    backend: str
    device: str
    weight_set: str
    kernel_seconds: float
    queue_seconds: float
    server_seconds: float
    round_trip_seconds: float  # measured by this client: call start to response decoded
    # Where server_seconds went (ExecutionReport.stages, docs/operations.md): "decode", "copy_in",
    # "device", "copy_out", "response" -> seconds; empty from a server that does not send them.
    stages: Dict[str, float] = field(default_factory=dict)
    # Which of the server's devices ran the call (ServerInfo.devices[].device_id); -1 where not known
    # (a call ring's completion record does not carry it).
    device_id: int = -1

    @staticmethod
    def _from_proto(r: Any, round_trip_seconds: float) -> "ExecutionReport":
        return ExecutionReport(
            path=_enum_suffix(pb.ExecutionPath, r.path, "EXECUTION_PATH_"),
            fallback_reason=_enum_suffix(pb.FallbackReason, r.fallback_reason, "FALLBACK_REASON_"),
            fallback_detail=r.fallback_detail, backend=r.backend, device=r.device, weight_set=r.weight_set,
            kernel_seconds=r.kernel_seconds, queue_seconds=r.queue_seconds, server_seconds=r.server_seconds,
            round_trip_seconds=round_trip_seconds,
            stages={name: getattr(r.stages, name) for name in _REPORT_STAGES} if r.HasField("stages") else {},
            device_id=r.device_id)


@dataclass(frozen=True)
class Verification:
    """verify=True: the fused outputs judged against an unfused run (README "Shadow verification")."""
    compared: bool
    reason: str
    mismatch: bool
    outputs: List[Dict[str, Any]]  # per output: output, mismatch, max_abs_diff, max_ulp_distance, ..., rule, detail


@dataclass
class MhcSeamResult:
    """Arrays are numpy (bf16 as uint16 bit patterns), or torch tensors (bf16 as torch.bfloat16) with
    output="torch" or torch inputs."""
    new_residual: Optional[Array]  # bf16 [T, n, C]; None for a session call without return_state
    y: Array                       # bf16 [T, C]
    new_pre_mix: Optional[Array]   # float32 [T, n] (seam/first; None for head)
    new_post_mix: Optional[Array]  # float32 [T, n]
    new_comb_mix: Optional[Array]  # float32 [T, n, n]
    aux: Optional[Array]           # bf16 [T, C] with capture_aux
    report: ExecutionReport
    request_id: str
    verification: Optional[Verification]


@dataclass
class SwaNormQuantResult:
    """Arrays as in MhcSeamResult; fp8 codes are uint8 either way."""
    q_fp8: Array                     # uint8 codes [M, Q] in fp8_format
    q_scale: Array                   # float32 [M, G] or [G, align(M, 4)] per the set's layout
    kv: Array                        # bf16 [M, D]
    q_proj: Optional[Array]          # bf16 [M, N] when the set has wq_b
    fp8_format: str                  # "e4m3fn" or "e4m3fnuz": decode with fusedlayer.fp8_to_float32
    report: ExecutionReport
    request_id: str
    verification: Optional[Verification]


@dataclass(frozen=True)
class OpCapability:
    op: str
    fused_available: bool
    reason: str
    detail: str


@dataclass
class WeightSetInfo:
    name: str
    # Effective hyper-parameters (defaults filled in) with the manifest's keys and enum spellings, so
    # they can be passed back as load_weights(mhc=..., swa=...); None without that part.
    mhc: Optional[Dict[str, Any]]
    swa: Optional[Dict[str, Any]]
    resident_bytes: int
    source: str
    sha256: str
    has_norm_weight: bool
    wq_b_rows: int
    wq_b_implementation: str
    capabilities: Dict[str, OpCapability] = field(default_factory=dict)


@dataclass
class DeviceInfo:
    """One device of the server (--devices): a GPU, or on the CPU backend a share of the host's cores.
    Every loaded weight set is resident on every serving device."""
    device_id: int                 # what device_id= names: the GPU's index in the server, or the CPU device's number
    label: str                     # the metrics' `device` label: "cuda:1", "cpu:0"
    name: str                      # "NVIDIA H200", "cpu (2 threads)"
    arch: str
    serving: bool                  # False: it failed its start-up check and serves nothing (error says why)
    error: str
    lanes: int                     # concurrent lanes (0 on a host-accessible backend)
    resident_bytes: int            # weight bytes held on it
    calls_in_flight: int           # compute calls admitted to it and not yet answered
    ops: Dict[str, OpCapability] = field(default_factory=dict)  # per op: the fused path on this device


@dataclass
class ServerInfo:
    version: str
    backend: str
    device: str
    arch: str
    ops: Dict[str, OpCapability]
    max_receive_message_bytes: int
    max_send_message_bytes: int
    fused_max_tokens: int
    max_tokens: int
    queue_capacity: int
    shared_memory_enabled: bool = False       # --allow_shared_memory
    cuda_shared_memory_enabled: bool = False  # --allow_cuda_shared_memory on a GPU backend
    device_id: int = -1                       # the first serving GPU's id (-1: no GPU); every device: devices
    # Every device the server was started on (--devices): the serving ones in --devices order, then those
    # left out; empty from a server older than several devices per server.
    devices: List[DeviceInfo] = field(default_factory=list)


class OpenedResidualSession(int):
    """What open_residual_session returns: the device bytes the session holds, as an int (all it
    returned before servers had several devices, so it compares and adds as that count), with
    .bytes (the same count) and .device_id, the device that holds the session and runs its calls."""

    device_id: int

    def __new__(cls, held_bytes: int, device_id: int) -> "OpenedResidualSession":
        opened = super().__new__(cls, held_bytes)
        opened.device_id = device_id
        return opened

    @property
    def bytes(self) -> int:
        return int(self)

    def __getnewargs__(self) -> Tuple[int, int]:  # type: ignore[override]  # (pickle, copy) both values
        return int(self), self.device_id

    def __str__(self) -> str:
        return int.__repr__(self)  # the count, as the int it was

    def __repr__(self) -> str:
        return f"OpenedResidualSession(bytes={int(self)}, device_id={self.device_id})"


@dataclass(frozen=True)
class Tls:
    """TLS settings, as fusedctl's --tls_ca / --tls_cert / --tls_key / --tls_server_name.

    ca: PEM bundle to trust (None: the system roots); cert + key: client certificate for mutual TLS;
    server_name: the name to verify in the server certificate instead of the target's host.
    """
    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    server_name: Optional[str] = None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read the file ({e.strerror})") from None


def read_token_file(path: str) -> str:
    """The bearer token in a file holding just the token (surrounding whitespace stripped)."""
    token = _read(path, "token file").decode("ascii", errors="replace").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(ch <= " " or ch > "~" for ch in token):
        # Never quote the token in the message.
        raise ValueError(f"token file {path} must hold just the token (found whitespace or a non-ASCII byte inside)")
    return token


def target_is_local(target: str) -> bool:
    """True for unix: targets and loopback hosts (127.0.0.0/8, ::1, localhost)."""
    t = target
    if t.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
            break
    if t.startswith("["):
        host = t[1:t.find("]")] if "]" in t else t[1:]
    elif t.count(":") == 1:
        host = t.rsplit(":", 1)[0]
    else:
        host = t  # a bare IPv6 address, or a host without a port
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tensor(name: str, array: Any, data_type: Any) -> "pb.Tensor":
    want, what = _WIRE_DTYPES[data_type]
    if _torch.is_tensor(array):  # a CPU torch tensor: a zero-copy view when contiguous
        array = _torch.host_array(name, array, want)
    a = np.asarray(array)
    if a.dtype.kind != want.kind or a.dtype.itemsize != want.itemsize:
        raise TypeError(f"{name} must be {what}, got a {a.dtype} array")
    return pb.Tensor(dtype=data_type, shape=list(a.shape), data=np.ascontiguousarray(a, dtype=want).tobytes())


def _array(t: "pb.Tensor", present: bool = True) -> Optional[np.ndarray]:
    if not present:
        return None
    if t.dtype not in _WIRE_DTYPES:
        raise errors.FusedLayerError(grpc.StatusCode.INTERNAL, f"the server returned a tensor of dtype {t.dtype}")
    np_dtype = _WIRE_DTYPES[t.dtype][0]
    # frombuffer views the immutable bytes; the copy gives the caller an ordinary writable array.
    return np.frombuffer(t.data, dtype=np_dtype).reshape(tuple(t.shape)).astype(np_dtype.newbyteorder("="))


def _aligned(n: int) -> int:
    return (n + _SHM_ALIGNMENT - 1) // _SHM_ALIGNMENT * _SHM_ALIGNMENT


class _SharedMemoryArena:
    """transport="shm": one POSIX shared-memory object (multiprocessing.shared_memory: a random name,
    mode 0600) registered as one region and reused by every call of the client, one call at a time
    (the lock); grown (re-created) when a call needs more. Inputs are copied in and referenced,
    outputs placed there and read back, so no tensor travels in the messages. close() unregisters
    and removes it (and Python's resource tracker removes the object of a process that dies).

    name: the region's name, kept when it grows (a call ring binds its region by name); by default
    each object is registered under a name of its own."""

    def __init__(self, client: "Client", name: Optional[str] = None) -> None:
        self._client = client
        self._name = name
        self._shm: Optional[shared_memory.SharedMemory] = None
        self.lock = threading.Lock()

    @property
    def region(self) -> str:
        if self._name is not None:
            return self._name
        assert self._shm is not None
        return "py-" + self._shm.name.lstrip("/")

    @property
    def buffer(self) -> memoryview:
        """The object's bytes (valid until it grows or is released)."""
        assert self._shm is not None
        return self._shm.buf

    def ensure(self, size: int) -> None:
        if self._shm is not None and self._shm.size >= size:
            return
        self.release()
        self._shm = shared_memory.SharedMemory(create=True, size=max(_aligned(size), 1 << 20))
        try:
            self._client.register_system_shared_memory(self.region, "/" + self._shm.name.lstrip("/"), 0,
                                                       self._shm.size)
        except Exception:
            self._drop()
            raise

    def _drop(self) -> None:
        assert self._shm is not None
        self._shm.close()
        self._shm.unlink()
        self._shm = None

    def release(self) -> None:
        if self._shm is None:
            return
        try:
            self._client.unregister_system_shared_memory(self.region)
        except errors.FusedLayerError:
            pass  # the server is gone or forgot it: nothing left to free there
        self._drop()

    def place(self, request: Any, inputs: Sequence["pb.Tensor"], outputs: Sequence[Tuple[str, int]]) -> None:
        """inputs: the request's inline Tensor fields to move in; outputs: [(name, bytes)]."""
        need = sum(_aligned(len(t.data)) for t in inputs) + sum(_aligned(b) for _, b in outputs)
        self.ensure(need)
        assert self._shm is not None
        at = 0
        for t in inputs:
            n = len(t.data)
            self._shm.buf[at:at + n] = t.data
            t.shared_memory.region, t.shared_memory.offset, t.shared_memory.byte_size = self.region, at, n
            at += _aligned(n)
        for name, n in outputs:
            request.output_placements.add(output=name, shared_memory=pb.SharedMemoryRef(
                region=self.region, offset=at, byte_size=n))
            at += _aligned(n)

    def fetch(self, t: "pb.Tensor") -> None:
        """An output the server wrote into the region, back as inline bytes."""
        if t.WhichOneof("storage") == "shared_memory":
            assert self._shm is not None
            ref = t.shared_memory
            t.data = bytes(self._shm.buf[ref.offset:ref.offset + ref.byte_size])


def _choice(kind: str, value: str, table: Mapping[str, Any]) -> Any:
    if value not in table:
        raise ValueError(f"{kind} = {value!r}; expected one of {', '.join(table)}")
    return table[value]


def _capability(c: Any) -> OpCapability:
    return OpCapability(op=c.op, fused_available=c.fused_available,
                        reason=_enum_suffix(pb.FallbackReason, c.reason, "FALLBACK_REASON_"), detail=c.detail)


def _plain_dict(msg: Any) -> Dict[str, Any]:
    """Every field of a flat message as Python values; enums by their manifest name ("ue8m0")."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.enum_type is not None:
            # Fp8Format.FP8_FORMAT_E4M3FN -> "e4m3fn": the spelling of the manifest's keys (docs/weights.md).
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", f.enum_type.name).upper() + "_"
            value = f.enum_type.values_by_number[value].name[len(prefix):].lower()
        out[f.name] = value
    return out


def _weight_set_info(w: Any) -> WeightSetInfo:
    return WeightSetInfo(
        name=w.name, mhc=_plain_dict(w.mhc) if w.HasField("mhc") else None,
        swa=_plain_dict(w.swa) if w.HasField("swa") else None, resident_bytes=w.resident_bytes, source=w.source,
        sha256=w.sha256, has_norm_weight=w.has_norm_weight, wq_b_rows=w.wq_b_rows,
        wq_b_implementation=w.wq_b_implementation, capabilities={c.op: _capability(c) for c in w.capabilities})


def _verification(response: Any) -> Optional[Verification]:
    if not response.HasField("verification"):
        return None
    v = response.verification
    return Verification(compared=v.compared, reason=v.reason, mismatch=v.mismatch,
                        outputs=[_plain_dict(o) for o in v.outputs])


def _device_info(d: Any) -> DeviceInfo:
    return DeviceInfo(device_id=d.device_id, label=d.label, name=d.name, arch=d.arch, serving=d.serving, error=d.error,
                      lanes=d.lanes, resident_bytes=d.resident_bytes, calls_in_flight=d.calls_in_flight,
                      ops={c.op: _capability(c) for c in d.ops})


def _server_info(r: Any) -> ServerInfo:
    return ServerInfo(version=r.version, backend=r.backend, device=r.device, arch=r.arch,
                      ops={c.op: _capability(c) for c in r.ops},
                      max_receive_message_bytes=r.max_receive_message_bytes,
                      max_send_message_bytes=r.max_send_message_bytes, fused_max_tokens=r.fused_max_tokens,
                      max_tokens=r.max_tokens, queue_capacity=r.queue_capacity,
                      shared_memory_enabled=r.shared_memory_enabled,
                      cuda_shared_memory_enabled=r.cuda_shared_memory_enabled, device_id=r.device_id,
                      devices=[_device_info(d) for d in r.devices])


def _open_session_request(name: str, tokens: int, hc_mult: int, hidden: int,
                          device_id: Optional[int]) -> "pb.OpenResidualSessionRequest":
    req = pb.OpenResidualSessionRequest(name=name, tokens=tokens, hc_mult=hc_mult, hidden=hidden)
    _set_device_id(req, device_id)
    return req


def _opened_session(r: "pb.OpenResidualSessionResponse") -> OpenedResidualSession:
    return OpenedResidualSession(int(r.bytes), int(r.device_id))


_INT32_MAX = (1 << 31) - 1


def _set_device_id(req: Any, device_id: Optional[int]) -> None:
    """device_id= on a request (its optional field set only for an int; None leaves it absent: the
    server picks the device). An id the server does not serve on is its INVALID_ARGUMENT."""
    if device_id is None:
        return
    if isinstance(device_id, bool):
        raise TypeError("device_id must be an int (a ServerInfo.devices[].device_id) or None, got a bool")
    try:
        value = operator.index(device_id)
    except TypeError:
        raise TypeError(f"device_id must be an int (a ServerInfo.devices[].device_id) or None, "
                        f"got {type(device_id).__name__}") from None
    if not -_INT32_MAX - 1 <= value <= _INT32_MAX:
        raise ValueError(f"device_id = {value} is outside int32")
    req.device_id = value


# ---- request building and response decoding, shared by Client and fusedlayer.aio.AsyncClient ----

_MHC_INPUTS = ("x", "residual", "post_mix", "comb_mix", "pre_mix")
_MHC_OUTPUTS = ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux")
_SWA_OUTPUTS = ("q_fp8", "q_scale", "kv", "q_proj")
# mHC seam inputs and their wire dtypes, in request order.
_MHC_INPUT_TYPES = (("x", pb.DATA_TYPE_BF16), ("residual", pb.DATA_TYPE_BF16), ("post_mix", pb.DATA_TYPE_FP32),
                    ("comb_mix", pb.DATA_TYPE_FP32), ("pre_mix", pb.DATA_TYPE_FP32))

WeightSource = Union[str, "os.PathLike[str]", Mapping[str, np.ndarray]]


def _mhc_request(weight_set: str, inputs: Mapping[str, Any], mode: str, stage: str, path: str, capture_aux: bool,
                 verify: bool, request_id: str, session: str, return_state: bool,
                 device_id: Optional[int] = None) -> "pb.MhcSeamRequest":
    req = pb.MhcSeamRequest(weight_set=weight_set, stage=_choice("stage", stage, _STAGES),
                            mode=_choice("mode", mode, _MODES), path_preference=_choice("path", path, _PATHS),
                            capture_aux=capture_aux, verify=verify, request_id=request_id, session=session,
                            return_state=return_state)
    _set_device_id(req, device_id)
    for name, data_type in _MHC_INPUT_TYPES:
        value = inputs.get(name)
        if value is not None and not _torch.is_cuda(value):
            getattr(req, name).CopyFrom(_tensor(name, value, data_type))
    return req


def _mhc_placed_outputs(req: "pb.MhcSeamRequest", mhc: Optional[Dict[str, Any]],
                        capture_aux: bool) -> List[Tuple[str, int]]:
    """(output, bytes) of every output of a seam, for placing them in shared memory."""
    if mhc is None:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {req.weight_set!r} has no mHC part")
    shapes = _mhc_output_shapes(req, mhc, capture_aux)
    return [(name, int(np.prod(shape)) * _OUTPUT_WIRE[name].itemsize) for name, shape in shapes.items()]


# Wire dtype of every output.
_OUTPUT_WIRE: Dict[str, np.dtype] = {"new_residual": np.dtype("<u2"), "y": np.dtype("<u2"), "aux": np.dtype("<u2"),
                "new_pre_mix": np.dtype("<f4"), "new_post_mix": np.dtype("<f4"), "new_comb_mix": np.dtype("<f4"),
                "q_fp8": np.dtype("u1"), "q_scale": np.dtype("<f4"), "kv": np.dtype("<u2"), "q_proj": np.dtype("<u2")}


def _mhc_output_shapes(req: "pb.MhcSeamRequest", mhc: Dict[str, Any], capture_aux: bool) -> Dict[str, Tuple[int, ...]]:
    """The shape of every output a seam returns (T from x: inline, in shared memory or on the device)."""
    T, n, C = req.x.shape[0], mhc["hc_mult"], mhc["hidden"]
    state = not req.session or req.return_state
    shapes: Dict[str, Tuple[int, ...]] = {}
    if state:
        shapes["new_residual"] = (T, n, C)
    shapes["y"] = (T, C)
    if state and req.stage != pb.MHC_STAGE_HEAD:
        shapes.update(new_pre_mix=(T, n), new_post_mix=(T, n), new_comb_mix=(T, n, n))
    if capture_aux:
        shapes["aux"] = (T, C)
    return shapes


def _output(r: Any, name: str, kind: str, placed: Mapping[str, Any]) -> Array:
    """One output of a response as the caller asked: numpy, or torch (on the device when it was placed
    in CUDA shared memory). None when the response has no such output."""
    if name in placed:
        t = placed[name]
        return t if kind == "torch" else _torch.host_array(name, t.cpu(), _OUTPUT_WIRE[name])
    a = _array(getattr(r, name), r.HasField(name))
    return _torch.to_torch(a) if kind == "torch" else a


def _mhc_result(r: "pb.MhcSeamResponse", elapsed: float, kind: str = "numpy",
                placed: Mapping[str, Any] = {}) -> MhcSeamResult:
    out = {name: _output(r, name, kind, placed) for name in _MHC_OUTPUTS}
    return MhcSeamResult(**out, report=ExecutionReport._from_proto(r.report, elapsed), request_id=r.request_id,
                         verification=_verification(r))


def _swa_request(weight_set: str, qr_kv: Any, path: str, verify: bool, request_id: str,
                 device_id: Optional[int] = None) -> "pb.SwaNormQuantRequest":
    req = pb.SwaNormQuantRequest(weight_set=weight_set, path_preference=_choice("path", path, _PATHS),
                                 verify=verify, request_id=request_id)
    _set_device_id(req, device_id)
    if not _torch.is_cuda(qr_kv):
        req.qr_kv.CopyFrom(_tensor("qr_kv", qr_kv, pb.DATA_TYPE_BF16))
    return req


def _swa_placed_outputs(req: "pb.SwaNormQuantRequest", swa: Optional[Dict[str, Any]],
                        wq_b_rows: int) -> List[Tuple[str, int]]:
    if swa is None:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {req.weight_set!r} has no SWA part")
    shapes = _swa_output_shapes(req, swa, wq_b_rows)
    return [(name, int(np.prod(shape)) * _OUTPUT_WIRE[name].itemsize) for name, shape in shapes.items()]


def _swa_output_shapes(req: "pb.SwaNormQuantRequest", swa: Dict[str, Any],
                       wq_b_rows: int) -> Dict[str, Tuple[int, ...]]:
    M, Q, D, G = req.qr_kv.shape[0], swa["q_rank"], swa["head_dim"], swa["q_rank"] // 128
    shapes: Dict[str, Tuple[int, ...]] = {
        "q_fp8": (M, Q), "q_scale": (M, G) if swa["scale_layout"] == "row_major" else (G, (M + 3) // 4 * 4),
        "kv": (M, D)}
    if wq_b_rows:
        shapes["q_proj"] = (M, wq_b_rows)
    return shapes


def _swa_result(r: "pb.SwaNormQuantResponse", elapsed: float, kind: str = "numpy",
                placed: Mapping[str, Any] = {}) -> SwaNormQuantResult:
    out = {name: _output(r, name, kind, placed) for name in _SWA_OUTPUTS}
    return SwaNormQuantResult(
        **out,
        fp8_format=dtypes.E4M3FNUZ if r.q_fp8.dtype == pb.DATA_TYPE_FP8_E4M3FNUZ else dtypes.E4M3FN,
        report=ExecutionReport._from_proto(r.report, elapsed), request_id=r.request_id,
        verification=_verification(r))


def _packed_sets(source: WeightSource, name: Optional[str], mhc: Optional[Mapping[str, Any]],
                 swa: Optional[Mapping[str, Any]], replace: bool) -> List[weights.PackedWeightSet]:
    """load_weights' sources packed (every set, before anything is sent)."""
    if isinstance(source, (str, os.PathLike)):
        if name is not None or mhc is not None or swa is not None:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                         "name/mhc/swa come from the manifest; pass them only with a dict of arrays")
        packed = weights.pack_manifest(os.fspath(source), replace=replace)
        if not packed:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{os.fspath(source)} lists no weight sets")
        return packed
    if isinstance(source, Mapping):
        if not name:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "load_weights(dict of arrays) needs name=")
        return [weights.pack_arrays(name, source, mhc=mhc, swa=swa, replace=replace)]
    raise TypeError(f"load_weights takes a manifest path or a dict of arrays, got {type(source).__name__}")


def _manifest_path(source: WeightSource) -> Optional[str]:
    """The manifest's path when load_weights was given one (its sets load all or none), else None."""
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else None


def _stage_id() -> str:
    """A fresh stage id (WeightSetHeader.stage) for the sets of one manifest load, random like fusedctl
    load's (the set-name rules: [A-Za-z0-9._/-]{1,128})."""
    return f"py-load-{secrets.token_hex(16)}"


_ALL_OR_NONE = "nothing was loaded: the manifest loads all its sets or none"
# Codes of a call whose answer may have been lost after the server acted on it.
_OUTCOME_UNKNOWN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.UNKNOWN)


def _in_load(err: errors.FusedLayerError, message: str) -> errors.FusedLayerError:
    """err (its class and .code kept) with .message rewritten to say where the staged load stopped."""
    err.message = message
    err.args = (f"{err.code.name}: {message}",)
    return err


def _upload_failed(err: errors.FusedLayerError, packed: weights.PackedWeightSet) -> errors.FusedLayerError:
    return _in_load(err, f'loading "{packed.header.name}": {err.message} ({_ALL_OR_NONE})')


def _commit_failed(err: errors.FusedLayerError, count: int, manifest: str) -> errors.FusedLayerError:
    if err.code == grpc.StatusCode.UNIMPLEMENTED:
        # A server older than staged loads ignores WeightSetHeader.stage: it published each set as it came.
        return _in_load(err, f"publishing the {count} set(s) of {manifest}: the server has no CommitWeightSets "
                        f"(older than staged loads: it loaded each set as it was uploaded) {err.message}".rstrip())
    if err.code in _OUTCOME_UNKNOWN:
        # The server may have published the sets before the answer was lost.
        return _in_load(err, f"publishing the {count} set(s) of {manifest}: {err.message} (the commit's outcome is "
                        "unknown: all of the sets or none of them were loaded; list_weight_sets() tells)")
    return _in_load(err, f"publishing the {count} set(s) of {manifest}: {err.message} (nothing was loaded)")


def _in_manifest_order(packed: Sequence[weights.PackedWeightSet],
                       r: "pb.CommitWeightSetsResponse") -> List[WeightSetInfo]:
    """CommitWeightSets' infos (by name) in the manifest's order, as load_weights returns them."""
    by_name = {w.name: _weight_set_info(w) for w in r.weight_sets}
    names = [p.header.name for p in packed]
    if set(names) != set(by_name):
        return list(by_name.values())
    return [by_name[n] for n in names]


def _weight_chunks(packed: weights.PackedWeightSet, stage: str = "") -> Iterator["pb.WeightChunk"]:
    first = pb.WeightChunk()
    first.header.CopyFrom(packed.header)
    if stage:
        first.header.stage = stage
    first.data = packed.payload[:_CHUNK_BYTES]
    yield first
    for off in range(_CHUNK_BYTES, len(packed.payload), _CHUNK_BYTES):
        yield pb.WeightChunk(data=packed.payload[off:off + _CHUNK_BYTES])


def _cuda_inputs(inputs: Mapping[str, Any], types: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """The CUDA tensors among a call's inputs: name -> (tensor, wire DataType); checks their dtypes."""
    cuda = {}
    for name, value in inputs.items():
        if _torch.is_cuda(value):
            want, what = _WIRE_DTYPES[types[name]]
            torch = _torch.loaded()
            if value.dtype != (torch.bfloat16 if want.itemsize == 2 else torch.float32):
                raise TypeError(f"{name} must be {what} (a torch tensor: "
                                f"{'torch.bfloat16' if want.itemsize == 2 else 'torch.float32'}), got {value.dtype}")
            cuda[name] = (value, types[name])
    if cuda and len(cuda) != sum(v is not None for v in inputs.values()):
        raise TypeError("a call's inputs are all CUDA tensors or none is (CUDA shared memory carries the device ones, "
                        f"the message the others); CUDA: {', '.join(cuda)}")
    return cuda


ConfigEntry = Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], int]


def _mhc_cuda_shapes(req: "pb.MhcSeamRequest", cuda: Mapping[str, Tuple[Any, Any]], config: ConfigEntry,
                     capture_aux: bool) -> Dict[str, Tuple[int, ...]]:
    if config[0] is None:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {req.weight_set!r} has no mHC part")
    req.x.shape[:] = list(cuda["x"][0].shape)  # T for the output shapes (the CUDA path fills x's ref later)
    return _mhc_output_shapes(req, config[0], capture_aux)


def _swa_cuda_shapes(req: "pb.SwaNormQuantRequest", cuda: Mapping[str, Tuple[Any, Any]],
                     config: ConfigEntry) -> Dict[str, Tuple[int, ...]]:
    if config[1] is None:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {req.weight_set!r} has no SWA part")
    req.qr_kv.shape[:] = list(cuda["qr_kv"][0].shape)
    return _swa_output_shapes(req, config[1], config[2])


def _cuda_prepare(regions: "_torch.CudaRegions", enabled: bool, target: str, req: Any,
                  cuda: Dict[str, Tuple[Any, Any]],
                  shapes: Dict[str, Tuple[int, ...]]) -> Tuple[List[Tuple[str, bytes, int, int, int]], Dict[str, Any]]:
    """A request's CUDA inputs referenced and its outputs placed in CUDA shared memory: (registrations to
    make first, output tensors). FailedPrecondition, before anything is registered, when the server
    does not accept CUDA shared memory."""
    if not enabled:
        raise errors.FailedPrecondition(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"CUDA tensors travel by CUDA shared memory, which the server at {target} does not accept (it needs "
            "--allow_cuda_shared_memory on a GPU backend, on this host); pass CPU tensors (tensor.cpu()) instead")
    device = next(iter(cuda.values()))[0].device
    outputs = [(n, int(np.prod(shape)) * _OUTPUT_WIRE[n].itemsize) for n, shape in shapes.items()]
    return _torch.cuda_inputs_and_outputs(regions, req, cuda, outputs, _OUTPUT_WIRE, shapes, device)


def _remember_configs(configs: Dict[str, ConfigEntry], sets: Sequence[WeightSetInfo], weight_set: str) -> ConfigEntry:
    for w in sets:
        configs[w.name] = (w.mhc, w.swa, w.wq_b_rows)
    if weight_set not in configs:
        raise errors.NotFound(grpc.StatusCode.NOT_FOUND, f"weight set {weight_set!r} is not loaded")
    return configs[weight_set]


def _health_status(r: Any) -> str:
    return _HEALTH_STATUS.get(r.status, str(r.status))


TlsArg = Union[None, bool, Tls, Mapping[str, Optional[str]]]


def _metadata(target: str, tls: TlsArg,
              token_file: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    if token_file is None:
        return ()
    if not tls and not target_is_local(target):
        raise ValueError(f"a bearer token without TLS would cross the network in clear text to {target}: "
                         "pass tls=... or use a loopback / unix: target")
    return (("authorization", "Bearer " + read_token_file(token_file)),)


def default_connections(target: str, expected_concurrency: int) -> int:
    """The pool size ``connections=0`` picks, as the C++ client's DefaultConnections.

    1 for a unix: / unix-abstract: target (one local socket, no TCP to spread over); otherwise one
    connection per 4 expected concurrent calls, rounded up, at most 8: a caller spends part of each
    call away from the socket, so a few callers keep one connection busy, and a very concurrent
    caller should not open dozens of sockets on a shared server by default.
    """
    if target.startswith(("unix:", "unix-abstract:")):
        return 1
    return min(8, (max(expected_concurrency, 1) + 3) // 4)


def _pool_size(target: str, connections: int, expected_concurrency: int) -> int:
    """The number of channels a Client or AsyncClient makes (ValueError for a count out of range)."""
    if isinstance(connections, bool) or not isinstance(connections, int) or not 0 <= connections <= MAX_CONNECTIONS:
        raise ValueError(f"connections = {connections!r} is outside 0..{MAX_CONNECTIONS} "
                         "(0: chosen from expected_concurrency)")
    if isinstance(expected_concurrency, bool) or not isinstance(expected_concurrency, int) or expected_concurrency < 1:
        raise ValueError(f"expected_concurrency = {expected_concurrency!r} must be an integer of at least 1")
    return connections or default_connections(target, expected_concurrency)


def _channel_args(tls: TlsArg, max_message_bytes: int, options: Sequence[Tuple[str, Any]],
                  connections: int = 1) -> Tuple[Optional[grpc.ChannelCredentials], List[Tuple[str, Any]]]:
    """(credentials or None for plaintext, channel options) of a Client or AsyncClient's channels."""
    # Both limits explicit (gRPC's receive default is 4 MiB), matching the server's flag.
    channel_options: List[Tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes),
                                              ("grpc.max_send_message_length", max_message_bytes)] + list(options)
    if connections > 1:
        # gRPC puts channels with equal options on one shared connection (its global subchannel
        # pool); a pool of its own per channel gives each channel its own connection.
        channel_options.append(("grpc.use_local_subchannel_pool", 1))
    if not tls:
        return None, channel_options
    t = tls if isinstance(tls, Tls) else Tls(**tls) if isinstance(tls, Mapping) else Tls()
    if (t.cert is None) != (t.key is None):
        raise ValueError("a TLS client certificate and its key must be given together")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(t.ca, "TLS CA") if t.ca else None,
        private_key=_read(t.key, "TLS client key") if t.key else None,
        certificate_chain=_read(t.cert, "TLS client certificate") if t.cert else None)
    if t.server_name:
        channel_options.append(("grpc.ssl_target_name_override", t.server_name))
    return credentials, channel_options


class Client:
    """A connection to one fusedlayer server (or a load-balanced target).

    target: any gRPC target ("host:port", "dns:///svc:50051", "unix:/path").
    tls: None/False for plaintext, True for TLS with the system roots, or a ``Tls`` (or a dict with
        its fields) for a private CA, mutual TLS or a server-name override.
    token_file: file holding a bearer token, sent as ``authorization: Bearer ...`` on every call.
        Without TLS it is refused unless the target is loopback or unix: (the server accepts tokens
        without TLS only there too; docs/security.md).
    transport: how tensors travel: "tcp" (inside the gRPC messages) or "shm" (same host, a server
        started with --allow_shared_memory: through a POSIX shared-memory object the client creates
        and registers on first use; calls of one client then run one at a time; see
        docs/operations.md "Shared-memory transport").
    timeout: default per-call deadline in seconds (None: no deadline); each method also takes one.
    connections: how many TCP connections the calls are spread over, round robin, 0..64. gRPC puts
        every channel with equal options on one shared connection, which carries one frame at a time,
        so calls from many threads with megabytes of tensors queue behind each other on it; with N > 1
        the client opens N channels that each have a connection of their own. 0 (default):
        ``default_connections(target, expected_concurrency)``; 1: one channel, as before.
    expected_concurrency: how many calls the caller expects to have in flight at once (>= 1), what
        connections=0 sizes the pool from; the default 1 keeps one connection.
    """

    def __init__(self, target: str, tls: TlsArg = None, token_file: Optional[str] = None, transport: str = "tcp",
                 timeout: Optional[float] = 60.0, max_message_bytes: int = 1 << 30,
                 options: Sequence[Tuple[str, Any]] = (), connections: int = 0,
                 expected_concurrency: int = 1) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport = {transport!r} is not implemented yet (available: {', '.join(TRANSPORTS)})")
        if not target:
            raise ValueError("target is empty (expected host:port)")
        self.target = target
        self.transport = transport
        self._arena = _SharedMemoryArena(self) if transport == "shm" else None
        # weight set -> (mhc, swa, wq_b_rows), for sizing shared-memory outputs
        self._configs: Dict[str, Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], int]] = {}
        self.timeout = timeout
        self._metadata = _metadata(target, tls, token_file)
        self._cuda_regions = _torch.CudaRegions(f"py-cuda-{os.getpid()}-{id(self):x}")
        self._cuda_enabled: Optional[bool] = None  # the server's cuda_shared_memory_enabled, asked once
        self._cuda_lock = threading.Lock()
        self._rings: "weakref.WeakSet[ring.CallRing]" = weakref.WeakSet()  # closed with the client
        pool = _pool_size(target, connections, expected_concurrency)
        credentials, channel_options = _channel_args(tls, max_message_bytes, options, pool)
        if credentials is not None:
            self._channels = [grpc.secure_channel(target, credentials, options=channel_options) for _ in range(pool)]
        else:
            self._channels = [grpc.insecure_channel(target, options=channel_options) for _ in range(pool)]
        self._stubs = [pb_grpc.FusedLayerStub(channel) for channel in self._channels]
        self._health_checks = [channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString) for channel in self._channels]
        # next() of an itertools.count is atomic under the GIL: threads sharing the client each get
        # their own turn.
        self._turns = itertools.count()

    @property
    def connections(self) -> int:
        """How many connections (channels) the calls are spread over."""
        return len(self._channels)

    def _member(self) -> int:
        """The index of the channel the next call uses, round robin."""
        return 0 if len(self._channels) == 1 else next(self._turns) % len(self._channels)

    @property
    def _stub(self) -> pb_grpc.FusedLayerStub:
        return self._stubs[self._member()]

    @property
    def _health_check(self) -> Callable[..., Any]:
        return self._health_checks[self._member()]

    def close(self) -> None:
        for r in list(self._rings):
            r.close()
        if self._arena is not None:
            self._arena.release()
        for name in self._cuda_regions.names():
            try:
                self.unregister_cuda_shared_memory(name)
            except errors.FusedLayerError:
                pass  # the server is gone or forgot it
        self._cuda_regions.clear()
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., Any], request: Any, timeout: Optional[float]) -> Any:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    # ---- ops ---------------------------------------------------------------------------------

    def mhc_seam(self, weight_set: str, x: Array, residual: Optional[Array] = None, post_mix: Optional[Array] = None,
                 comb_mix: Optional[Array] = None, pre_mix: Optional[Array] = None, mode: str = "shifted",
                 stage: str = "seam", path: str = "auto", capture_aux: bool = False, verify: bool = False,
                 request_id: str = "", timeout: Optional[float] = None, session: str = "",
                 return_state: bool = False, output: Optional[str] = None,
                 device_id: Optional[int] = None) -> MhcSeamResult:
        """One mHC seam (docs/spec/mhc.md).

        stage "seam"/"head": x = sublayer output bf16 [T, C], residual bf16 [T, n, C], post_mix fp32
        [T, n], comb_mix fp32 [T, n, n], pre_mix fp32 [T, n] (shifted mode; None selects stream 0).
        stage "first": x = the embedding bf16 [T, C]; residual and the mixes are not sent.
        path "require_fused" raises FusedUnavailable (with .reason) instead of falling back.
        session: a residual session of this caller (open_residual_session): residual and the mixes
        come from it and the new ones stay there, so only x is sent and y returned (new_residual and
        the mixes are None unless return_state). Sent inline whatever the client's transport.
        Arrays: numpy, or torch tensors (module docstring); output "numpy" / "torch" / None (like the
        inputs). CUDA tensors go by CUDA shared memory and the outputs come back on their device.
        device_id: run on that device of the server (ServerInfo.devices; InvalidArgument for one it
        does not serve on, or one other than that of the call's CUDA tensors or session); None: on
        the device of the CUDA tensors or of the session, else the least-loaded one.
        report.device_id says which device ran the call.
        """
        inputs = dict(x=x, residual=residual, post_mix=post_mix, comb_mix=comb_mix, pre_mix=pre_mix)
        kind = _torch.output_kind(output, inputs.values())
        req = _mhc_request(weight_set, inputs, mode, stage, path, capture_aux, verify, request_id, session,
                           return_state, device_id)
        cuda = _cuda_inputs(inputs, dict(_MHC_INPUT_TYPES))
        if cuda:
            shapes = _mhc_cuda_shapes(req, cuda, self._config(weight_set), capture_aux)
            r, elapsed, placed = self._cuda_call(self._stub.MhcSeam, req, cuda, shapes, timeout)
            return _mhc_result(r, elapsed, kind, placed)
        if self._arena is None or session:
            start = time.perf_counter()
            r = self._call(self._stub.MhcSeam, req, timeout)
            elapsed = time.perf_counter() - start
        else:
            outputs = _mhc_placed_outputs(req, self._config(weight_set)[0], capture_aux)
            inline = [getattr(req, f) for f in _MHC_INPUTS if req.HasField(f)]
            with self._arena.lock:
                self._arena.place(req, inline, outputs)
                start = time.perf_counter()
                r = self._call(self._stub.MhcSeam, req, timeout)
                elapsed = time.perf_counter() - start
                for f in _MHC_OUTPUTS:
                    self._arena.fetch(getattr(r, f))
        return _mhc_result(r, elapsed, kind)

    def swa_norm_quant(self, weight_set: str, qr_kv: Array, path: str = "auto", verify: bool = False,
                       request_id: str = "", timeout: Optional[float] = None,
                       output: Optional[str] = None, device_id: Optional[int] = None) -> SwaNormQuantResult:
        """SWA q/kv RMSNorm + q FP8 1x128 group quant (+ wq_b) (docs/spec/swa.md).

        qr_kv: bf16 [M, S], S >= Q + D: q = columns [0, Q), kv = [Q, Q + D). Arrays, output and
        device_id as for mhc_seam.
        """
        kind = _torch.output_kind(output, [qr_kv])
        req = _swa_request(weight_set, qr_kv, path, verify, request_id, device_id)
        cuda = _cuda_inputs({"qr_kv": qr_kv}, {"qr_kv": pb.DATA_TYPE_BF16})
        if cuda:
            shapes = _swa_cuda_shapes(req, cuda, self._config(weight_set))
            r, elapsed, placed = self._cuda_call(self._stub.SwaNormQuant, req, cuda, shapes, timeout)
            return _swa_result(r, elapsed, kind, placed)
        if self._arena is None:
            start = time.perf_counter()
            r = self._call(self._stub.SwaNormQuant, req, timeout)
            elapsed = time.perf_counter() - start
        else:
            _, swa, wq_b_rows = self._config(weight_set)
            outputs = _swa_placed_outputs(req, swa, wq_b_rows)
            with self._arena.lock:
                self._arena.place(req, [req.qr_kv], outputs)
                start = time.perf_counter()
                r = self._call(self._stub.SwaNormQuant, req, timeout)
                elapsed = time.perf_counter() - start
                for f in _SWA_OUTPUTS:
                    self._arena.fetch(getattr(r, f))
        return _swa_result(r, elapsed, kind)

    def _cuda_call(self, method: Callable[..., Any], req: Any, cuda: Dict[str, Tuple[Any, Any]],
                   shapes: Dict[str, Tuple[int, ...]],
                   timeout: Optional[float]) -> Tuple[Any, float, Dict[str, Any]]:
        """A call whose inputs are CUDA tensors: they and the outputs (fresh device tensors) go by CUDA
        shared memory, each allocation registered once (cached until close)."""
        placed = self._cuda_place(req, cuda, shapes, timeout)
        start = time.perf_counter()
        r = self._call(method, req, timeout)
        return r, time.perf_counter() - start, placed

    def _cuda_place(self, req: Any, cuda: Dict[str, Tuple[Any, Any]], shapes: Dict[str, Tuple[int, ...]],
                    timeout: Optional[float]) -> Dict[str, Any]:
        """req's CUDA inputs referenced and its outputs placed in CUDA shared memory (the allocations
        registered first); returns the output tensors."""
        with self._cuda_lock:
            if self._cuda_enabled is None:
                self._cuda_enabled = self.server_info(timeout).cuda_shared_memory_enabled
            registrations, placed = _cuda_prepare(self._cuda_regions, self._cuda_enabled, self.target, req, cuda,
                                                  shapes)
            for reg in registrations:
                try:
                    self.register_cuda_shared_memory(*reg, timeout=timeout)
                except errors.FusedLayerError:
                    self._cuda_regions.forget(reg[0])
                    raise
        return placed

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, source: WeightSource, name: Optional[str] = None, mhc: Optional[Mapping[str, Any]] = None,
                     swa: Optional[Mapping[str, Any]] = None, replace: bool = False,
                     timeout: Optional[float] = None) -> List[WeightSetInfo]:
        """Uploads weight sets over LoadWeights (SHA-256 checked by the server); returns their infos.

        source: a manifest path (docs/weights.md: every set in it is loaded, all or none; the infos
        come in the manifest's order), or a dict of numpy arrays named as in docs/weights.md
        ("mhc.fn", ...) with name= and mhc= and/or swa= config dicts. replace=True swaps an existing
        set of the same name atomically.

        A manifest loads like ``fusedctl load``: every set is uploaded under one random stage id
        (WeightSetHeader.stage; the server builds it without publishing it), then CommitWeightSets
        publishes them all in one step. A set the server refuses, or a refused commit, discards the
        stage (best effort; the server also drops abandoned stages) and raises; the loaded sets are
        then those before the call. A dict of arrays is one set, sent by one LoadWeights.

        Errors carry the gRPC code the server's loader would answer with, whether found here or by
        the server: NotFound (a missing manifest, file or tensor), InvalidArgument (anything
        malformed, a manifest without sets), AlreadyExists, ... Every set is packed and checked
        before the first is sent.
        """
        packed = _packed_sets(source, name, mhc, swa, replace)
        manifest = _manifest_path(source)
        if manifest is None:
            return [self.upload(p, timeout) for p in packed]
        stage = _stage_id()
        try:
            for p in packed:
                try:
                    self.upload(p, timeout, stage=stage)
                except errors.FusedLayerError as e:
                    raise _upload_failed(e, p) from None
            try:
                committed = self._call(self._stub.CommitWeightSets, pb.CommitWeightSetsRequest(stage=stage), timeout)
            except errors.FusedLayerError as e:
                raise _commit_failed(e, len(packed), manifest) from None
        except BaseException:
            # Best effort: NOT_FOUND once the stage is consumed (a refused commit), and the server drops
            # a stage nobody commits.
            try:
                self.commit_weight_sets(stage, discard=True, timeout=timeout)
            except errors.FusedLayerError:
                pass
            raise
        return _in_manifest_order(packed, committed)

    def upload(self, packed: weights.PackedWeightSet, timeout: Optional[float] = None,
               stage: str = "") -> WeightSetInfo:
        """Streams one PackedWeightSet (fusedlayer.pack_arrays / pack_manifest) over LoadWeights; with
        stage, under that stage id (published by commit_weight_sets(stage))."""
        return _weight_set_info(self._call(self._stub.LoadWeights, _weight_chunks(packed, stage), timeout))

    def commit_weight_sets(self, stage: str, discard: bool = False,
                           timeout: Optional[float] = None) -> List[WeightSetInfo]:
        """CommitWeightSets: publishes every set uploaded under stage, in one step (discard: drops them);
        returns the published sets' infos, by name (none when discarding)."""
        r = self._call(self._stub.CommitWeightSets, pb.CommitWeightSetsRequest(stage=stage, discard=discard), timeout)
        return [_weight_set_info(w) for w in r.weight_sets]

    def unload_weight_set(self, name: str, timeout: Optional[float] = None) -> int:
        """Unloads a set (freed when the last request using it ends); returns the bytes freed."""
        return int(self._call(self._stub.UnloadWeightSet, pb.UnloadWeightSetRequest(name=name), timeout).freed_bytes)

    def _config(self, weight_set: str) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], int]:
        """(mhc dict or None, swa dict or None, wq_b_rows) of a weight set, cached (sets are immutable
        once published; a replaced set of the same name keeps its shapes or the server refuses the call)."""
        if weight_set not in self._configs:
            return _remember_configs(self._configs, self.list_weight_sets(), weight_set)
        return self._configs[weight_set]

    # ---- system shared memory (transport="shm" uses these; docs/operations.md) -------------

    def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int,
                                      timeout: Optional[float] = None) -> None:
        """Registers [offset, offset + byte_size) of the POSIX shared-memory object `key` ("/name")."""
        self._call(self._stub.RegisterSystemSharedMemory, pb.RegisterSystemSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def system_shared_memory_status(self, name: str = "", timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The caller's regions (all, or the one named) as dicts: name, key, offset, byte_size."""
        r = self._call(self._stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name=name), timeout)
        return [_plain_dict(x) for x in r.regions]

    def unregister_system_shared_memory(self, name: str = "", timeout: Optional[float] = None) -> int:
        """Unregisters one region, or every region of the caller (name ""); returns how many."""
        r = self._call(self._stub.UnregisterSystemSharedMemory, pb.UnregisterSystemSharedMemoryRequest(name=name),
                       timeout)
        return int(r.unregistered)

    # ---- CUDA shared memory (same host and GPU; docs/operations.md) ----------------------------

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, offset: int, byte_size: int,
                                    timeout: Optional[float] = None) -> None:
        """Registers [offset, offset + byte_size) of a device allocation of this process by its CUDA IPC
        handle (the 64 bytes of a cudaIpcMemHandle_t, e.g. from cudaIpcGetMemHandle). Tensors in it are then
        referenced by name in Tensor.cuda_shared_memory; the server's kernels use them in place, and the
        response comes after they completed. The caller unregisters before it frees the allocation."""
        self._call(self._stub.RegisterCudaSharedMemory, pb.RegisterCudaSharedMemoryRequest(
            name=name, raw_handle=bytes(raw_handle), device_id=device_id, offset=offset, byte_size=byte_size),
            timeout)

    def cuda_shared_memory_status(self, name: str = "", timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The caller's CUDA shared-memory regions (all, or the one named) as dicts: name, device_id,
        offset, byte_size."""
        r = self._call(self._stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name=name), timeout)
        return [_plain_dict(x) for x in r.regions]

    def unregister_cuda_shared_memory(self, name: str = "", timeout: Optional[float] = None) -> int:
        """Unregisters one CUDA shared-memory region, or every one of the caller (name ""); returns how many."""
        r = self._call(self._stub.UnregisterCudaSharedMemory, pb.UnregisterCudaSharedMemoryRequest(name=name),
                       timeout)
        return int(r.unregistered)

    # ---- call rings (same host; docs/python-client.md "Call rings") ------------------------------

    def open_call_ring(self, weight_sets: Sequence[str] = (), regions: Sequence["ring.RegionBinding"] = (),
                       slots: int = 8, region_bytes: int = 16 << 20, spin_seconds: float = 50e-6,
                       timeout: Optional[float] = None, device_id: Optional[int] = None) -> "ring.CallRing":
        """OpenCallRing, and the ring taken over (fusedlayer.ring.CallRing, a context manager): its calls
        then go through shared memory instead of one RPC each. weight_sets, regions: what its calls may
        name (regions: system shared-memory region names, or (name, cuda) pairs; the ring's own region
        of region_bytes, registered here, comes first). device_id: the server device every call of the
        ring runs on (None: each where the server would run it by RPC). Needs this host and x86-64, and
        a server with --allow_call_rings (and --allow_shared_memory for the ring's own region)."""
        from . import ring as ring_module
        opened = ring_module.CallRing(self, weight_sets, regions, slots, region_bytes, spin_seconds, timeout,
                                      device_id)
        self._rings.add(opened)
        return opened

    # ---- residual sessions (docs/operations.md "Residual sessions") ----------------------------

    def open_residual_session(self, name: str, tokens: int, hc_mult: int, hidden: int,
                              timeout: Optional[float] = None,
                              device_id: Optional[int] = None) -> OpenedResidualSession:
        """Opens a session of T = tokens, n = hc_mult, C = hidden on device device_id (None: the
        least-loaded one; its calls run there). Returns the device bytes it holds, an int that also
        has .device_id, the device that holds it (OpenedResidualSession)."""
        return _opened_session(self._call(self._stub.OpenResidualSession,
                                          _open_session_request(name, tokens, hc_mult, hidden, device_id), timeout))

    def list_residual_sessions(self, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The caller's sessions as dicts: name, tokens, hc_mult, hidden, bytes, has_residual, has_mixes,
        calls, idle_seconds, last_weight_set, device_id."""
        r = self._call(self._stub.ListResidualSessions, pb.ListResidualSessionsRequest(), timeout)
        return [_plain_dict(s) for s in r.sessions]

    def close_residual_session(self, name: str = "", timeout: Optional[float] = None) -> int:
        """Closes one session, or every session of the caller (name ""); returns how many."""
        r = self._call(self._stub.CloseResidualSession, pb.CloseResidualSessionRequest(name=name), timeout)
        return int(r.closed)

    def list_weight_sets(self, timeout: Optional[float] = None) -> List[WeightSetInfo]:
        r = self._call(self._stub.ListWeightSets, pb.ListWeightSetsRequest(), timeout)
        return [_weight_set_info(w) for w in r.weight_sets]

    # ---- server ------------------------------------------------------------------------------

    def server_info(self, timeout: Optional[float] = None) -> ServerInfo:
        return _server_info(self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout))

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... Services: "", "fusedlayer.v1.FusedLayer",
        "fusedlayer.mhc", "fusedlayer.swa" (an unknown name raises NotFound)."""
        return _health_status(self._call(self._health_check, health_pb2.HealthCheckRequest(service=service), timeout))
