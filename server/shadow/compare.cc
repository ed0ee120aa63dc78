#include "shadow/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fusedlayer/numeric.h"
#include "codec/request_codec.h"

namespace fusedlayer::server::shadow {
namespace {

// Read-only element access to a response tensor of a known dtype.
struct Elements {
  DType dtype;
  const uint8_t* data;
  int64_t n;

  uint32_t Bits(int64_t i) const {
    switch (dtype) {
      case DType::kFP32: {
        uint32_t u;
        std::memcpy(&u, data + 4 * i, 4);
        return u;
      }
      case DType::kBF16: {
        uint16_t u;
        std::memcpy(&u, data + 2 * i, 2);
        return u;
      }
      default: return data[i];
    }
  }
  double Value(int64_t i) const {
    const uint32_t b = Bits(i);
    switch (dtype) {
      case DType::kFP32: return BitsToFloat(b);
      case DType::kBF16: return Bf16ToFloat(static_cast<bf16_bits>(b));
      case DType::kFP8E4M3FN: return Fp8ToFloat(static_cast<fp8_bits>(b), Fp8Format::kE4M3FN);
      case DType::kFP8E4M3FNUZ: return Fp8ToFloat(static_cast<fp8_bits>(b), Fp8Format::kE4M3FNUZ);
    }
    return 0;
  }
  // Position on the number line in units of the last place (sign-magnitude to two's complement,
  // so +0 and -0 coincide): the distance of two ordinals is the ulp (fp8: code-step) distance.
  int64_t Ordinal(int64_t i) const {
    const uint32_t b = Bits(i);
    int sign_bit = dtype == DType::kFP32 ? 31 : dtype == DType::kBF16 ? 15 : 7;
    const int64_t mag = static_cast<int64_t>(b & ((uint64_t{1} << sign_bit) - 1));
    return (b >> sign_bit) & 1 ? -mag : mag;
  }
};

const char* Fp8Name(Fp8Format f) { return f == Fp8Format::kE4M3FN ? "e4m3fn" : "e4m3fnuz"; }

// Checks both tensors are `dtype` with the same shape and a consistent byte length; fills `c` and
// returns false (a mismatch with the reason) otherwise.
bool Structure(OutputComparison& c, const v1::Tensor& f, const v1::Tensor& u, DType dtype, Elements* fe,
               Elements* ue) {
  auto bad = [&](std::string why) {
    c.mismatch = true;
    c.detail = std::move(why);
    c.max_abs_diff = std::numeric_limits<double>::infinity();
    return false;
  };
  if (f.dtype() != server::ToProto(dtype) || u.dtype() != server::ToProto(dtype)) {
    return bad(absl::StrCat("dtype: fused ", v1::DataType_Name(f.dtype()), ", unfused ", v1::DataType_Name(u.dtype()),
                            ", expected ", DTypeName(dtype)));
  }
  if (f.shape_size() != u.shape_size() || !std::equal(f.shape().begin(), f.shape().end(), u.shape().begin())) {
    return bad(absl::StrCat("shape: fused [", absl::StrJoin(f.shape(), ", "), "], unfused [",
                            absl::StrJoin(u.shape(), ", "), "]"));
  }
  int64_t n = 1;
  for (int64_t d : f.shape()) n *= d;
  const size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
  if (f.data().size() != bytes || u.data().size() != bytes) {
    return bad(absl::StrCat("byte length: fused ", f.data().size(), ", unfused ", u.data().size(), ", expected ",
                            bytes));
  }
  *fe = Elements{dtype, reinterpret_cast<const uint8_t*>(f.data().data()), n};
  *ue = Elements{dtype, reinterpret_cast<const uint8_t*>(u.data().data()), n};
  c.total_elements = n;
  return true;
}

// One pass over the elements: the statistics of every output, and the first element for which
// `violates(i, fused, unfused, ulp)` holds (a mismatch).
using Violation = std::function<bool(int64_t i, double f, double u, int64_t ulp)>;
void Scan(OutputComparison& c, const Elements& fe, const Elements& ue, const Violation& violates) {
  for (int64_t i = 0; i < fe.n; ++i) {
    const uint32_t fb = fe.Bits(i), ub = ue.Bits(i);
    const double f = fe.Value(i), u = ue.Value(i);
    const int64_t ulp = fb == ub ? 0 : std::abs(fe.Ordinal(i) - ue.Ordinal(i));
    if (fb != ub) {
      ++c.differing_elements;
      const double d = (std::isnan(f) || std::isnan(u)) ? std::numeric_limits<double>::infinity() : std::fabs(f - u);
      c.max_abs_diff = std::max(c.max_abs_diff, d);
      c.max_ulp_distance = std::max(c.max_ulp_distance, ulp);
    }
    if (violates && violates(i, f, u, ulp) && !c.mismatch) {
      c.mismatch = true;
      c.detail = absl::StrFormat("element %d: fused %.9g, unfused %.9g (%d ulp)", i, f, u, ulp);
    }
  }
}

bool NanDiffers(double f, double u, int64_t ulp) { return ulp != 0 && (std::isnan(f) || std::isnan(u)); }

OutputComparison Bitwise(const char* name, const v1::Tensor& f, const v1::Tensor& u, DType dtype) {
  OutputComparison c{name};
  c.rule = "bitwise";
  Elements fe{}, ue{};
  if (!Structure(c, f, u, dtype, &fe, &ue)) return c;
  Scan(c, fe, ue, [](int64_t, double, double, int64_t ulp) { return ulp != 0; });
  return c;
}

// |f - u| <= abs + rel * max(|f|, |u|); NaN against anything else is a violation.
OutputComparison Close(const char* name, const v1::Tensor& f, const v1::Tensor& u, DType dtype, double abs_tol,
                       double rel_tol) {
  OutputComparison c{name};
  c.rule = absl::StrFormat("|fused - unfused| <= %g + %g * max(|fused|, |unfused|)", abs_tol, rel_tol);
  Elements fe{}, ue{};
  if (!Structure(c, f, u, dtype, &fe, &ue)) return c;
  Scan(c, fe, ue, [&](int64_t, double fv, double uv, int64_t ulp) {
    if (ulp == 0) return false;
    if (NanDiffers(fv, uv, ulp)) return true;
    return !(std::fabs(fv - uv) <= abs_tol + rel_tol * std::max(std::fabs(fv), std::fabs(uv)));
  });
  return c;
}

// ulp of a bf16 value (its bits): the spacing of bf16 numbers in its binade, 2^(e - 7) for |v| in
// [2^e, 2^(e+1)); the subnormal spacing 2^-133 below 2^-126.
double Bf16Ulp(uint32_t bits) {
  const int biased = static_cast<int>((bits >> 7) & 0xffu);
  return std::ldexp(1.0, (biased == 0 ? 1 : biased) - 127 - 7);
}

// Correctly rounded double -> bf16 (nearest, ties to even). Through fp32 this is exact except when
// the fp32 value lands exactly on a bf16 midpoint the double was not on; then the double decides.
uint32_t DoubleToBf16Bits(double d) {
  const float f = static_cast<float>(d);
  const uint32_t u = FloatBits(f);
  if ((u & 0xffffu) == 0x8000u && static_cast<double>(f) != d && std::isfinite(f)) {
    return (u >> 16) + (std::fabs(d) > std::fabs(static_cast<double>(f)) ? 1u : 0u);
  }
  return FloatToBf16(f);
}

// Normal-mode y: the contract's rule between two paths (spec/mhc.md, "Equality and tolerance":
// "between two paths, twice the bound"), with what the contract takes from the fp64 reference
// derived from the unfused run (docs/shadow.md):
//   every element: |f - u| <= 2 x (2 ulp(y) + rho |g| (ulp(z) + sum_j (1e-5 + 1e-4 pre'[j]) |R'[j][c]|))
//   >= 99.8% of elements: <= 2 bf16 ulp (each path is within 1 ulp of ref on >= 99.9%)
// R' = unfused new_residual, pre' = unfused new_pre_mix, z = bf16(sum_j pre'[j] R'[j][c]) and
// rho = 1 / sqrt(mean(z^2) + norm_eps) in fp64 (rho = 1 and g = 1 without a norm weight), ulp(y)
// at the larger of |f|, |u|. When R' or pre' is unusable (missing or malformed: reported under its
// own name) no bound can be derived and only equal bits pass.
OutputComparison NormalModeY(const MhcHyperParams& p, const std::vector<uint16_t>& norm_weight,
                             const v1::MhcSeamResponse& fr, const v1::MhcSeamResponse& ur) {
  OutputComparison c{"y"};
  c.rule = absl::StrFormat(
      "|fused - unfused| <= %g x (2 ulp(y) + rho |g| (ulp(z) + sum_j (1e-5 + 1e-4 pre'[j]) |R'[j]|)) on all "
      "elements (R', pre' of the unfused run; z, rho recomputed from them), <= %d bf16 ulp on >= %g%%",
      kNormalYBoundFactor, kNormalYFractionUlp, kNormalYFraction * 100);
  Elements fe{}, ue{};
  if (!Structure(c, fr.y(), ur.y(), DType::kBF16, &fe, &ue)) return c;
  const int64_t n = p.hc_mult, C = p.hidden;
  const int64_t T = C > 0 ? fe.n / C : 0;
  OutputComparison scratch;
  Elements rp{}, rp2{}, pre{}, pre2{};
  // The unfused tensors alone (Structure checks a pair: pass the same tensor twice).
  const bool have = C > 0 && n > 0 && fe.n == T * C &&
                    Structure(scratch, ur.new_residual(), ur.new_residual(), DType::kBF16, &rp, &rp2) &&
                    rp.n == T * n * C && Structure(scratch, ur.new_pre_mix(), ur.new_pre_mix(), DType::kFP32, &pre, &pre2) &&
                    pre.n == T * n && (norm_weight.empty() || static_cast<int64_t>(norm_weight.size()) == C);
  const bool has_norm = !norm_weight.empty();
  auto z_of = [&](int64_t t, int64_t cc) {
    double z = 0;
    for (int64_t j = 0; j < n; ++j) z += pre.Value(t * n + j) * rp.Value((t * n + j) * C + cc);
    return DoubleToBf16Bits(z);
  };
  // rho per token, computed the first time an element of the token differs (usually none does).
  std::vector<double> rho(static_cast<size_t>(have ? T : 0), -1.0);
  auto rho_of = [&](int64_t t) {
    double& r = rho[static_cast<size_t>(t)];
    if (r < 0) {
      r = 1.0;
      if (has_norm) {
        double ss = 0;
        for (int64_t cc = 0; cc < C; ++cc) {
          const double z = Bf16ToFloat(static_cast<bf16_bits>(z_of(t, cc)));
          ss += z * z;
        }
        r = 1.0 / std::sqrt(ss / static_cast<double>(C) + static_cast<double>(p.norm_eps));
      }
    }
    return r;
  };
  int64_t over_fraction_ulp = 0;
  std::string first_note;  // appended to the detail of the first violation
  Scan(c, fe, ue, [&](int64_t i, double fv, double uv, int64_t ulp) {
    if (ulp > kNormalYFractionUlp) ++over_fraction_ulp;
    if (ulp == 0) return false;
    if (NanDiffers(fv, uv, ulp)) return true;
    bool bad = !have;
    double bound = 0;
    if (have) {
      const int64_t t = i / C, cc = i % C;
      double carried = Bf16Ulp(z_of(t, cc));
      for (int64_t j = 0; j < n; ++j) {
        carried += (1e-5 + 1e-4 * std::fabs(pre.Value(t * n + j))) * std::fabs(rp.Value((t * n + j) * C + cc));
      }
      const double g = has_norm ? std::fabs(double(Bf16ToFloat(norm_weight[static_cast<size_t>(cc)]))) : 1.0;
      const double y_ulp = std::max(Bf16Ulp(fe.Bits(i)), Bf16Ulp(ue.Bits(i)));
      bound = kNormalYBoundFactor * (2 * y_ulp + rho_of(t) * g * carried);
      bad = !(std::fabs(fv - uv) <= bound);
    }
    if (bad && !c.mismatch) {
      first_note = have ? absl::StrFormat(", allowed %.3g", bound)
                        : ": no bound without the unfused new_residual [T, n, C] and new_pre_mix [T, n], so only "
                          "equal bits pass";
    }
    return bad;
  });
  absl::StrAppend(&c.detail, first_note);
  const double within = static_cast<double>(c.total_elements - over_fraction_ulp);
  if (!c.mismatch && within < kNormalYFraction * static_cast<double>(c.total_elements)) {
    c.mismatch = true;
    c.detail = absl::StrCat(over_fraction_ulp, " of ", c.total_elements, " elements differ by more than ",
                            kNormalYFractionUlp, " ulp (at most ", (1 - kNormalYFraction) * 100, "% may)");
  }
  return c;
}

// q_fp8 with fp32 scales: <= max_steps code steps everywhere, at most `fraction` of codes differ.
OutputComparison CodeSteps(const char* name, const v1::Tensor& f, const v1::Tensor& u, DType dtype,
                           int64_t max_steps, double fraction) {
  OutputComparison c{name};
  c.rule = absl::StrFormat("<= %d code step, <= %g%% of codes differ (+ 5 sigma)", max_steps, fraction * 100);
  Elements fe{}, ue{};
  if (!Structure(c, f, u, dtype, &fe, &ue)) return c;
  Scan(c, fe, ue, [&](int64_t, double fv, double uv, int64_t ulp) {
    return NanDiffers(fv, uv, ulp) || ulp > max_steps;
  });
  const int64_t allowed = AllowedDifferingCodes(c.total_elements);
  if (!c.mismatch && c.differing_elements > allowed) {
    c.mismatch = true;
    c.detail = absl::StrCat(c.differing_elements, " of ", c.total_elements, " codes differ (at most ", allowed,
                            ": ", fraction * 100, "% + 5 sigma)");
  }
  return c;
}

// Dequantized q (fp32 q_scale layout per the weight set) of element (m, k).
double Dequant(const SwaHyperParams& p, int64_t M, const Elements& q, const Elements& s, int64_t m, int64_t k) {
  const int64_t g = k / kSwaGroup;
  const int64_t si = p.scale_layout == ScaleLayout::kColumnMajorTma ? g * AlignTo4(M) + m : m * p.groups() + g;
  return q.Value(m * p.q_rank + k) * s.Value(si);
}

// q_proj: both paths are within 0.125 + 0.01 |ref| of their own reference dequant(q) . dequant(W)^T,
// but their q differ (fused: single rounding; unfused: re-quantized from bf16), so the references
// differ by sum_k (dq_f - dq_u)[m, k] * dW[n, k], at most L1(dq_f - dq_u)[m] * max_k |dW[n, k]|.
// Bound: 2 x the spec's tolerance + that term (+ 2^-8 relative for the bf16 rounding of both).
OutputComparison QProj(const SwaHyperParams& p, int64_t M, const std::vector<float>& w_row_max,
                       const v1::SwaNormQuantResponse& fr, const v1::SwaNormQuantResponse& ur) {
  OutputComparison c{"q_proj"};
  c.rule = absl::StrFormat(
      "|fused - unfused| <= %g + %g * max(|fused|, |unfused|) + L1(dequant q_f - dequant q_u)[m] * max_k |dequant "
      "wq_b[n, k]|",
      kQProjAbsTol, kQProjRelTol);
  Elements fe{}, ue{};
  if (!Structure(c, fr.q_proj(), ur.q_proj(), DType::kBF16, &fe, &ue)) return c;
  const int64_t N = p.wq_b_rows;
  // The q-difference term per row, from the (already structure-checked) q outputs of both paths.
  const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  OutputComparison scratch;
  Elements qf{}, qu{}, sf{}, su{};
  std::vector<double> l1(static_cast<size_t>(M), std::numeric_limits<double>::infinity());
  const bool have_q = Structure(scratch, fr.q_fp8(), ur.q_fp8(), fp8, &qf, &qu) &&
                      Structure(scratch, fr.q_scale(), ur.q_scale(), DType::kFP32, &sf, &su) &&
                      qf.n == M * p.q_rank && static_cast<int64_t>(w_row_max.size()) == N && fe.n == M * N;
  if (have_q) {
    for (int64_t m = 0; m < M; ++m) {
      double sum = 0;
      for (int64_t k = 0; k < p.q_rank; ++k) sum += std::fabs(Dequant(p, M, qf, sf, m, k) - Dequant(p, M, qu, su, m, k));
      l1[static_cast<size_t>(m)] = std::isnan(sum) ? std::numeric_limits<double>::infinity() : sum;
    }
  }
  Scan(c, fe, ue, [&](int64_t i, double fv, double uv, int64_t ulp) {
    if (ulp == 0) return false;
    if (NanDiffers(fv, uv, ulp)) return true;
    if (!have_q) return true;  // q unusable: only bitwise equality passes
    const int64_t m = i / N, n = i % N;
    const double big = std::max(std::fabs(fv), std::fabs(uv));
    const double bound = kQProjAbsTol + (kQProjRelTol + 1.0 / 256) * big +
                         l1[static_cast<size_t>(m)] * w_row_max[static_cast<size_t>(n)] * (1 + 1e-6);
    return !(std::fabs(fv - uv) <= bound);
  });
  return c;
}

bool PowerOfTwo(double s) {
  if (!(s > 0) || !std::isfinite(s)) return false;
  int e;
  return std::frexp(s, &e) == 0.5;
}

// UE8M0: q_scale and q_fp8 judged together, group by group. A group's scales must be powers of two
// at most one binade apart (q_scale); where they are, the dequantized values q * s must agree to the
// precision of two fp8 roundings (q_fp8). A group whose scales are off is reported under q_scale only.
void CompareUe8m0(const SwaHyperParams& p, int64_t M, const v1::SwaNormQuantResponse& fr,
                  const v1::SwaNormQuantResponse& ur, OutputComparison& qc, OutputComparison& sc) {
  const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  const int64_t Q = p.q_rank, G = p.groups(), M4 = AlignTo4(M);
  const bool col = p.scale_layout == ScaleLayout::kColumnMajorTma;
  qc.rule = absl::StrFormat("dequantized q * s within %g relative + 1 %s subnormal step * s, per group of %d",
                            kDequantRelTol, Fp8Name(p.fp8_format), kSwaGroup);
  sc.rule = "powers of two, at most one binade apart per group";
  Elements qf{}, qu{}, sf{}, su{};
  const bool q_ok = Structure(qc, fr.q_fp8(), ur.q_fp8(), fp8, &qf, &qu);
  const bool s_ok = Structure(sc, fr.q_scale(), ur.q_scale(), DType::kFP32, &sf, &su);
  if (s_ok) {
    Scan(sc, sf, su, nullptr);
    // Padding rows (column-major TMA) must be 0 on both paths.
    for (int64_t i = 0; i < sf.n && col; ++i) {
      const int64_t m = i % M4;
      if (m >= M && (sf.Bits(i) != 0 || su.Bits(i) != 0) && !sc.mismatch) {
        sc.mismatch = true;
        sc.detail = absl::StrCat("padding scale ", i, " is not 0");
      }
    }
  }
  if (q_ok) Scan(qc, qf, qu, nullptr);
  if (!q_ok || !s_ok || sf.n != (col ? G * M4 : M * G) || qf.n != M * Q) {
    if (q_ok && s_ok && !sc.mismatch) {
      sc.mismatch = true;
      sc.detail = "q_scale size does not match q_fp8";
    }
    return;
  }
  const double step = p.fp8_format == Fp8Format::kE4M3FN ? std::ldexp(1.0, -9) : std::ldexp(1.0, -10);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t si = col ? g * M4 + m : m * G + g;
      const double s_f = sf.Value(si), s_u = su.Value(si);
      const double ratio = s_f / s_u;
      if (!PowerOfTwo(s_f) || !PowerOfTwo(s_u) || !(ratio == 0.5 || ratio == 1 || ratio == 2)) {
        if (!sc.mismatch) {
          sc.mismatch = true;
          sc.detail = absl::StrFormat("row %d group %d: fused scale %.9g, unfused %.9g", m, g, s_f, s_u);
        }
        continue;  // this group's codes are judged by its scales: reported under q_scale
      }
      const double s_max = std::max(s_f, s_u);
      for (int64_t k = 0; k < kSwaGroup; ++k) {
        const int64_t i = m * Q + g * kSwaGroup + k;
        const double cf = qf.Value(i), cu = qu.Value(i);
        const double df = cf * s_f, du = cu * s_u;
        const bool nan = std::isnan(cf) || std::isnan(cu);
        if ((nan || !(std::fabs(df - du) <= kDequantRelTol * std::max(std::fabs(df), std::fabs(du)) + step * s_max)) &&
            !qc.mismatch) {
          qc.mismatch = true;
          qc.detail = absl::StrFormat("row %d group %d element %d: fused %.9g * %.9g, unfused %.9g * %.9g", m, g, k, cf,
                                      s_f, cu, s_u);
        }
      }
    }
  }
}

}  // namespace

