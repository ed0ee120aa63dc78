"""fp64 numpy reference of the mHC seam (docs/spec/mhc.md), written from the spec alone.

For checking a server's results locally (the tests and examples/whole_model.py do). Like the C++
reference of tests/kernels/mhc_reference.cc, it rounds to bf16 exactly where the contract does and
otherwise computes in double:

- Post and the collapse are contract-fixed fp32 FMA chains: computed bit-exactly with an emulated
  fp32 fma (the exact product in double, the sum rounded to odd in double, then once to fp32:
  double has more than 2 x 24 + 2 bits, so that is the correctly rounded fma);
- the sum of squares, the mixes GEMM, sigmoids, Sinkhorn and the RMSNorm statistics are double; the
  mixes are returned unrounded (float64) for tolerance checks.

Tolerances (the contract's, both modes): ``check_seam`` applies them.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from .dtypes import bf16_to_float32, float32_to_bf16

DEFAULTS = {"hc_norm_eps": 1e-6, "norm_eps": 1e-6, "hc_pre_eps": 1e-6, "sinkhorn_eps": 1e-6, "post_scale": 2.0,
            "sinkhorn_iters": 20}


def _round_to_odd_sum(p: Any, c: Any) -> np.ndarray:
    """p + c in float64, rounded to odd (exact sum via TwoSum, then the lsb forced odd if inexact)."""
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    fix = (err != 0) & even
    if np.any(fix):
        s = s.copy()
        s[fix] = np.nextafter(s[fix], np.where(err[fix] > 0, np.inf, -np.inf))
    return s


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Correctly rounded fp32 fma(a, b, c) on float32 arrays (broadcasting)."""
    p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)  # exact
    c = np.broadcast_to(np.asarray(c, np.float32).astype(np.float64), p.shape)
    return _round_to_odd_sum(p, c).astype(np.float32)


def double_to_bf16(d: Any) -> np.ndarray:
    """float64 -> bf16 bits, one round to nearest even (via fp32 rounded to odd: 24 >= 8 + 2 bits)."""
    d = np.asarray(d, np.float64)
    f = d.astype(np.float32)
    inexact = f.astype(np.float64) != d
    even = (f.view(np.uint32) & np.uint32(1)) == 0
    fix = inexact & even & np.isfinite(d)
    if np.any(fix):
        f = f.copy()
        f[fix] = np.nextafter(f[fix], np.where(d[fix] > f[fix], np.float32(np.inf), np.float32(-np.inf)))
    return float32_to_bf16(f)


@dataclass
class SeamReference:
    new_residual: np.ndarray             # bf16 bits [T, n, C]
    y: np.ndarray                        # bf16 bits [T, C]
    new_pre_mix: Optional[np.ndarray]    # float64 [T, n] (None for head)
    new_post_mix: Optional[np.ndarray]
    new_comb_mix: Optional[np.ndarray]   # float64 [T, n, n]
    z: np.ndarray                        # bf16 bits [T, C]: the collapse before the norm
    rho: np.ndarray                      # float64 [T, 1]: the RMSNorm factor (1 without a norm weight)
    norm_weight: Optional[np.ndarray]    # bf16 bits [C], as given


def _mix(R: Any, fn: Any, scale: Any, base: Any, hp: Mapping[str, Any], n: int) -> Any:
    """Mix_theta(R') per token: R float64 [T, n, C] (bf16 values)."""
    T, _, C = R.shape
    K = n * C
    flat = R.reshape(T, K)
    S = np.sum(flat * flat, axis=1)
    r = 1.0 / np.sqrt(S / K + hp["hc_norm_eps"])
    d = flat @ fn.astype(np.float64).T  # [T, M]
    alpha = np.concatenate([np.full(n, scale[0]), np.full(n, scale[1]), np.full(n * n, scale[2])]).astype(np.float64)
    a = (r[:, None] * d) * alpha + base.astype(np.float64)
    pre = 1.0 / (1.0 + np.exp(-a[:, :n])) + hp["hc_pre_eps"]
    post = 1.0 / (1.0 + np.exp(-a[:, n:2 * n])) * hp["post_scale"]
    L = a[:, 2 * n:].reshape(T, n, n)
    eps = hp["sinkhorn_eps"]
    P = np.exp(L - L.max(axis=2, keepdims=True))
    P = P / P.sum(axis=2, keepdims=True) + eps
    P = P / (P.sum(axis=1, keepdims=True) + eps)
    for _ in range(hp["sinkhorn_iters"] - 1):
        P = P / (P.sum(axis=2, keepdims=True) + eps)
        P = P / (P.sum(axis=1, keepdims=True) + eps)
    return pre, post, P


