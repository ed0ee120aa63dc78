"""The bf16 / fp8 helpers against independent definitions (exhaustive where the domain is small)."""

import struct
from fractions import Fraction

import numpy as np
import pytest

import fusedlayer
from fusedlayer import reference


def test_bf16_round_trip_is_exact_for_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = fusedlayer.float32_to_bf16(fusedlayer.bf16_to_float32(bits))
    is_nan = ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)
    assert np.array_equal(back[~is_nan], bits[~is_nan])
    # NaNs come back as the quiet NaN with their sign, as numeric.h does.
    assert np.array_equal(back[is_nan], (bits[is_nan] & 0x8000) | 0x7FC0)


def _rne_bf16_by_fractions(f):
    """Round a finite float32 to bf16 by exact rational arithmetic (ties to even), as bits."""
    (u,) = struct.unpack("<I", struct.pack("<f", f))
    lo = u >> 16
    hi = lo + 1
    def value(b):
        return Fraction(struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]) if (b & 0x7F80) != 0x7F80 \
            else None
    x = Fraction(f)
    vlo, vhi = value(lo), value(hi)
    if vhi is None:  # the next pattern is inf: IEEE overflow threshold is max + half an ulp
        vhi = value(lo) + (value(lo) - value(lo - 1))
    dlo, dhi = abs(x - vlo), abs(vhi - x)
    if dlo < dhi or (dlo == dhi and lo % 2 == 0):
        return lo
    return hi & 0xFFFF if value(hi) is not None else (lo & 0x8000) | 0x7F80


def test_bf16_rounding_is_nearest_even():
    rng = np.random.default_rng()
    # Random bit patterns hit every binade; ties (low half exactly 0x8000) are forced in half of them.
    u = rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)
    u[::2] = (u[::2] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    f = u.view(np.float32)
    f = f[np.isfinite(f)]
    got = fusedlayer.float32_to_bf16(f)
    want = np.array([_rne_bf16_by_fractions(float(v)) for v in f], dtype=np.uint16)
    assert np.array_equal(got, want)


def test_bf16_nan_inf_and_overflow():
    f = np.array([np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38], np.float32)
    f[2] = np.frombuffer(struct.pack("<I", 0x7F800001), np.float32)[0]  # signalling NaN, low payload only
    got = fusedlayer.float32_to_bf16(f)
    assert [hex(v) for v in got] == ["0x7f80", "0xff80", "0x7fc0", "0xffc0", "0x7f80", "0xff80"]


def test_bf16_helpers_refuse_other_dtypes():
    with pytest.raises(TypeError):
        fusedlayer.float32_to_bf16(np.zeros(3, np.float64))
    with pytest.raises(TypeError):
        fusedlayer.bf16_to_float32(np.zeros(3, np.int16))


def _fp8_by_definition(code, bias, fnuz):
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if fnuz and code == 0x80:
        return float("nan")
    if not fnuz and e == 0xF and m == 7:
        return float("nan")
    mag = Fraction(m, 8) * Fraction(2) ** (1 - bias) if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - bias)
    return float(-mag if s else mag)


@pytest.mark.parametrize("fmt,bias,fnuz,top", [("e4m3fn", 7, False, 448.0), ("e4m3fnuz", 8, True, 240.0)])
def test_fp8_decode_every_code(fmt, bias, fnuz, top):
    codes = np.arange(256, dtype=np.uint8)
    got = fusedlayer.fp8_to_float32(codes, fmt)
    want = np.array([_fp8_by_definition(int(c), bias, fnuz) for c in codes], np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].astype(np.float64), want[~nan])
    assert np.nanmax(got) == top and np.nanmin(got) == -top
    assert np.count_nonzero(nan) == (1 if fnuz else 2)


def test_fp8_decode_rejects_unknown_format():
    with pytest.raises(ValueError):
        fusedlayer.fp8_to_float32(np.zeros(1, np.uint8), "e5m2")


def test_reference_fma32_is_correctly_rounded():
    rng = np.random.default_rng()
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = (rng.standard_normal(3000) * np.exp2(rng.integers(-30, 30, 3000))).astype(np.float32)
    got = reference.fma32(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        g = Fraction(float(got[i]))
        # The neighbours of the result are no closer to the exact value.
        up = Fraction(float(np.nextafter(got[i], np.float32(np.inf))))
        down = Fraction(float(np.nextafter(got[i], np.float32(-np.inf))))
        assert abs(g - exact) <= abs(up - exact) and abs(g - exact) <= abs(down - exact), i