bool Comparison::mismatch() const {
  return std::any_of(outputs.begin(), outputs.end(), [](const OutputComparison& c) { return c.mismatch; });
}

std::string Comparison::MismatchSummary() const {
  std::vector<std::string> parts;
  for (const OutputComparison& c : outputs) {
    if (!c.mismatch) continue;
    parts.push_back(absl::StrFormat("%s(max_abs_diff=%g, max_ulp=%d, differing=%d/%d: %s)", c.output, c.max_abs_diff,
                                    c.max_ulp_distance, c.differing_elements, c.total_elements, c.detail));
  }
  return absl::StrJoin(parts, ", ");
}

Comparison CompareMhc(const MhcHyperParams& params, const std::vector<uint16_t>& norm_weight, MhcStage stage,
                      MhcMode mode, bool capture_aux, const v1::MhcSeamResponse& f, const v1::MhcSeamResponse& u) {
  Comparison out;
  out.outputs.push_back(Bitwise("new_residual", f.new_residual(), u.new_residual(), DType::kBF16));
  if (stage != MhcStage::kHead) {
    out.outputs.push_back(Close("new_pre_mix", f.new_pre_mix(), u.new_pre_mix(), DType::kFP32, kMixAbsTol, kMixRelTol));
    out.outputs.push_back(
        Close("new_post_mix", f.new_post_mix(), u.new_post_mix(), DType::kFP32, kMixAbsTol, kMixRelTol));
    out.outputs.push_back(
        Close("new_comb_mix", f.new_comb_mix(), u.new_comb_mix(), DType::kFP32, kMixAbsTol, kMixRelTol));
  }
  // Shifted mode (and head, which is shifted): y depends only on R' and the given pre_mix, both
  // bitwise equal between the paths. Normal mode collapses with the new pre mix, which the mixes
  // tolerance lets differ between the paths (and cancellation in the collapse can amplify).
  if (mode == MhcMode::kShifted) {
    out.outputs.push_back(Bitwise("y", f.y(), u.y(), DType::kBF16));
  } else {
    out.outputs.push_back(NormalModeY(params, norm_weight, f, u));
  }
  if (capture_aux) out.outputs.push_back(Bitwise("aux", f.aux(), u.aux(), DType::kBF16));
  return out;
}