def _collapse_norm(Rbits: Any, coef: Any, norm_weight: Any, hp: Mapping[str, Any]) -> Any:
    """(y, z, rho): y = RMSNorm_g(Collapse(R', coef)), z the bf16 collapse, rho the norm's factor
    (1 without a norm weight); coef None selects stream 0."""
    if coef is None:
        z = Rbits[:, 0, :]
    else:
        R = bf16_to_float32(Rbits)
        acc = np.zeros(Rbits[:, 0, :].shape, np.float32)
        for j in range(Rbits.shape[1]):
            acc = fma32(coef[:, j:j + 1].astype(np.float32), R[:, j, :], acc)
        z = float32_to_bf16(acc)
    if norm_weight is None:
        return z.copy(), z.copy(), np.ones((z.shape[0], 1))
    zf = bf16_to_float32(z).astype(np.float64)
    rho = 1.0 / np.sqrt(np.mean(zf * zf, axis=1, keepdims=True) + hp["norm_eps"])
    return double_to_bf16((zf * rho) * bf16_to_float32(norm_weight).astype(np.float64)), z, rho


def mhc_seam(weights: Mapping[str, np.ndarray], x: Any, residual: Any = None, post_mix: Any = None,
             comb_mix: Any = None, pre_mix: Any = None, mode: str = "shifted", stage: str = "seam",
             hc_mult: int = 4, **hyper: float) -> "SeamReference":
    """The seam of docs/spec/mhc.md. weights: {"mhc.fn", "mhc.scale", "mhc.base", optional "mhc.norm_weight"};
    arrays as the client sends them (bf16 as uint16 bits); hyper: the set's hyper-parameters."""
    hp = dict(DEFAULTS, **hyper)
    n = hc_mult
    x = np.asarray(x)
    T, C = x.shape
    if stage == "first":
        Rp = np.broadcast_to(x[:, None, :], (T, n, C)).copy()
    else:
        xf = bf16_to_float32(x)
        R = bf16_to_float32(residual)
        Rp = np.empty((T, n, C), np.uint16)
        for j in range(n):
            v = (xf.astype(np.float64) * post_mix[:, j:j + 1].astype(np.float64)).astype(np.float32)  # fp32 multiply
            for i in range(n):
                v = fma32(R[:, i, :], comb_mix[:, i, j:j + 1], v)
            Rp[:, j, :] = float32_to_bf16(v)
    norm_weight = weights.get("mhc.norm_weight")
    pre = post = comb = None
    if stage != "head":
        pre, post, comb = _mix(bf16_to_float32(Rp).astype(np.float64), weights["mhc.fn"], weights["mhc.scale"],
                               weights["mhc.base"], hp, n)
    if mode == "normal":
        assert pre is not None  # normal mode has no head stage
        coef = pre.astype(np.float32)  # the collapse consumes the fp32 pre' output
    elif stage != "first" and pre_mix is not None:
        coef = np.asarray(pre_mix, np.float32)
    else:
        coef = None
    y, z, rho = _collapse_norm(Rp, coef, norm_weight, hp)
    return SeamReference(new_residual=Rp, y=y, new_pre_mix=pre, new_post_mix=post, new_comb_mix=comb, z=z, rho=rho,
                         norm_weight=norm_weight)


def bf16_ulp_distance(a: Any, b: Any) -> np.ndarray:
    """Elementwise distance in bf16 ulps between two arrays of bf16 bits (ordered integer distance)."""
    def ordered(bits: Any) -> np.ndarray:
        v = bits.astype(np.int32)
        return np.where(v & 0x8000, 0x8000 - v, v)  # -0 and +0 both map to 0
    return np.abs(ordered(np.asarray(a)) - ordered(np.asarray(b)))


