"""Call rings: the per-op data plane of a process on the server's host (proto OpenCallRing).

gRPC opens the ring once; each call is then a fixed-size descriptor written into a slot of memory
both processes map, and its completion record read back from the same slot: no RPC per call. The
layout and the protocol are proto/fusedlayer/wire/call_ring.h; the structures below mirror it
byte for byte (checked against the literals that header asserts too).

    with fusedlayer.Client("127.0.0.1:50051") as c:
        with c.open_call_ring(weight_sets=["v41-flash/demo"]) as ring:
            r = ring.mhc_seam("v41-flash/demo", x, residual, post_mix, comb_mix, pre_mix)

The high-level calls (mhc_seam, swa_norm_quant) copy their inputs into a POSIX shared-memory
region the ring owns (bound as region 0) and read their outputs back from it, like the client's
transport="shm"; submit/wait/call take descriptors naming any region bound at open. Needs the
server's host, x86-64 and a server with --allow_call_rings (and --allow_shared_memory for system
shared memory).
"""

import ctypes
import mmap
import os
import platform
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _torch, dtypes, errors
from . import client as cl
from .v1 import fusedlayer_pb2 as pb

# ---- the layout (call_ring.h, kCallRingLayoutVersion 1) --------------------------------------------

CALL_RING_MAGIC = 0x46524C43
CALL_RING_LAYOUT_VERSION = 2
RING_MAX_TENSORS = 12
RING_MESSAGE_BYTES = 336
RING_DETAIL_BYTES = 192
RING_COMPLETED_BY_DEVICE = 1  # RingCompletion.flags (kRingCompletedByDevice)
RING_SLOT_OFFSET = 4096                # of slot 0 from the start of the ring (kRingSlotOffset)
# call_ring.h static_asserts these same literals (kRingSlotBytes, kRingCallOffsetInSlot,
# kRingCompletionOffsetInSlot): a change on either side fails loudly.
RING_SLOT_BYTES = 1536
RING_CALL_OFFSET_IN_SLOT = 128
RING_COMPLETION_OFFSET_IN_SLOT = 896

OP_MHC_SEAM = 1
OP_SWA_NORM_QUANT = 2
FLAG_CAPTURE_AUX = 1 << 0

# RingTensorRef.role by the proto field name of the tensor (RingRole in call_ring.h).
ROLES: Dict[str, int] = {
    "x": 1, "residual": 2, "post_mix": 3, "comb_mix": 4, "pre_mix": 5, "qr_kv": 6,
    "new_residual": 16, "new_pre_mix": 17, "new_post_mix": 18, "new_comb_mix": 19, "y": 20, "aux": 21,
    "q_fp8": 24, "q_scale": 25, "kv": 26, "q_proj": 27,
}

_MHC_INPUTS = ("x", "residual", "post_mix", "comb_mix", "pre_mix")
_MHC_OUTPUTS = ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux")
_SWA_OUTPUTS = ("q_fp8", "q_scale", "kv", "q_proj")