int64_t AllowedDifferingCodes(int64_t n) {
  const double mean = kQCodeFraction * static_cast<double>(n);
  return static_cast<int64_t>(std::floor(mean + 5 * std::sqrt(mean * (1 - kQCodeFraction))));
}

Comparison CompareSwa(const SwaHyperParams& p, int64_t tokens, const std::vector<float>& wq_b_row_abs_max,
                      const v1::SwaNormQuantResponse& f, const v1::SwaNormQuantResponse& u) {
  Comparison out;
  const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  OutputComparison qc{"q_fp8"}, sc{"q_scale"};
  if (p.scale_format == ScaleFormat::kFp32) {
    qc = CodeSteps("q_fp8", f.q_fp8(), u.q_fp8(), fp8, 1, kQCodeFraction);
    sc = Close("q_scale", f.q_scale(), u.q_scale(), DType::kFP32, 0, kScaleRelTol);
  } else {
    CompareUe8m0(p, tokens, f, u, qc, sc);
  }
  out.outputs.push_back(std::move(qc));
  out.outputs.push_back(std::move(sc));
  out.outputs.push_back(Bitwise("kv", f.kv(), u.kv(), DType::kBF16));
  if (p.has_wq_b()) out.outputs.push_back(QProj(p, tokens, wq_b_row_abs_max, f, u));
  return out;
}

v1::OutputComparison ToProto(const OutputComparison& c) {
  v1::OutputComparison p;
  p.set_output(c.output);
  p.set_mismatch(c.mismatch);
  p.set_max_abs_diff(c.max_abs_diff);
  p.set_max_ulp_distance(c.max_ulp_distance);
  p.set_differing_elements(c.differing_elements);
  p.set_total_elements(c.total_elements);
  p.set_rule(c.rule);
  p.set_detail(c.detail);
  return p;
}

}  // namespace fusedlayer::server::shadow