def bf16_ulp(bits: Any) -> np.ndarray:
    """ulp of each bf16 value (spacing of bf16 at its magnitude; 2^-133 for zero and subnormals)."""
    exponent = (np.asarray(bits).astype(np.int32) >> 7) & 0xFF
    return np.exp2(np.maximum(exponent, 1).astype(np.float64) - 127 - 7)


def _normal_mode_y_problems(y: Any, ref: "SeamReference") -> List[str]:
    """Normal-mode y (docs/spec/mhc.md): within 1 ulp of ref on >= 99.9% of elements, and on every one
    |y - ref.y| <= 2 ulp(ref.y) + rho |g| (ulp(z) + sum_j (1e-5 + 1e-4 pre'[j]) |R'[j]|)."""
    got = bf16_to_float32(y).astype(np.float64)
    want = bf16_to_float32(ref.y).astype(np.float64)
    g = np.ones(ref.y.shape[1]) if ref.norm_weight is None else np.abs(bf16_to_float32(ref.norm_weight))
    R = np.abs(bf16_to_float32(ref.new_residual).astype(np.float64))  # [T, n, C]
    assert ref.new_pre_mix is not None  # normal mode computes the mixes at every stage it has
    carried = np.einsum("tj,tjc->tc", 1e-5 + 1e-4 * ref.new_pre_mix, R)
    bound = 2 * bf16_ulp(ref.y) + ref.rho * g * (bf16_ulp(ref.z) + carried)
    excess = np.abs(got - want) - bound
    problems = []
    if np.any(~(excess <= 0)):
        i = int(np.argmax(np.where(np.isnan(excess), np.inf, excess)))
        problems.append(f"y: element {i} got {got.ravel()[i]!r}, reference {want.ravel()[i]!r}, "
                        f"bound {bound.ravel()[i]!r}")
    within_one = float(np.mean(bf16_ulp_distance(y, ref.y) <= 1)) if y.size else 1.0
    if within_one < 0.999:
        problems.append(f"y: {within_one:.4%} of elements within 1 ulp (at least 99.9%)")
    return problems


def check_seam(result: Any, ref: "SeamReference", mode: str = "shifted") -> Dict[str, Any]:
    """Asserts the contract's tolerances of a service result against the reference; returns a summary dict.

    new_residual bitwise; mixes |got - ref| <= 1e-5 + 1e-4 |ref|; shifted-mode y within 1 bf16 ulp;
    normal-mode y within the contract's element-wise bound and within 1 ulp on >= 99.9%.
    The summary's max_mix_abs_diff is None when the stage returns no mixes (head).
    """
    if mode not in ("shifted", "normal"):
        raise ValueError(f"mode = {mode!r}; expected shifted or normal")
    problems = []
    residual_diff = int(np.count_nonzero(result.new_residual != ref.new_residual))
    if residual_diff:
        problems.append(f"new_residual: {residual_diff} elements differ (must be bitwise equal)")
    worst_mix: Optional[float] = None  # stays None for a stage that returns no mixes (head)
    for name in ("new_pre_mix", "new_post_mix", "new_comb_mix"):
        want = getattr(ref, name)
        if want is None:
            continue
        worst_mix = worst_mix or 0.0
        got = getattr(result, name).astype(np.float64)
        excess = np.abs(got - want) - (1e-5 + 1e-4 * np.abs(want))
        worst_mix = max(worst_mix, float(np.max(np.abs(got - want), initial=0.0)))
        if np.any(~(excess <= 0)):
            i = int(np.argmax(np.where(np.isnan(excess), np.inf, excess)))
            problems.append(f"{name}: element {i} got {got.ravel()[i]!r}, reference {want.ravel()[i]!r}")
    y_ulp = int(np.max(bf16_ulp_distance(result.y, ref.y), initial=0))
    if mode == "normal":
        problems += _normal_mode_y_problems(result.y, ref)
    elif y_ulp > 1:
        problems.append(f"y: {y_ulp} bf16 ulp from the reference (at most 1)")
    if problems:
        raise AssertionError("; ".join(problems))
    return {"residual_bitwise": True, "max_mix_abs_diff": worst_mix, "max_y_ulp": y_ulp}