class RingTensorRef(ctypes.Structure):
    """One tensor of a call: bytes [offset, offset + byte_size) of bound region `region`; inputs carry
    dtype (a DataType number), rank and shape, outputs only where they go."""
    _fields_ = [("role", ctypes.c_uint32), ("region", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("rank", ctypes.c_uint32), ("shape", ctypes.c_int64 * 3), ("offset", ctypes.c_uint64),
                ("byte_size", ctypes.c_uint64)]


class RingCallDescriptor(ctypes.Structure):
    """What the client writes into a slot for one call (the server copies it out whole)."""
    _fields_ = [("op", ctypes.c_uint32), ("weight_set", ctypes.c_uint32), ("path_preference", ctypes.c_uint32),
                ("stage", ctypes.c_uint32), ("mode", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("deadline_ns", ctypes.c_int64),  # CLOCK_MONOTONIC ns after which it is not launched; 0: none
                ("num_tensors", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("tensors", RingTensorRef * RING_MAX_TENSORS)]


class RingCompletion(ctypes.Structure):
    """What the server writes back (strings NUL-terminated)."""
    _fields_ = [("code", ctypes.c_int32), ("path", ctypes.c_uint32), ("fallback_reason", ctypes.c_uint32),
                ("batch_requests", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("server_seconds", ctypes.c_double),
                ("queue_seconds", ctypes.c_double), ("kernel_seconds", ctypes.c_double),
                # where server_seconds went (ExecutionReport.stages; 0 on errors)
                ("decode_seconds", ctypes.c_double), ("copy_in_seconds", ctypes.c_double),
                ("device_seconds", ctypes.c_double), ("copy_out_seconds", ctypes.c_double),
                ("response_seconds", ctypes.c_double),
                ("message", ctypes.c_char * RING_MESSAGE_BYTES), ("fallback_detail", ctypes.c_char * RING_DETAIL_BYTES)]


class RingSlotControl(ctypes.Structure):
    """A slot's control words, each side's on its own cache line (alignas(64) in C++)."""
    _fields_ = [("submit_seq", ctypes.c_uint32), ("pad0", ctypes.c_uint8 * 60),
                ("complete_seq", ctypes.c_uint32), ("client_waiting", ctypes.c_uint32), ("pad1", ctypes.c_uint8 * 56)]


class RingSlot(ctypes.Structure):
    # ctypes has no alignas: the C++ padding is spelled out (completion is aligned to 64, and so is
    # the slot's size).
    _fields_ = [("control", RingSlotControl), ("call", RingCallDescriptor), ("pad0", ctypes.c_uint8 * 56),
                ("completion", RingCompletion), ("pad1", ctypes.c_uint8 * 24)]


class RingHeader(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("layout_version", ctypes.c_uint32), ("slots", ctypes.c_uint32),
                ("slot_bytes", ctypes.c_uint32), ("ring_id", ctypes.c_uint64), ("slot_offset", ctypes.c_uint64),
                ("pad0", ctypes.c_uint8 * 32), ("poller_sleeping", ctypes.c_uint32), ("pad1", ctypes.c_uint8 * 60)]


def layout_mismatches() -> List[str]:
    """The layout facts where these structures differ from call_ring.h's (empty when they agree). The
    numbers are the literals call_ring.h static_asserts."""
    facts = [  # (what, these structures' value, call_ring.h's)
        ("sizeof(RingTensorRef)", ctypes.sizeof(RingTensorRef), 56),
        ("sizeof(RingCallDescriptor)", ctypes.sizeof(RingCallDescriptor), 712),
        ("sizeof(RingCompletion)", ctypes.sizeof(RingCompletion), 616),
        ("sizeof(RingSlotControl)", ctypes.sizeof(RingSlotControl), 128),
        ("sizeof(RingSlot)", ctypes.sizeof(RingSlot), RING_SLOT_BYTES),
        ("offsetof(RingSlot, call)", RingSlot.call.offset, RING_CALL_OFFSET_IN_SLOT),
        ("offsetof(RingSlot, completion)", RingSlot.completion.offset, RING_COMPLETION_OFFSET_IN_SLOT),
        ("offsetof(RingSlotControl, complete_seq)", RingSlotControl.complete_seq.offset, 64),
        ("offsetof(RingSlotControl, client_waiting)", RingSlotControl.client_waiting.offset, 68),
        ("offsetof(RingCallDescriptor, tensors)", RingCallDescriptor.tensors.offset, 40),
        ("offsetof(RingCompletion, message)", RingCompletion.message.offset, 88),
        ("sizeof(RingHeader)", ctypes.sizeof(RingHeader), 128),
        ("offsetof(RingHeader, poller_sleeping)", RingHeader.poller_sleeping.offset, 64),
    ]
    return [f"{what} = {got}, call_ring.h: {want}" for what, got, want in facts if got != want]


# ---- the machine: atomic words, futex, fence ----------------------------------------------------------

# The seq words are read and written as plain aligned 32-bit loads and stores (ctypes c_uint32 over
# the mapping). On x86-64 those are atomic, loads are not reordered with loads nor stores with
# stores (TSO), which is the acquire/release the protocol needs: the descriptor is written before
# submit_seq, the completion read after complete_seq. Elsewhere plain accesses promise neither, so
# a ring is refused there rather than being subtly wrong.
_X86_64 = ("x86_64", "AMD64", "amd64")
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0   # not FUTEX_PRIVATE: the word is shared with the server's process


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
# Looked up softly: importing fusedlayer works anywhere, opening a ring only on Linux x86-64.
_syscall = getattr(_libc, "syscall", None)
_spin_trylock = getattr(_libc, "pthread_spin_trylock", None)
if _syscall is not None:
    _syscall.restype = ctypes.c_long
_fence_word = ctypes.c_int(0)  # a pthread_spinlock_t nobody waits on (taken by the first fence, then kept)
_fence_arg = ctypes.byref(_fence_word)


def _full_fence() -> None:
    """Orders every earlier store before every later load (what the C++ side's seq_cst store + load
    do). A store followed by a load of another word is the one reordering x86-64 allows, and both
    sleep handshakes are that shape: the client stores submit_seq then loads poller_sleeping while
    the poller stores poller_sleeping then loads submit_seq; missing that would leave a call
    waiting on a sleeping poller. pthread_spin_trylock is an atomic read-modify-write (a LOCK'ed
    instruction on x86-64: glibc's is one lock cmpxchg, run whether the lock is free or not), a full
    barrier; the call's result does not matter."""
    assert _spin_trylock is not None
    _spin_trylock(_fence_arg)


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    # EAGAIN (the word changed first), EINTR and ETIMEDOUT all mean "look again": the caller loops.
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    assert _syscall is not None
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
                  ctypes.c_uint32(expected), ctypes.byref(ts), ctypes.c_void_p(0), ctypes.c_int(0))


# ---- descriptors -------------------------------------------------------------------------------------

_PATHS = {"auto": pb.PATH_PREFERENCE_AUTO, "require_fused": pb.PATH_PREFERENCE_REQUIRE_FUSED,
          "force_unfused": pb.PATH_PREFERENCE_FORCE_UNFUSED}

RegionBinding = Union[str, Tuple[str, bool]]  # a system shared-memory region's name, or (name, cuda)


def _deadline_ns(deadline: Optional[float]) -> int:
    # time.monotonic_ns is CLOCK_MONOTONIC on Linux: the clock of RingCallDescriptor.deadline_ns.
    return 0 if deadline is None else time.monotonic_ns() + int(deadline * 1e9)


def _add(call: RingCallDescriptor, ref: RingTensorRef) -> None:
    if call.num_tensors >= RING_MAX_TENSORS:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"a ring call holds at most {RING_MAX_TENSORS} tensors")
    call.tensors[call.num_tensors] = ref
    call.num_tensors += 1


def _region_index(regions: Sequence[Tuple[str, bool]], name: str, cuda: bool) -> int:
    for i, (n, c) in enumerate(regions):
        if n == name and c == cuda:
            return i
    raise errors.NotFound(grpc.StatusCode.NOT_FOUND,
                          f"{'CUDA ' if cuda else ''}region '{name}' is not bound to the ring")


def _add_input(call: RingCallDescriptor, name: str, t: Any, regions: Sequence[Tuple[str, bool]]) -> None:
    storage = t.WhichOneof("storage")
    if storage not in ("shared_memory", "cuda_shared_memory"):
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"{name} is inline: a ring call's tensors lie in shared-memory regions")
    if len(t.shape) > 3:
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: rank over 3")
    ref = getattr(t, storage)
    r = RingTensorRef(role=ROLES[name], region=_region_index(regions, ref.region, storage == "cuda_shared_memory"),
                      dtype=t.dtype, rank=len(t.shape), offset=ref.offset, byte_size=ref.byte_size)
    for d, n in enumerate(t.shape):
        r.shape[d] = n
    _add(call, r)


def _add_outputs(call: RingCallDescriptor, outputs: Sequence[str], placements: Any,
                 regions: Sequence[Tuple[str, bool]]) -> None:
    for p in placements:
        if p.output not in outputs:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"output placement '{p.output}' is not an output of the op")
        cuda = p.WhichOneof("target") == "cuda_shared_memory"
        ref = p.cuda_shared_memory if cuda else p.shared_memory
        _add(call, RingTensorRef(role=ROLES[p.output], region=_region_index(regions, ref.region, cuda),
                                 offset=ref.offset, byte_size=ref.byte_size))


