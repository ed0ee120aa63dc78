"""Weight sets on the client side: numpy arrays or a manifest -> LoadWeights header + payload.

Two sources, one result (a ``PackedWeightSet``: a ``WeightSetHeader`` and the payload bytes):

- ``pack_arrays(name, tensors, mhc=..., swa=...)``: a dict of numpy arrays named as in
  docs/weights.md ("mhc.fn", "swa.q_norm", ...), fp32 tensors as float32, bf16 tensors as uint16 bit
  patterns, ``swa.wq_b`` as uint8 fp8 codes in the set's ``fp8_format``;
- ``pack_manifest(path)``: the JSON manifest format of docs/weights.md, reading only the named
  tensors from each safetensors file, with the same exact-only dtype conversions as the server's
  manifest loader (weights/dtype_conversion.h): nothing is rounded silently.

The server validates every set again (shapes, hyper-parameters, names); these functions check what
they need to build a correct stream and raise the exception class the server's own manifest loader
would answer with, naming the manifest, set and tensor: ``fusedlayer.NotFound`` (``.code`` NOT_FOUND)
for a missing manifest, safetensors file or tensor, ``fusedlayer.PermissionDenied`` for an unreadable
file, ``fusedlayer.InvalidArgument`` (INVALID_ARGUMENT) for everything else. Every set is packed
before anything is sent, so a bad manifest loads nothing.
"""

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

import grpc

from . import dtypes, errors
from .v1 import fusedlayer_pb2 as pb

# The table of docs/weights.md, in payload order: name -> kind of dtype ("fp32", "bf16", "fp8").
TENSOR_KINDS: Dict[str, str] = {
    "mhc.fn": "fp32", "mhc.scale": "fp32", "mhc.base": "fp32", "mhc.norm_weight": "bf16",
    "swa.q_norm": "bf16", "swa.kv_norm": "bf16", "swa.wq_b": "fp8", "swa.wq_b_scale": "fp32",
}
_ALIGN = 64  # each tensor starts at a multiple of 64 bytes, like the server's packing

MHC_KEYS: Dict[str, type] = {"hc_mult": int, "hidden": int, "hc_norm_eps": float, "norm_eps": float, "hc_pre_eps": float,
            "sinkhorn_eps": float, "post_scale": float, "sinkhorn_iters": int}
SWA_KEYS: Dict[str, type] = {"q_rank": int, "head_dim": int, "eps": float, "fp8_format": str, "scale_format": str,
            "scale_layout": str}
_SWA_ENUMS: Dict[str, Dict[str, Any]] = {
    "fp8_format": {"e4m3fn": pb.FP8_FORMAT_E4M3FN, "e4m3fnuz": pb.FP8_FORMAT_E4M3FNUZ},
    "scale_format": {"fp32": pb.SCALE_FORMAT_FP32, "ue8m0": pb.SCALE_FORMAT_UE8M0},
    "scale_layout": {"row_major": pb.SCALE_LAYOUT_ROW_MAJOR, "column_major_tma": pb.SCALE_LAYOUT_COLUMN_MAJOR_TMA},
}


def _invalid(message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, message)


def _not_found(message: str) -> errors.NotFound:
    return errors.NotFound(grpc.StatusCode.NOT_FOUND, message)


def _os_error(e: OSError, what: str) -> errors.FusedLayerError:
    """An OSError opening or reading a file -> the class the server's loader answers with (ErrnoStatus)."""
    message = f"{what}: {e.strerror or e}"
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return _not_found(message)
    if isinstance(e, PermissionError):
        return errors.PermissionDenied(grpc.StatusCode.PERMISSION_DENIED, message)
    return errors.Internal(grpc.StatusCode.INTERNAL, message)


@dataclass
class PackedWeightSet:
    header: "pb.WeightSetHeader"
    payload: bytes


