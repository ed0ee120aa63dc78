"""torch.Tensor inputs and outputs, without making torch a dependency.

torch is imported only when a caller hands in a tensor (it is then in sys.modules already) or asks
for torch outputs (output="torch"); a machine without torch never imports it.

- CPU tensors become numpy arrays of the wire dtype by zero-copy views when they are contiguous
  (torch.bfloat16 -> uint16 bit patterns through an int16 view, torch.float32 -> float32); a
  non-contiguous tensor is made contiguous first (one copy). Only the dtype the wire takes is
  accepted: a float32 tensor where bf16 goes is a TypeError, as for numpy (a silent conversion would
  round).
- Outputs become torch tensors by torch.from_numpy over the decoded arrays (no further copy); bf16
  outputs are torch.bfloat16, fp32 torch.float32, fp8 codes torch.uint8.
- CUDA tensors travel by CUDA shared memory (CudaRegions below).
"""

import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

OUTPUTS = ("numpy", "torch")


def loaded() -> Any:
    """The torch module if the process imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def require() -> Any:
    """torch, imported; an ImportError saying why when it is not installed."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("output=\"torch\" needs torch (Debian: apt-get install python3-torch); fusedlayer itself "
                          "does not depend on it") from e
    return torch


def is_tensor(value: Any) -> bool:
    torch = loaded()
    return torch is not None and isinstance(value, torch.Tensor)


def is_cuda(value: Any) -> bool:
    return is_tensor(value) and bool(value.is_cuda)


def output_kind(output: Optional[str], inputs: Iterable[Any]) -> str:
    """The result's array kind: as asked, else torch when any input is a torch tensor, else numpy."""
    if output is None:
        return "torch" if any(is_tensor(v) for v in inputs) else "numpy"
    if output not in OUTPUTS:
        raise ValueError(f"output = {output!r}; expected one of {', '.join(OUTPUTS)} (or None: like the inputs)")
    if output == "torch":
        require()
    return output


def _wire_torch_dtype(torch: Any, wire: np.dtype) -> Any:
    return {2: torch.bfloat16, 4: torch.float32, 1: torch.uint8}[wire.itemsize]


def _dtype_name(wire: np.dtype) -> str:
    return {2: "torch.bfloat16", 4: "torch.float32", 1: "torch.uint8"}[wire.itemsize]


def host_array(name: str, tensor: Any, wire: np.dtype) -> np.ndarray:
    """A CPU torch tensor as a numpy array of the wire dtype (a view when contiguous)."""
    torch = loaded()
    want = _wire_torch_dtype(torch, wire)
    if tensor.dtype != want:
        raise TypeError(f"{name} must be a {_dtype_name(wire)} tensor, got {tensor.dtype} (convert explicitly "
                        "first: a silent conversion would round)")
    if tensor.is_cuda:
        raise TypeError(f"{name} is a CUDA tensor: host_array takes CPU tensors")
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if want == torch.bfloat16:
        return np.asarray(t.view(torch.int16).numpy()).view(np.uint16)
    return np.asarray(t.numpy())


def to_torch(array: Optional[np.ndarray], device: Any = None) -> Any:
    """A decoded output (numpy, wire dtype) as a torch tensor sharing its memory (on `device` if given)."""
    if array is None:
        return None
    torch = require()
    if array.dtype == np.uint16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t if device is None else t.to(device)


# ---- CUDA shared memory --------------------------------------------------------------------------

def _untyped_storage(t: Any) -> Any:
    # torch >= 2.0: Tensor.untyped_storage(); 1.13 (Debian 12): Tensor.storage().untyped().
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def cuda_ipc_handle(shared: bytes) -> bytes:
    """The cudaIpcMemHandle_t of torch's storage._share_cuda_() handle. Older torch gives the 64 bytes
    as they are; newer torch prefixes them with a format version byte and a kind byte: b"c" for a
    block of cudaMalloc (its cudaIpcMemHandle_t follows), b"e" for an expandable segment
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which has no cudaIpcMemHandle_t to send."""
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) == CUDA_IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    import grpc
    from . import errors
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise errors.FailedPrecondition(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this CUDA tensor lies in one of torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which cannot be shared by a CUDA IPC handle; allocate the tensors "
            "passed to fusedlayer without expandable segments, or copy them to the host")
    raise errors.InvalidArgument(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"torch's CUDA IPC handle has {len(shared)} bytes in a format this client does not know "
        f"(a cudaIpcMemHandle_t is {CUDA_IPC_HANDLE_BYTES}, or that with torch's 2-byte prefix)")