def ring_call_of(request: Union["pb.MhcSeamRequest", "pb.SwaNormQuantRequest"], weight_sets: Sequence[str],
                 regions: Sequence[RegionBinding], deadline: Optional[float] = None) -> RingCallDescriptor:
    """The descriptor of a request whose tensors all lie in shared-memory regions (as transport="shm"
    or CUDA tensors make them), its weight set and regions found in a ring's bindings (CallRing's
    weight_sets and regions). deadline: seconds from now after which the call is not launched.
    InvalidArgument for an inline tensor, session, verify or device_id (a descriptor names no device);
    NotFound for a weight set or region the bindings lack."""
    bound = [_binding(r) for r in regions]
    if request.weight_set not in weight_sets:
        raise errors.NotFound(grpc.StatusCode.NOT_FOUND, f"weight set '{request.weight_set}' is not bound to the ring")
    if request.HasField("device_id"):
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                     "ring calls do not name a device one by one (device_id): open the ring with "
                                     "device_id and every call of it runs there")
    call = RingCallDescriptor(weight_set=list(weight_sets).index(request.weight_set),
                              path_preference=request.path_preference, deadline_ns=_deadline_ns(deadline))
    if isinstance(request, pb.MhcSeamRequest):
        if request.session or request.verify:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                         "ring calls carry neither residual sessions nor verify")
        call.op, call.stage, call.mode = OP_MHC_SEAM, request.stage, request.mode
        if request.capture_aux:
            call.flags |= FLAG_CAPTURE_AUX
        for name in _MHC_INPUTS:
            if request.HasField(name):
                _add_input(call, name, getattr(request, name), bound)
        _add_outputs(call, _MHC_OUTPUTS, request.output_placements, bound)
    else:
        if request.verify:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "ring calls do not carry verify")
        call.op = OP_SWA_NORM_QUANT
        if request.HasField("qr_kv"):
            _add_input(call, "qr_kv", request.qr_kv, bound)
        _add_outputs(call, _SWA_OUTPUTS, request.output_placements, bound)
    return call