def _config(kind: str, config: Any, keys: Mapping[str, type], where: str) -> Any:
    if not isinstance(config, dict):
        raise _invalid(f"{where}: '{kind}' must be an object/dict, got {type(config).__name__}")
    msg = pb.MhcConfig() if kind == "mhc" else pb.SwaConfig()
    for key, value in config.items():
        if key not in keys:
            raise _invalid(f"{where}: unknown {kind} key '{key}' (known: {', '.join(keys)})")
        want = keys[key]
        # bool is an int in Python; a JSON true for hc_mult is a typo, not 1.
        if isinstance(value, bool) or not isinstance(value, (int, float) if want is float else want):
            raise _invalid(f"{where}: {kind}.{key} must be {want.__name__}, got {value!r}")
        if key in _SWA_ENUMS:
            if value not in _SWA_ENUMS[key]:
                raise _invalid(f"{where}: swa.{key} = '{value}', expected one of {', '.join(_SWA_ENUMS[key])}")
            value = _SWA_ENUMS[key][value]
        setattr(msg, key, value)
    for required in (("hc_mult", "hidden") if kind == "mhc" else ("q_rank", "head_dim")):
        if required not in config:
            raise _invalid(f"{where}: {kind}.{required} is required")
    return msg


def _fp8_format_name(swa_msg: Any) -> str:
    return dtypes.E4M3FNUZ if swa_msg is not None and swa_msg.fp8_format == pb.FP8_FORMAT_E4M3FNUZ else dtypes.E4M3FN


def _pack(name: str, tensors: Mapping[str, Tuple[int, np.ndarray]], mhc_msg: Any, swa_msg: Any, replace: bool,
          where: str) -> "PackedWeightSet":
    """tensors: name -> (DataType, numpy array of the wire dtype)."""
    header = pb.WeightSetHeader(name=name, replace=replace)
    if mhc_msg is not None:
        header.mhc.CopyFrom(mhc_msg)
    if swa_msg is not None:
        header.swa.CopyFrom(swa_msg)
    payload = bytearray()
    for tname in sorted(tensors, key=lambda n: list(TENSOR_KINDS).index(n)):
        dtype, array = tensors[tname]
        payload.extend(b"\0" * (-len(payload) % _ALIGN))
        header.tensors.add(name=tname, dtype=dtype, shape=list(array.shape), offset=len(payload))
        payload.extend(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    header.payload_bytes = len(payload)
    header.sha256 = hashlib.sha256(payload).hexdigest()
    return PackedWeightSet(header, bytes(payload))


def pack_arrays(name: str, tensors: Mapping[str, Any], mhc: Optional[Mapping[str, Any]] = None,
                swa: Optional[Mapping[str, Any]] = None, replace: bool = False) -> "PackedWeightSet":
    """One weight set from numpy arrays; mhc / swa are config dicts (keys of docs/weights.md)."""
    where = f"weight set '{name}'"
    mhc_msg = _config("mhc", mhc, MHC_KEYS, where) if mhc is not None else None
    swa_msg = _config("swa", swa, SWA_KEYS, where) if swa is not None else None
    fp8 = pb.DATA_TYPE_FP8_E4M3FNUZ if _fp8_format_name(swa_msg) == dtypes.E4M3FNUZ else pb.DATA_TYPE_FP8_E4M3FN
    wire = {"fp32": (np.float32, pb.DATA_TYPE_FP32), "bf16": (np.uint16, pb.DATA_TYPE_BF16), "fp8": (np.uint8, fp8)}
    packed = {}
    for tname, array in tensors.items():
        if tname not in TENSOR_KINDS:
            raise _invalid(f"{where}: unknown tensor name '{tname}' (known: {', '.join(TENSOR_KINDS)})")
        array = np.asarray(array)
        np_dtype, data_type = wire[TENSOR_KINDS[tname]]
        if array.dtype != np_dtype:
            raise _invalid(f"{where}: {tname} must be a numpy {np.dtype(np_dtype).name} array "
                            f"({TENSOR_KINDS[tname]}{' bit patterns' if np_dtype is np.uint16 else ''}"
                            f"{' codes' if np_dtype is np.uint8 else ''}), got {array.dtype}")
        packed[tname] = (data_type, array)
    return _pack(name, packed, mhc_msg, swa_msg, replace, where)


# ---- manifest + safetensors --------------------------------------------------------------------

def _reject_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _invalid(f"duplicate key '{key}'")
        out[key] = value
    return out


_ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F8_E4M3": ("u1", 1),
              "F8_E4M3FNUZ": ("u1", 1), "F8_E8M0": ("u1", 1)}