class CudaRegions:
    """The CUDA shared-memory regions of one client: one per device allocation a tensor lies in,
    registered on first use by its CUDA IPC handle (torch's storage._share_cuda_()) and kept (cached
    by device, handle, offset and size) until close; the caller unregisters them."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._names: Dict[Tuple[int, bytes, int, int], str] = {}

    def names(self) -> List[str]:
        return list(self._names.values())

    def clear(self) -> None:
        self._names.clear()

    def forget(self, name: str) -> None:
        """Drops a region whose registration failed."""
        self._names = {k: v for k, v in self._names.items() if v != name}

    def locate(self, tensor: Any) -> Tuple[Optional[Tuple[str, bytes, int, int, int]], str, int, int]:
        """(registration to make first or None, region, offset in it, bytes) of a contiguous CUDA tensor.
        A registration is (name, raw_handle, device_id, offset, byte_size) for RegisterCudaSharedMemory."""
        storage = _untyped_storage(tensor)
        shared = storage._share_cuda_()
        device, size, storage_offset = int(shared[0]), int(shared[2]), int(shared[3])
        handle = cuda_ipc_handle(bytes(shared[1]))
        key = (device, handle, storage_offset, size)
        registration = None
        if key not in self._names:
            name = f"{self._prefix}-{len(self._names)}-{storage_offset:x}"
            self._names[key] = name
            registration = (name, handle, device, storage_offset, size)
        offset = tensor.storage_offset() * tensor.element_size()
        return registration, self._names[key], offset, tensor.numel() * tensor.element_size()


Register = Callable[[str, bytes, int, int, int], None]


def cuda_inputs_and_outputs(regions: CudaRegions, request: Any, inputs: Dict[str, Tuple[Any, Any]],
                            outputs: List[Tuple[str, int]], output_dtypes: Dict[str, np.dtype],
                            output_shapes: Dict[str, Tuple[int, ...]],
                            device: Any) -> Tuple[List[Tuple[str, bytes, int, int, int]], Dict[str, Any]]:
    """Fills `request` for CUDA tensors: every input (name -> (tensor, wire DataType)) referenced in
    its allocation's region, every output (name, bytes) placed in a fresh device tensor. Returns the
    registrations to make before the call and the output tensors (name -> tensor) the server writes."""
    import torch
    registrations: List[Tuple[str, bytes, int, int, int]] = []
    for name, (tensor, data_type) in inputs.items():
        if not tensor.is_cuda or tensor.device != device:
            raise TypeError(f"{name} is on {tensor.device}, the other inputs on {device}: one device per call")
        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        reg, region, offset, nbytes = regions.locate(t)
        if reg is not None:
            registrations.append(reg)
        field = getattr(request, name)
        field.dtype = data_type
        field.shape[:] = list(t.shape)
        field.cuda_shared_memory.region, field.cuda_shared_memory.offset = region, offset
        field.cuda_shared_memory.byte_size = nbytes
    out: Dict[str, Any] = {}
    for name, nbytes in outputs:
        t = torch.empty(output_shapes[name], dtype=_wire_torch_dtype(torch, output_dtypes[name]), device=device)
        reg, region, offset, size = regions.locate(t)
        assert size == nbytes, (name, size, nbytes)
        if reg is not None:
            registrations.append(reg)
        placement = request.output_placements.add(output=name)
        placement.cuda_shared_memory.region, placement.cuda_shared_memory.offset = region, offset
        placement.cuda_shared_memory.byte_size = size
        out[name] = t
    # The server's kernels read the inputs once the call arrives: what this process queued must be done.
    torch.cuda.synchronize(device)
    return registrations, out