def _binding(region: RegionBinding) -> Tuple[str, bool]:
    return (region, False) if isinstance(region, str) else (region[0], bool(region[1]))


# ---- results -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingCallResult:
    """A completion record of an OK call (a failed one raises the FusedLayerError subclass its status
    code maps to, with the server's message, as the RPC of the same call would)."""
    path: str                 # "fused" or "unfused" (ExecutionReport.path)
    fallback_reason: str      # "none", "client_forced_unfused", ...
    fallback_detail: str
    batch_requests: int       # requests that shared the launch (1: alone)
    server_seconds: float     # from the poller taking the call to the completion
    queue_seconds: float
    kernel_seconds: float
    # where server_seconds went: "decode", "copy_in", "device", "copy_out", "response" -> seconds
    stages: Dict[str, float]
    # The GPU stream wrote the completion after the kernels (outputs all in CUDA shared memory on a
    # GPU server): server_seconds then ends at the launch, and kernel_seconds is 0 (not known then).
    completed_by_device: bool = False


_STAGES = cl._REPORT_STAGES  # the completion's stage fields are these names + "_seconds"


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    try:
        return str(enum_type.Name(value))[len(prefix):].lower()
    except ValueError:
        return str(value)  # a server newer than these stubs


# ---- the ring ------------------------------------------------------------------------------------------