class _SafetensorsFile:
    """Reads the header once; tensors on demand (only the ones a manifest names)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.size = os.path.getsize(path)
            f = open(path, "rb")
        except OSError as e:
            raise _os_error(e, f"safetensors file {path}") from None
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise _invalid(f"{path}: not a safetensors file (under 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000 or 8 + n > self.size:
                raise _invalid(f"{path}: header length {n} is past the end of the file or over 100 MB")
            try:
                self.header = json.loads(f.read(n), object_pairs_hook=_reject_duplicates)
            except (ValueError, errors.InvalidArgument) as e:
                raise _invalid(f"{path}: malformed safetensors header: {getattr(e, 'message', e)}") from None
        self.data_start = 8 + n

    def read(self, tensor: str) -> Tuple[str, np.ndarray]:
        entry = self.header.get(tensor)
        if tensor == "__metadata__" or not isinstance(entry, dict):
            raise KeyError(tensor)
        dtype = entry.get("dtype")
        if dtype not in _ST_DTYPES:
            raise _invalid(f"{self.path}: tensor '{tensor}' has dtype {dtype}, which no weight-set tensor takes")
        np_dtype, size = _ST_DTYPES[dtype]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(v) for v in entry["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * size or self.data_start + end > self.size:
            raise _invalid(f"{self.path}: tensor '{tensor}' data_offsets do not match its shape or the file size")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        return dtype, np.frombuffer(raw, dtype=np_dtype).reshape(shape)


def _to_fp32(dtype: str, a: np.ndarray, what: str) -> np.ndarray:
    if dtype == "F32":
        return a.astype(np.float32)
    if dtype == "F16":
        return a.astype(np.float32)  # exact: every fp16 value is an fp32 value
    if dtype == "BF16":
        return dtypes.bf16_to_float32(a.astype(np.uint16))
    if dtype == "F8_E8M0":
        if np.any(a == 0xFF):
            raise _invalid(f"{what}: F8_E8M0 code 0xFF (NaN) at element {int(np.argmax(a.ravel() == 0xFF))}")
        return np.ldexp(np.float32(1.0), a.astype(np.int32) - 127).astype(np.float32)
    raise _invalid(f"{what}: dtype {dtype} cannot become fp32 (accepted: F32, BF16, F16, F8_E8M0)")


def _to_bf16(dtype: str, a: np.ndarray, what: str) -> np.ndarray:
    if dtype == "BF16":
        return a.astype(np.uint16)
    if dtype in ("F32", "F16"):
        f = a.astype(np.float32)
        bits = dtypes.float32_to_bf16(f)
        back = dtypes.bf16_to_float32(bits)
        changed = ~((back == f) | (np.isnan(back) & np.isnan(f)))
        if np.any(changed):
            i = int(np.argmax(changed.ravel()))
            raise _invalid(f"{what}: {dtype} value {f.ravel()[i]!r} at element {i} is not a bf16 value "
                             "(only exact conversions are done)")
        return bits
    raise _invalid(f"{what}: dtype {dtype} cannot become bf16 (accepted: BF16, or F32/F16 holding bf16 values)")


def pack_manifest(path: Union[str, "os.PathLike[str]"], replace: bool = False) -> List["PackedWeightSet"]:
    """Every weight set of a manifest (docs/weights.md), packed for LoadWeights."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise _os_error(e, f"cannot open manifest {path}") from None
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, errors.InvalidArgument) as e:
        raise _invalid(f"manifest {path}: {getattr(e, 'message', e)}") from None
    if not isinstance(doc, dict) or set(doc) != {"weight_sets"} or not isinstance(doc["weight_sets"], list):
        raise _invalid(f"manifest {path}: expected {{\"weight_sets\": [...]}} and no other key")
    base = os.path.dirname(os.path.abspath(path))
    files = {}
    out = []
    seen = set()
    for i, entry in enumerate(doc["weight_sets"]):
        where = f"manifest {path}: weight_sets[{i}]"
        if not isinstance(entry, dict):
            raise _invalid(f"{where}: must be an object")
        unknown = set(entry) - {"name", "mhc", "swa", "tensors"}
        if unknown:
            raise _invalid(f"{where}: unknown key '{sorted(unknown)[0]}'")
        name = entry.get("name")
        if not isinstance(name, str):
            raise _invalid(f"{where}: 'name' (a string) is required")
        where = f"manifest {path}: weight set '{name}'"
        if name in seen:
            raise _invalid(f"{where}: duplicate set name")
        seen.add(name)
        mhc_msg = _config("mhc", entry["mhc"], MHC_KEYS, where) if "mhc" in entry else None
        swa_msg = _config("swa", entry["swa"], SWA_KEYS, where) if "swa" in entry else None
        tensors = entry.get("tensors")
        if not isinstance(tensors, dict):
            raise _invalid(f"{where}: 'tensors' (an object) is required")
        packed = {}
        for tname, ref in tensors.items():
            what = f"{where}: {tname}"
            if tname not in TENSOR_KINDS:
                raise _invalid(f"{where}: unknown tensor name '{tname}'")
            if not isinstance(ref, dict) or set(ref) != {"file", "tensor"} or not all(
                    isinstance(v, str) for v in ref.values()):
                raise _invalid(f"{what}: expected {{\"file\": ..., \"tensor\": ...}} (strings)")
            file = ref["file"] if os.path.isabs(ref["file"]) else os.path.join(base, ref["file"])
            if file not in files:
                files[file] = _SafetensorsFile(file)
            try:
                st_dtype, array = files[file].read(ref["tensor"])
            except KeyError:
                raise _not_found(f"{what}: tensor '{ref['tensor']}' not found in {file}") from None
            what = f"{what} ({file}:{ref['tensor']})"
            kind = TENSOR_KINDS[tname]
            if kind == "fp32":
                packed[tname] = (pb.DATA_TYPE_FP32, _to_fp32(st_dtype, array, what))
            elif kind == "bf16":
                packed[tname] = (pb.DATA_TYPE_BF16, _to_bf16(st_dtype, array, what))
            else:
                want = "F8_E4M3FNUZ" if _fp8_format_name(swa_msg) == dtypes.E4M3FNUZ else "F8_E4M3"
                if st_dtype != want:
                    raise _invalid(f"{what}: dtype {st_dtype}, the set's fp8_format needs {want} (never converted)")
                data_type = pb.DATA_TYPE_FP8_E4M3FNUZ if want == "F8_E4M3FNUZ" else pb.DATA_TYPE_FP8_E4M3FN
                packed[tname] = (data_type, array.astype(np.uint8))
        out.append(_pack(name, packed, mhc_msg, swa_msg, replace, where))
    return out


def write_safetensors(path: Union[str, "os.PathLike[str]"], tensors: Mapping[str, Tuple[str, Any]],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes {name: (safetensors dtype, numpy array)} as a safetensors file (tests, examples), with an
    optional __metadata__ of strings."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, blobs = 0, []
    for name, (dtype, array) in tensors.items():
        blob = np.ascontiguousarray(array).astype(np.dtype(_ST_DTYPES[dtype][0]), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
