"""fusedlayer.Client: the hand-written layer over the generated gRPC stubs.

Arrays in and out are numpy: bf16 as uint16 bit patterns, fp32 as float32, fp8 as uint8 codes
(helpers in fusedlayer.dtypes). Every compute result carries the server's ExecutionReport; errors
are the classes of fusedlayer.errors.
"""

import ipaddress
import os
import re
import threading
import time
from multiprocessing import shared_memory
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import grpc
import numpy as np

from . import dtypes, errors, weights
from ._health.v1 import health_pb2
from .v1 import fusedlayer_pb2 as pb
from .v1 import fusedlayer_pb2_grpc as pb_grpc

TRANSPORTS = ("tcp", "shm")
_SHM_ALIGNMENT = 64  # the server's rule for tensor offsets in a shared-memory object
_CHUNK_BYTES = 4 << 20  # LoadWeights data chunk: well under any message limit

_PATHS = {"auto": pb.PATH_PREFERENCE_AUTO, "require_fused": pb.PATH_PREFERENCE_REQUIRE_FUSED,
          "force_unfused": pb.PATH_PREFERENCE_FORCE_UNFUSED}
_MODES = {"shifted": pb.MHC_MODE_SHIFTED, "normal": pb.MHC_MODE_NORMAL}
_STAGES = {"seam": pb.MHC_STAGE_SEAM, "first": pb.MHC_STAGE_FIRST, "head": pb.MHC_STAGE_HEAD}
_WIRE_DTYPES = {  # DataType -> (numpy dtype, what the user passes)
    pb.DATA_TYPE_BF16: (np.dtype("<u2"), "bf16 as uint16 bit patterns (fusedlayer.float32_to_bf16)"),
    pb.DATA_TYPE_FP32: (np.dtype("<f4"), "float32"),
    pb.DATA_TYPE_FP8_E4M3FN: (np.dtype("u1"), "uint8 e4m3fn codes"),
    pb.DATA_TYPE_FP8_E4M3FNUZ: (np.dtype("u1"), "uint8 e4m3fnuz codes"),
}
_HEALTH_STATUS = {v.number: v.name for v in health_pb2.HealthCheckResponse.ServingStatus.DESCRIPTOR.values}


# ExecutionReport.stages' fields (the queue wait is queue_seconds).
_REPORT_STAGES = ("decode", "copy_in", "device", "copy_out", "response")


def _enum_suffix(enum_type, value, prefix):
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
    stages: dict = field(default_factory=dict)

    @staticmethod
    def _from_proto(r, round_trip_seconds):
        return ExecutionReport(
            path=_enum_suffix(pb.ExecutionPath, r.path, "EXECUTION_PATH_"),
            fallback_reason=_enum_suffix(pb.FallbackReason, r.fallback_reason, "FALLBACK_REASON_"),
            fallback_detail=r.fallback_detail, backend=r.backend, device=r.device, weight_set=r.weight_set,
            kernel_seconds=r.kernel_seconds, queue_seconds=r.queue_seconds, server_seconds=r.server_seconds,
            round_trip_seconds=round_trip_seconds,
            stages={name: getattr(r.stages, name) for name in _REPORT_STAGES} if r.HasField("stages") else {})


@dataclass(frozen=True)
class Verification:
    """verify=True: the fused outputs judged against an unfused run (README "Shadow verification")."""
    compared: bool
    reason: str
    mismatch: bool
    outputs: List[dict]  # per output: output, mismatch, max_abs_diff, max_ulp_distance, ..., rule, detail


@dataclass
class MhcSeamResult:
    new_residual: Optional[np.ndarray]  # uint16 (bf16) [T, n, C]; None for a session call without return_state
    y: np.ndarray                       # uint16 (bf16) [T, C]
    new_pre_mix: Optional[np.ndarray]   # float32 [T, n] (seam/first; None for head)
    new_post_mix: Optional[np.ndarray]  # float32 [T, n]
    new_comb_mix: Optional[np.ndarray]  # float32 [T, n, n]
    aux: Optional[np.ndarray]           # uint16 (bf16) [T, C] with capture_aux
    report: ExecutionReport
    request_id: str
    verification: Optional[Verification]


