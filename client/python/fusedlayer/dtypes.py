"""bf16 and fp8 conversions with numpy, bit-compatible with the server (kernels/.../numeric.h).

bf16 tensors travel as ``numpy.uint16`` arrays of bit patterns (the upper half of a float32), fp8
tensors as ``numpy.uint8`` codes. numpy has no bf16 or fp8 dtype, and no Debian 12 package offers
one (ml_dtypes is not packaged), so these helpers are ours:

- ``float32_to_bf16``: round to nearest, ties to even; NaN stays a quiet NaN with its sign
  (0x7fc0 | sign); overflow rounds to +-inf as IEEE requires.
- ``bf16_to_float32``: exact.
- ``fp8_to_float32``: exact decode of e4m3fn (OCP: max 448, NaN S.1111.111, no inf) or e4m3fnuz
  (max 240, NaN 0x80, no -0, no inf).
"""

from typing import Any, Dict

import numpy as np

E4M3FN = "e4m3fn"
E4M3FNUZ = "e4m3fnuz"
FP8_FORMATS = (E4M3FN, E4M3FNUZ)
FP8_MAX = {E4M3FN: 448.0, E4M3FNUZ: 240.0}


def float32_to_bf16(values: Any) -> np.ndarray:
    """float32 array (any shape) -> uint16 bf16 bit patterns, round to nearest even."""
    f = np.asarray(values)
    if f.dtype != np.float32:
        raise TypeError(f"float32_to_bf16 takes float32 values, got {f.dtype} (convert explicitly first: "
                        "a silent float64 -> float32 step would round twice)")
    u = np.ascontiguousarray(f).view(np.uint32)
    # uint32 arithmetic wraps like the C++ code; the largest finite float plus the bias reaches
    # 0x7f800000 (inf), never past the sign bit.
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet_nan = (((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)).astype(np.uint16)
    return np.where(is_nan, quiet_nan, rounded)


def bf16_to_float32(bits: Any) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16_to_float32 takes uint16 bit patterns, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(values: Any) -> np.ndarray:
    """float32 -> float32 rounded through bf16 (the value the server would store)."""
    return bf16_to_float32(float32_to_bf16(values))


def _fp8_table(fmt: str) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = (codes & 0x7).astype(np.float64)
    bias = 7 if fmt == E4M3FN else 8
    subnormal = m * 2.0 ** (1 - bias - 3)
    normal = (1.0 + m / 8.0) * np.exp2(e.astype(np.float64) - bias)
    values = sign * np.where(e == 0, subnormal, normal)
    if fmt == E4M3FN:
        values[(e == 0xF) & ((codes & 0x7) == 0x7)] = np.nan
    else:
        values[0x80] = np.nan  # fnuz: 0x80 is the only NaN, and there is no negative zero
    return values.astype(np.float32)


_FP8_TABLES: Dict[str, np.ndarray] = {fmt: _fp8_table(fmt) for fmt in FP8_FORMATS}


def fp8_to_float32(codes: Any, fmt: str = E4M3FN) -> np.ndarray:
    """uint8 fp8 codes -> float32 (exact), for fmt 'e4m3fn' or 'e4m3fnuz'."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"fp8_to_float32 takes uint8 codes, got {c.dtype}")
    if fmt not in _FP8_TABLES:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {FP8_FORMATS}")
    return _FP8_TABLES[fmt][c]