class CallRing:
    """An open call ring (Client.open_call_ring). A context manager: close() closes the connection
    (the server then closes the ring) and removes the ring's own region.

    weight_sets, regions: the bindings descriptors name by index. regions[0] is the ring's own
    system shared-memory region (the high-level calls' tensors; absent with region_bytes=0), the
    regions given to open follow. One slot holds one call at a time; distinct threads may use
    distinct slots at once. The high-level calls run one at a time (the own region holds one
    call's tensors), in the slot they are given (0 by default). Their CUDA tensors go by CUDA shared
    memory as the client's RPCs send them (no copy); a device allocation the ring does not bind yet
    is bound by reopening the ring (regions appended: the indices bound before stay), which needs
    every slot idle.
    """

    def __init__(self, client: cl.Client, weight_sets: Sequence[str] = (), regions: Sequence[RegionBinding] = (),
                 slots: int = 8, region_bytes: int = 16 << 20, spin_seconds: float = 50e-6,
                 timeout: Optional[float] = None, device_id: Optional[int] = None) -> None:
        if not sys.platform.startswith("linux") or platform.machine() not in _X86_64 or _spin_trylock is None:
            raise RuntimeError(f"call rings need Linux on x86-64 (this is {sys.platform} on {platform.machine()!r}): "
                               "the Python client reads and writes the ring's words as plain loads and stores, which "
                               "are atomic and ordered enough only there; use the client's RPCs (transport=\"shm\") "
                               "instead")
        mismatches = layout_mismatches()
        if mismatches:
            raise RuntimeError("fusedlayer.ring's structures do not match call_ring.h: " + "; ".join(mismatches))
        self._client = client
        self.weight_sets: List[str] = list(weight_sets)
        # The server device every call of the ring runs on (None: each where the server would run
        # the same call by RPC).
        self.device_id = device_id
        self._arena: Optional[cl._SharedMemoryArena] = None
        if region_bytes > 0:
            self._arena = cl._SharedMemoryArena(client, name=f"py-ring-{os.getpid()}-{secrets.token_hex(8)}")
        self.regions: List[Tuple[str, bool]] = ([(self._arena.region, False)] if self._arena else []) + \
            [_binding(r) for r in regions]
        self._spin_ns = int(spin_seconds * 1e9)
        self._lock = threading.Lock()  # the high-level calls, one at a time (they share the own region)
        self._mm: Optional[mmap.mmap] = None
        self._base: Optional[ctypes.c_char] = None  # holds the mapping exported while the ring is open
        self._address = 0
        self._doorbell = -1
        self._connection: Optional[socket.socket] = None
        self._seq: List[int] = []
        self.slots = 0
        self.ring_id = 0
        try:
            if self._arena is not None:
                self._arena.ensure(region_bytes)
            self._open(slots, timeout)
        except BaseException:
            self.close()
            raise

    def _open(self, slots: int, timeout: Optional[float]) -> None:
        c = self._client
        request = pb.OpenCallRingRequest(
            weight_sets=self.weight_sets, regions=[pb.CallRingRegion(name=n, cuda=cuda) for n, cuda in self.regions],
            slots=slots)
        cl._set_device_id(request, self.device_id)
        opened = c._call(c._stub.OpenCallRing, request, timeout)
        if opened.layout_version != CALL_RING_LAYOUT_VERSION:
            raise errors.FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION, f"the server's call rings have layout version "
                f"{opened.layout_version}; this client speaks {CALL_RING_LAYOUT_VERSION}")
        unavailable = grpc.StatusCode.UNAVAILABLE
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection = sock
        try:
            sock.settimeout(30.0)  # the handover only; calls never touch the socket
            sock.connect(opened.socket_path)
            sock.sendall(opened.token)
            # Close-on-exec, as the ring is this process's alone (a child keeping the connection
            # would keep the ring open).
            reply, fds, flags, _ = socket.recv_fds(sock, 256, 2, socket.MSG_CMSG_CLOEXEC)
        except OSError as e:
            raise errors.Unavailable(unavailable, f"handing the ring over on {opened.socket_path}: {e} (call rings "
                                     "work only on the server's host)") from None
        if flags & socket.MSG_CTRUNC or not reply.startswith(b"OK ") or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise errors.Unavailable(unavailable, "the server did not hand the ring over: "
                                     + reply.decode("utf-8", "replace"))
        memfd, self._doorbell = fds
        try:
            self._mm = mmap.mmap(memfd, opened.ring_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise errors.ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"mapping the ring: {e}") from None
        finally:
            os.close(memfd)  # the mapping keeps the memory
        self._base = ctypes.c_char.from_buffer(self._mm)
        self._address = ctypes.addressof(self._base)
        header = RingHeader.from_buffer_copy(self._mm, 0)
        if (header.magic != CALL_RING_MAGIC or header.slots != opened.slots or header.slot_bytes != RING_SLOT_BYTES
                or header.slot_offset != RING_SLOT_OFFSET
                or RING_SLOT_OFFSET + opened.slots * RING_SLOT_BYTES > opened.ring_bytes):
            raise errors.FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                            "the ring's memory does not have this client's layout")
        self.slots, self.ring_id = int(opened.slots), int(opened.ring_id)
        self._seq = [0] * self.slots

    def close(self) -> None:
        """Closes the connection (the server closes the ring: calls not yet launched are dropped) and
        unregisters and removes the ring's own region. Idempotent."""
        self._disconnect()
        if self._arena is not None:
            try:
                self._arena.release()
            except ValueError:
                pass  # the client's channel is closed already: the server drops the region with it
            self._arena = None

    def _disconnect(self) -> None:
        self._base = None  # releases the mapping's export, so that it can be closed
        self._address = 0
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._doorbell >= 0:
            os.close(self._doorbell)
            self._doorbell = -1
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _busy_slots(self) -> List[int]:
        return [i for i in range(self.slots) if self._address and ctypes.c_uint32.from_address(
            self._slot_address(i) + RingSlotControl.complete_seq.offset).value != self._seq[i]]

    def _rebind(self, regions: List[Tuple[str, bool]], timeout: Optional[float]) -> None:
        """Reopens the ring with more regions bound (the indices of those bound before stay)."""
        busy = self._busy_slots()
        if busy:
            raise errors.FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION, f"binding new CUDA shared-memory regions reopens the ring, and "
                f"slots {busy} hold calls: wait for them first")
        slots = self.slots
        self._disconnect()
        self.regions = regions
        give_up = time.monotonic() + 5.0
        while True:
            try:
                self._open(slots, timeout)
                return
            except errors.ResourceExhausted:
                # The server closes the previous ring when its poller sees the connection end, a
                # moment after it did: until then it counts against the identity's rings.
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.01)

    def __enter__(self) -> "CallRing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._mm is None

    def region_index(self, name: str, cuda: bool = False) -> int:
        """The index a descriptor names a bound region by."""
        return _region_index(self.regions, name, cuda)

    # ---- raw calls -------------------------------------------------------------------------------

    def _slot_address(self, slot: int) -> int:
        if self._address == 0:
            raise ValueError("the call ring is closed")
        if not 0 <= slot < self.slots:
            raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"slot {slot} of a ring of {self.slots}")
        return self._address + RING_SLOT_OFFSET + slot * RING_SLOT_BYTES

    def submit(self, slot: int, descriptor: RingCallDescriptor) -> None:
        """Writes a call into `slot` and rings the doorbell if the server's poller sleeps. The slot's
        previous call must have completed (FailedPrecondition otherwise: wait for it)."""
        at = self._slot_address(slot)
        complete = ctypes.c_uint32.from_address(at + RingSlotControl.complete_seq.offset)
        if complete.value != self._seq[slot]:
            raise errors.FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                            f"slot {slot} still holds a call: wait for it first")
        ctypes.memmove(at + RING_CALL_OFFSET_IN_SLOT, ctypes.addressof(descriptor), ctypes.sizeof(RingCallDescriptor))
        seq = (self._seq[slot] + 1) & 0xFFFFFFFF
        self._seq[slot] = seq
        ctypes.c_uint32.from_address(at + RingSlotControl.submit_seq.offset).value = seq
        _full_fence()
        if ctypes.c_uint32.from_address(self._address + RingHeader.poller_sleeping.offset).value != 0:
            try:
                os.write(self._doorbell, (1).to_bytes(8, "little"))
            except BlockingIOError:
                pass  # the counter is full: the poller is being woken anyway

    def wait(self, slot: int, timeout: Optional[float] = 60.0) -> RingCallResult:
        """Waits for the completion of `slot`'s call (spinning briefly, then on a futex). A failed call
        raises its status's FusedLayerError subclass; no completion within `timeout` seconds raises
        DeadlineExceeded, and the slot stays busy until the server completes it (wait again)."""
        at = self._slot_address(slot)
        seq = self._seq[slot]
        complete = ctypes.c_uint32.from_address(at + RingSlotControl.complete_seq.offset)
        waiting = ctypes.c_uint32.from_address(at + RingSlotControl.client_waiting.offset)
        start = time.monotonic_ns()
        end = start + (int(timeout * 1e9) if timeout is not None else 1 << 62)
        done = complete.value
        while done != seq and time.monotonic_ns() - start < self._spin_ns:
            done = complete.value
        while done != seq:
            now = time.monotonic_ns()
            if now >= end:
                raise errors.DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                              "no completion from the server in time (the call may still run)")
            waiting.value = 1
            _full_fence()  # the store above before the load below, as the server's wake depends on it
            done = complete.value
            if done != seq:
                # At most 100 ms per sleep: the loop re-checks the deadline (and a wake the server
                # decided before it saw the flag).
                _futex_wait(ctypes.addressof(complete), done, min(end - now, 100_000_000) / 1e9)
            waiting.value = 0
            done = complete.value
        assert self._mm is not None
        c = RingCompletion.from_buffer_copy(self._mm, at - self._address + RING_COMPLETION_OFFSET_IN_SLOT)
        if c.code != 0:
            raise errors.from_status(errors.status_code(c.code), c.message.decode("utf-8", "replace"))
        return RingCallResult(
            path=_enum_name(pb.ExecutionPath, c.path, "EXECUTION_PATH_"),
            fallback_reason=_enum_name(pb.FallbackReason, c.fallback_reason, "FALLBACK_REASON_"),
            fallback_detail=c.fallback_detail.decode("utf-8", "replace"), batch_requests=int(c.batch_requests),
            server_seconds=float(c.server_seconds), queue_seconds=float(c.queue_seconds),
            kernel_seconds=float(c.kernel_seconds),
            stages={name: float(getattr(c, name + "_seconds")) for name in _STAGES},
            completed_by_device=bool(c.flags & RING_COMPLETED_BY_DEVICE))

    def call(self, slot: int, descriptor: RingCallDescriptor, timeout: Optional[float] = 60.0) -> RingCallResult:
        """submit + wait."""
        self.submit(slot, descriptor)
        return self.wait(slot, timeout)

    # ---- high-level calls ---------------------------------------------------------------------------

    def mhc_seam(self, weight_set: str, x: Any, residual: Optional[Any] = None, post_mix: Optional[Any] = None,
                 comb_mix: Optional[Any] = None, pre_mix: Optional[Any] = None, mode: str = "shifted",
                 stage: str = "seam", path: str = "auto", capture_aux: bool = False, timeout: Optional[float] = 60.0,
                 output: Optional[str] = None, slot: int = 0) -> cl.MhcSeamResult:
        """Client.mhc_seam through the ring: the same arguments (no verify, session or request_id) and
        result (report.backend and .device are empty and report.device_id is -1: a completion record
        does not carry them)."""
        inputs = dict(x=x, residual=residual, post_mix=post_mix, comb_mix=comb_mix, pre_mix=pre_mix)
        kind = _torch.output_kind(output, inputs.values())
        req = cl._mhc_request(weight_set, inputs, mode, stage, path, capture_aux, False, "", "", False)
        config = self._client._config(weight_set)
        cuda = cl._cuda_inputs(inputs, dict(cl._MHC_INPUT_TYPES))
        if cuda:
            placed, report = self._run_cuda(req, cuda, cl._mhc_cuda_shapes(req, cuda, config, capture_aux),
                                            weight_set, timeout, slot)
            return cl.MhcSeamResult(**{n: _placed_as_kind(n, placed.get(n), kind) for n in _MHC_OUTPUTS},
                                    report=report, request_id="", verification=None)
        mhc = config[0]
        outputs = cl._mhc_placed_outputs(req, mhc, capture_aux)
        assert mhc is not None
        shapes = cl._mhc_output_shapes(req, mhc, capture_aux)
        inline = [getattr(req, f) for f in _MHC_INPUTS if req.HasField(f)]
        arrays, report = self._run(req, inline, outputs, shapes, weight_set, timeout, slot)
        out = {name: _as_kind(arrays.get(name), kind) for name in _MHC_OUTPUTS}
        return cl.MhcSeamResult(**out, report=report, request_id="", verification=None)

    def swa_norm_quant(self, weight_set: str, qr_kv: Any, path: str = "auto", timeout: Optional[float] = 60.0,
                       output: Optional[str] = None, slot: int = 0) -> cl.SwaNormQuantResult:
        """Client.swa_norm_quant through the ring (no verify or request_id); results as mhc_seam's."""
        kind = _torch.output_kind(output, [qr_kv])
        req = cl._swa_request(weight_set, qr_kv, path, False, "")
        config = self._client._config(weight_set)
        _, swa, wq_b_rows = config
        fmt = dtypes.E4M3FNUZ if swa is not None and swa.get("fp8_format") == dtypes.E4M3FNUZ else dtypes.E4M3FN
        cuda = cl._cuda_inputs({"qr_kv": qr_kv}, {"qr_kv": pb.DATA_TYPE_BF16})
        if cuda:
            placed, report = self._run_cuda(req, cuda, cl._swa_cuda_shapes(req, cuda, config), weight_set, timeout,
                                            slot)
            return cl.SwaNormQuantResult(**{n: _placed_as_kind(n, placed.get(n), kind) for n in _SWA_OUTPUTS},
                                         fp8_format=fmt, report=report, request_id="", verification=None)
        outputs = cl._swa_placed_outputs(req, swa, wq_b_rows)
        assert swa is not None
        shapes = cl._swa_output_shapes(req, swa, wq_b_rows)
        arrays, report = self._run(req, [req.qr_kv], outputs, shapes, weight_set, timeout, slot)
        out = {name: _as_kind(arrays.get(name), kind) for name in _SWA_OUTPUTS}
        return cl.SwaNormQuantResult(**out, fp8_format=fmt, report=report, request_id="", verification=None)

    def _run(self, req: Any, inline: Sequence[Any], outputs: Sequence[Tuple[str, int]],
             shapes: Mapping[str, Tuple[int, ...]], weight_set: str, timeout: Optional[float],
             slot: int) -> Tuple[Dict[str, np.ndarray], cl.ExecutionReport]:
        """One call of a request built by the client's helpers: inputs copied into the ring's region,
        outputs placed there (transport="shm"'s arena, which keeps its region's name when it grows),
        the descriptor made from the request, the outputs copied out."""
        if self._arena is None:
            raise ValueError("this ring has no region of its own (region_bytes=0): use submit/wait")
        with self._lock:
            self._arena.place(req, inline, outputs)
            descriptor = ring_call_of(req, self.weight_sets, self.regions, deadline=timeout)
            start = time.perf_counter()
            r = self.call(slot, descriptor, timeout)
            elapsed = time.perf_counter() - start
            buf = self._arena.buffer
            arrays: Dict[str, np.ndarray] = {}
            for p in req.output_placements:
                ref = p.shared_memory
                wire = cl._OUTPUT_WIRE[p.output]
                arrays[p.output] = np.frombuffer(buf[ref.offset:ref.offset + ref.byte_size],
                                                 dtype=wire).reshape(shapes[p.output]).astype(wire.newbyteorder("="))
        return arrays, _report(r, weight_set, elapsed)

    def _run_cuda(self, req: Any, cuda: Dict[str, Tuple[Any, Any]], shapes: Dict[str, Tuple[int, ...]],
                  weight_set: str, timeout: Optional[float], slot: int) -> Tuple[Dict[str, Any], cl.ExecutionReport]:
        """One call whose inputs are CUDA tensors: referenced in place and the outputs placed in fresh
        device tensors by CUDA shared memory, as the client's RPCs do (its regions, registered once per
        allocation); a region the ring does not bind yet is bound by reopening it."""
        with self._lock:
            placed = self._client._cuda_place(req, cuda, shapes, timeout)
            fields = [f for f in (*_MHC_INPUTS, "qr_kv") if f in req.DESCRIPTOR.fields_by_name and req.HasField(f)]
            names = {getattr(req, f).cuda_shared_memory.region for f in fields
                     if getattr(req, f).WhichOneof("storage") == "cuda_shared_memory"}
            names |= {p.cuda_shared_memory.region for p in req.output_placements
                      if p.WhichOneof("target") == "cuda_shared_memory"}
            missing = sorted(n for n in names if (n, True) not in self.regions)
            if missing:
                self._rebind(self.regions + [(n, True) for n in missing], timeout)
            descriptor = ring_call_of(req, self.weight_sets, self.regions, deadline=timeout)
            start = time.perf_counter()
            r = self.call(slot, descriptor, timeout)
            elapsed = time.perf_counter() - start
        return placed, _report(r, weight_set, elapsed)


def _report(r: RingCallResult, weight_set: str, elapsed: float) -> cl.ExecutionReport:
    return cl.ExecutionReport(path=r.path, fallback_reason=r.fallback_reason, fallback_detail=r.fallback_detail,
                              backend="", device="", weight_set=weight_set, kernel_seconds=r.kernel_seconds,
                              queue_seconds=r.queue_seconds, server_seconds=r.server_seconds,
                              round_trip_seconds=elapsed, stages=dict(r.stages))


def _placed_as_kind(name: str, tensor: Any, kind: str) -> Any:
    """An output the server wrote into a device tensor: as it is, or as numpy."""
    if tensor is None or kind == "torch":
        return tensor
    return _torch.host_array(name, tensor.cpu(), cl._OUTPUT_WIRE[name])


def _as_kind(array: Optional[np.ndarray], kind: str) -> Any:
    return _torch.to_torch(array) if kind == "torch" else array