@dataclass
class SwaNormQuantResult:
    q_fp8: np.ndarray                # uint8 codes [M, Q] in fp8_format
    q_scale: np.ndarray              # float32 [M, G] or [G, align(M, 4)] per the set's layout
    kv: np.ndarray                   # uint16 (bf16) [M, D]
    q_proj: Optional[np.ndarray]     # uint16 (bf16) [M, N] when the set has wq_b
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
    mhc: Optional[dict]
    swa: Optional[dict]
    resident_bytes: int
    source: str
    sha256: str
    has_norm_weight: bool
    wq_b_rows: int
    wq_b_implementation: str
    capabilities: Dict[str, OpCapability] = field(default_factory=dict)


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
    device_id: int = -1                       # the GPU a CUDA shared-memory region must be on (-1: none)


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


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read the file ({e.strerror})") from None


def read_token_file(path):
    """The bearer token in a file holding just the token (surrounding whitespace stripped)."""
    token = _read(path, "token file").decode("ascii", errors="replace").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(ch <= " " or ch > "~" for ch in token):
        # Never quote the token in the message.
        raise ValueError(f"token file {path} must hold just the token (found whitespace or a non-ASCII byte inside)")
    return token


def target_is_local(target):
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


def _tensor(name, array, data_type):
    want, what = _WIRE_DTYPES[data_type]
    a = np.asarray(array)
    if a.dtype.kind != want.kind or a.dtype.itemsize != want.itemsize:
        raise TypeError(f"{name} must be {what}, got a {a.dtype} array")
    return pb.Tensor(dtype=data_type, shape=list(a.shape), data=np.ascontiguousarray(a, dtype=want).tobytes())


def _array(t, present=True):
    if not present:
        return None
    np_dtype, _ = _WIRE_DTYPES.get(t.dtype, (None, None))
    if np_dtype is None:
        raise errors.FusedLayerError(grpc.StatusCode.INTERNAL, f"the server returned a tensor of dtype {t.dtype}")
    # frombuffer views the immutable bytes; the copy gives the caller an ordinary writable array.
    return np.frombuffer(t.data, dtype=np_dtype).reshape(tuple(t.shape)).astype(np_dtype.newbyteorder("="))


def _aligned(n):
    return (n + _SHM_ALIGNMENT - 1) // _SHM_ALIGNMENT * _SHM_ALIGNMENT


class _SharedMemoryArena:
    """transport="shm": one POSIX shared-memory object (multiprocessing.shared_memory: a random name,
    mode 0600) registered as one region and reused by every call of the client, one call at a time
    (the lock); grown (re-created) when a call needs more. Inputs are copied in and referenced,
    outputs placed there and read back, so no tensor travels in the messages. close() unregisters
    and removes it (and Python's resource tracker removes the object of a process that dies)."""

    def __init__(self, client):
        self._client = client
        self._shm = None
        self.lock = threading.Lock()

    @property
    def region(self):
        return "py-" + self._shm.name.lstrip("/")

    def ensure(self, size):
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

    def _drop(self):
        self._shm.close()
        self._shm.unlink()
        self._shm = None

    def release(self):
        if self._shm is None:
            return
        try:
            self._client.unregister_system_shared_memory(self.region)
        except errors.FusedLayerError:
            pass  # the server is gone or forgot it: nothing left to free there
        self._drop()

    def place(self, request, inputs, outputs):
        """inputs: the request's inline Tensor fields to move in; outputs: [(name, bytes)]."""
        need = sum(_aligned(len(t.data)) for t in inputs) + sum(_aligned(b) for _, b in outputs)
        self.ensure(need)
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

    def fetch(self, t):
        """An output the server wrote into the region, back as inline bytes."""
        if t.WhichOneof("storage") == "shared_memory":
            ref = t.shared_memory
            t.data = bytes(self._shm.buf[ref.offset:ref.offset + ref.byte_size])


def _choice(kind, value, table):
    if value not in table:
        raise ValueError(f"{kind} = {value!r}; expected one of {', '.join(table)}")
    return table[value]


def _capability(c):
    return OpCapability(op=c.op, fused_available=c.fused_available,
                        reason=_enum_suffix(pb.FallbackReason, c.reason, "FALLBACK_REASON_"), detail=c.detail)


def _plain_dict(msg):
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


def _weight_set_info(w):
    return WeightSetInfo(
        name=w.name, mhc=_plain_dict(w.mhc) if w.HasField("mhc") else None,
        swa=_plain_dict(w.swa) if w.HasField("swa") else None, resident_bytes=w.resident_bytes, source=w.source,
        sha256=w.sha256, has_norm_weight=w.has_norm_weight, wq_b_rows=w.wq_b_rows,
        wq_b_implementation=w.wq_b_implementation, capabilities={c.op: _capability(c) for c in w.capabilities})


def _verification(response):
    if not response.HasField("verification"):
        return None
    v = response.verification
    return Verification(compared=v.compared, reason=v.reason, mismatch=v.mismatch,
                        outputs=[_plain_dict(o) for o in v.outputs])


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
    """

    def __init__(self, target, tls=None, token_file=None, transport="tcp", timeout=60.0,
                 max_message_bytes=1 << 30, options=()):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport = {transport!r} is not implemented yet (available: {', '.join(TRANSPORTS)})")
        if not target:
            raise ValueError("target is empty (expected host:port)")
        self.target = target
        self.transport = transport
        self._arena = _SharedMemoryArena(self) if transport == "shm" else None
        self._configs = {}  # weight set -> (mhc, swa, wq_b_rows), for sizing shared-memory outputs
        self.timeout = timeout
        self._metadata = ()
        if token_file is not None:
            if not tls and not target_is_local(target):
                raise ValueError(f"a bearer token without TLS would cross the network in clear text to {target}: "
                                 "pass tls=... or use a loopback / unix: target")
            self._metadata = (("authorization", "Bearer " + read_token_file(token_file)),)
        # Both limits explicit (gRPC's receive default is 4 MiB), matching the server's flag.
        channel_options = [("grpc.max_receive_message_length", max_message_bytes),
                           ("grpc.max_send_message_length", max_message_bytes)] + list(options)
        if tls:
            t = tls if isinstance(tls, Tls) else Tls(**tls) if isinstance(tls, dict) else Tls()
            if (t.cert is None) != (t.key is None):
                raise ValueError("a TLS client certificate and its key must be given together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(t.ca, "TLS CA") if t.ca else None,
                private_key=_read(t.key, "TLS client key") if t.key else None,
                certificate_chain=_read(t.cert, "TLS client certificate") if t.cert else None)
            if t.server_name:
                channel_options.append(("grpc.ssl_target_name_override", t.server_name))
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
        else:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.FusedLayerStub(self._channel)
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)

    def close(self):
        if self._arena is not None:
            self._arena.release()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    # ---- ops ---------------------------------------------------------------------------------

    def mhc_seam(self, weight_set, x, residual=None, post_mix=None, comb_mix=None, pre_mix=None, mode="shifted",
                 stage="seam", path="auto", capture_aux=False, verify=False, request_id="", timeout=None,
                 session="", return_state=False):
        """One mHC seam (docs/spec/mhc.md).

        stage "seam"/"head": x = sublayer output bf16 [T, C], residual bf16 [T, n, C], post_mix fp32
        [T, n], comb_mix fp32 [T, n, n], pre_mix fp32 [T, n] (shifted mode; None selects stream 0).
        stage "first": x = the embedding bf16 [T, C]; residual and the mixes are not sent.
        path "require_fused" raises FusedUnavailable (with .reason) instead of falling back.
        session: a residual session of this caller (open_residual_session): residual and the mixes
        come from it and the new ones stay there, so only x is sent and y returned (new_residual and
        the mixes are None unless return_state). Sent inline whatever the client's transport.
        """
        req = pb.MhcSeamRequest(weight_set=weight_set, stage=_choice("stage", stage, _STAGES),
                                mode=_choice("mode", mode, _MODES), path_preference=_choice("path", path, _PATHS),
                                capture_aux=capture_aux, verify=verify, request_id=request_id, session=session,
                                return_state=return_state)
        req.x.CopyFrom(_tensor("x", x, pb.DATA_TYPE_BF16))
        for name, value, data_type in (("residual", residual, pb.DATA_TYPE_BF16),
                                       ("post_mix", post_mix, pb.DATA_TYPE_FP32),
                                       ("comb_mix", comb_mix, pb.DATA_TYPE_FP32),
                                       ("pre_mix", pre_mix, pb.DATA_TYPE_FP32)):
            if value is not None:
                getattr(req, name).CopyFrom(_tensor(name, value, data_type))
        if self._arena is None or session:
            start = time.perf_counter()
            r = self._call(self._stub.MhcSeam, req, timeout)
            elapsed = time.perf_counter() - start
        else:
            mhc = self._config(weight_set)[0]
            if mhc is None:
                raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {weight_set!r} has no mHC part")
            T, n, C = req.x.shape[0], mhc["hc_mult"], mhc["hidden"]
            outputs = [("new_residual", T * n * C * 2), ("y", T * C * 2)]
            if req.stage != pb.MHC_STAGE_HEAD:
                outputs += [("new_pre_mix", T * n * 4), ("new_post_mix", T * n * 4), ("new_comb_mix", T * n * n * 4)]
            if capture_aux:
                outputs.append(("aux", T * C * 2))
            inputs = [getattr(req, f) for f in ("x", "residual", "post_mix", "comb_mix", "pre_mix") if req.HasField(f)]
            with self._arena.lock:
                self._arena.place(req, inputs, outputs)
                start = time.perf_counter()
                r = self._call(self._stub.MhcSeam, req, timeout)
                elapsed = time.perf_counter() - start
                for f in ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux"):
                    self._arena.fetch(getattr(r, f))
        report = ExecutionReport._from_proto(r.report, elapsed)
        return MhcSeamResult(
            new_residual=_array(r.new_residual, r.HasField("new_residual")), y=_array(r.y),
            new_pre_mix=_array(r.new_pre_mix, r.HasField("new_pre_mix")),
            new_post_mix=_array(r.new_post_mix, r.HasField("new_post_mix")),
            new_comb_mix=_array(r.new_comb_mix, r.HasField("new_comb_mix")),
            aux=_array(r.aux, r.HasField("aux")), report=report, request_id=r.request_id,
            verification=_verification(r))

    def swa_norm_quant(self, weight_set, qr_kv, path="auto", verify=False, request_id="", timeout=None):
        """SWA q/kv RMSNorm + q FP8 1x128 group quant (+ wq_b) (docs/spec/swa.md).

        qr_kv: bf16 [M, S], S >= Q + D: q = columns [0, Q), kv = [Q, Q + D).
        """
        req = pb.SwaNormQuantRequest(weight_set=weight_set, path_preference=_choice("path", path, _PATHS),
                                     verify=verify, request_id=request_id)
        req.qr_kv.CopyFrom(_tensor("qr_kv", qr_kv, pb.DATA_TYPE_BF16))
        if self._arena is None:
            start = time.perf_counter()
            r = self._call(self._stub.SwaNormQuant, req, timeout)
            elapsed = time.perf_counter() - start
        else:
            _, swa, wq_b_rows = self._config(weight_set)
            if swa is None:
                raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"weight set {weight_set!r} has no SWA part")
            M, Q, D = req.qr_kv.shape[0], swa["q_rank"], swa["head_dim"]
            scale_rows = M if swa["scale_layout"] == "row_major" else (M + 3) // 4 * 4
            outputs = [("q_fp8", M * Q), ("q_scale", scale_rows * (Q // 128) * 4), ("kv", M * D * 2)]
            if wq_b_rows:
                outputs.append(("q_proj", M * wq_b_rows * 2))
            with self._arena.lock:
                self._arena.place(req, [req.qr_kv], outputs)
                start = time.perf_counter()
                r = self._call(self._stub.SwaNormQuant, req, timeout)
                elapsed = time.perf_counter() - start
                for f in ("q_fp8", "q_scale", "kv", "q_proj"):
                    self._arena.fetch(getattr(r, f))
        report = ExecutionReport._from_proto(r.report, elapsed)
        return SwaNormQuantResult(
            q_fp8=_array(r.q_fp8), q_scale=_array(r.q_scale), kv=_array(r.kv),
            q_proj=_array(r.q_proj, r.HasField("q_proj")),
            fp8_format=dtypes.E4M3FNUZ if r.q_fp8.dtype == pb.DATA_TYPE_FP8_E4M3FNUZ else dtypes.E4M3FN,
            report=report, request_id=r.request_id, verification=_verification(r))

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, source, name=None, mhc=None, swa=None, replace=False, timeout=None):
        """Uploads weight sets over LoadWeights (SHA-256 checked by the server); returns their infos.

        source: a manifest path (docs/weights.md: every set in it is loaded, in order), or a dict of
        numpy arrays named as in docs/weights.md ("mhc.fn", ...) with name= and mhc= and/or swa=
        config dicts. replace=True swaps an existing set of the same name atomically.

        Errors carry the gRPC code the server's loader would answer with, whether found here or by
        the server: NotFound (a missing manifest, file or tensor), InvalidArgument (anything
        malformed), AlreadyExists, ... Every set is packed and checked before the first is sent.
        """
        if isinstance(source, (str, os.PathLike)):
            if name is not None or mhc is not None or swa is not None:
                raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                             "name/mhc/swa come from the manifest; pass them only with a dict of arrays")
            packed = weights.pack_manifest(os.fspath(source), replace=replace)
        elif isinstance(source, dict):
            if not name:
                raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "load_weights(dict of arrays) needs name=")
            packed = [weights.pack_arrays(name, source, mhc=mhc, swa=swa, replace=replace)]
        else:
            raise TypeError(f"load_weights takes a manifest path or a dict of arrays, got {type(source).__name__}")
        return [self.upload(p, timeout) for p in packed]

    def upload(self, packed, timeout=None):
        """Streams one PackedWeightSet (fusedlayer.pack_arrays / pack_manifest) over LoadWeights."""
        def chunks():
            first = pb.WeightChunk()
            first.header.CopyFrom(packed.header)
            first.data = packed.payload[:_CHUNK_BYTES]
            yield first
            for off in range(_CHUNK_BYTES, len(packed.payload), _CHUNK_BYTES):
                yield pb.WeightChunk(data=packed.payload[off:off + _CHUNK_BYTES])
        return _weight_set_info(self._call(self._stub.LoadWeights, chunks(), timeout))

    def unload_weight_set(self, name, timeout=None):
        """Unloads a set (freed when the last request using it ends); returns the bytes freed."""
        return self._call(self._stub.UnloadWeightSet, pb.UnloadWeightSetRequest(name=name), timeout).freed_bytes

    def _config(self, weight_set):
        """(mhc dict or None, swa dict or None, wq_b_rows) of a weight set, cached (sets are immutable
        once published; a replaced set of the same name keeps its shapes or the server refuses the call)."""
        if weight_set not in self._configs:
            for w in self.list_weight_sets():
                self._configs[w.name] = (w.mhc, w.swa, w.wq_b_rows)
            if weight_set not in self._configs:
                raise errors.NotFound(grpc.StatusCode.NOT_FOUND, f"weight set {weight_set!r} is not loaded")
        return self._configs[weight_set]

    # ---- system shared memory (transport="shm" uses these; docs/operations.md) -------------

    def register_system_shared_memory(self, name, key, offset, byte_size, timeout=None):
        """Registers [offset, offset + byte_size) of the POSIX shared-memory object `key` ("/name")."""
        self._call(self._stub.RegisterSystemSharedMemory, pb.RegisterSystemSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def system_shared_memory_status(self, name="", timeout=None):
        """The caller's regions (all, or the one named) as dicts: name, key, offset, byte_size."""
        r = self._call(self._stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name=name), timeout)
        return [_plain_dict(x) for x in r.regions]

    def unregister_system_shared_memory(self, name="", timeout=None):
        """Unregisters one region, or every region of the caller (name ""); returns how many."""
        r = self._call(self._stub.UnregisterSystemSharedMemory, pb.UnregisterSystemSharedMemoryRequest(name=name),
                       timeout)
        return r.unregistered

    # ---- CUDA shared memory (same host and GPU; docs/operations.md) ----------------------------

    def register_cuda_shared_memory(self, name, raw_handle, device_id, offset, byte_size, timeout=None):
        """Registers [offset, offset + byte_size) of a device allocation of this process by its CUDA IPC
        handle (the 64 bytes of a cudaIpcMemHandle_t, e.g. from cudaIpcGetMemHandle). Tensors in it are then
        referenced by name in Tensor.cuda_shared_memory; the server's kernels use them in place, and the
        response comes after they completed. The caller unregisters before it frees the allocation."""
        self._call(self._stub.RegisterCudaSharedMemory, pb.RegisterCudaSharedMemoryRequest(
            name=name, raw_handle=bytes(raw_handle), device_id=device_id, offset=offset, byte_size=byte_size),
            timeout)

    def cuda_shared_memory_status(self, name="", timeout=None):
        """The caller's CUDA shared-memory regions (all, or the one named) as dicts: name, device_id,
        offset, byte_size."""
        r = self._call(self._stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name=name), timeout)
        return [_plain_dict(x) for x in r.regions]

    def unregister_cuda_shared_memory(self, name="", timeout=None):
        """Unregisters one CUDA shared-memory region, or every one of the caller (name ""); returns how many."""
        r = self._call(self._stub.UnregisterCudaSharedMemory, pb.UnregisterCudaSharedMemoryRequest(name=name),
                       timeout)
        return r.unregistered

    # ---- residual sessions (docs/operations.md "Residual sessions") ----------------------------

    def open_residual_session(self, name, tokens, hc_mult, hidden, timeout=None):
        """Opens a session of T = tokens, n = hc_mult, C = hidden; returns the device bytes it holds."""
        r = self._call(self._stub.OpenResidualSession, pb.OpenResidualSessionRequest(
            name=name, tokens=tokens, hc_mult=hc_mult, hidden=hidden), timeout)
        return r.bytes

    def list_residual_sessions(self, timeout=None):
        """The caller's sessions as dicts: name, tokens, hc_mult, hidden, bytes, has_residual, has_mixes,
        calls, idle_seconds, last_weight_set."""
        r = self._call(self._stub.ListResidualSessions, pb.ListResidualSessionsRequest(), timeout)
        return [_plain_dict(s) for s in r.sessions]

    def close_residual_session(self, name="", timeout=None):
        """Closes one session, or every session of the caller (name ""); returns how many."""
        r = self._call(self._stub.CloseResidualSession, pb.CloseResidualSessionRequest(name=name), timeout)
        return r.closed

    def list_weight_sets(self, timeout=None):
        r = self._call(self._stub.ListWeightSets, pb.ListWeightSetsRequest(), timeout)
        return [_weight_set_info(w) for w in r.weight_sets]

    # ---- server ------------------------------------------------------------------------------

    def server_info(self, timeout=None):
        r = self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo(version=r.version, backend=r.backend, device=r.device, arch=r.arch,
                          ops={c.op: _capability(c) for c in r.ops},
                          max_receive_message_bytes=r.max_receive_message_bytes,
                          max_send_message_bytes=r.max_send_message_bytes, fused_max_tokens=r.fused_max_tokens,
                          max_tokens=r.max_tokens, queue_capacity=r.queue_capacity,
                          shared_memory_enabled=r.shared_memory_enabled,
                          cuda_shared_memory_enabled=r.cuda_shared_memory_enabled, device_id=r.device_id)

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... Services: "", "fusedlayer.v1.FusedLayer",
        "fusedlayer.mhc", "fusedlayer.swa" (an unknown name raises NotFound)."""
        r = self._call(self._health_check, health_pb2.HealthCheckRequest(service=service), timeout)
        return _HEALTH_STATUS.get(r.status, str(r.status))
