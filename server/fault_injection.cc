#include "fault_injection.h"

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/log.h"

ABSL_FLAG(std::string, fault_inject, "",
          "TEST-ONLY fault injection (fault-injection builds only): comma-separated fused_launch_error[=N], "
          "alloc_failure[=N], prepare_failure[=N], slow_kernel=MS, ulp_flip[=N], wrong_scale[=N]; armed once the "
          "server is serving");

namespace fusedlayer::server {

std::string FaultPlan::ToString() const {
  std::vector<std::string> parts;
  auto count = [&](const char* name, int64_t v) {
    if (v == kAlways) parts.push_back(name);
    else if (v > 0) parts.push_back(absl::StrCat(name, "=", v));
  };
  count("fused_launch_error", fused_launch_error);
  count("alloc_failure", alloc_failure);
  count("prepare_failure", prepare_failure);
  if (slow_kernel_ms > 0) parts.push_back(absl::StrCat("slow_kernel=", slow_kernel_ms));
  count("ulp_flip", ulp_flip);
  count("wrong_scale", wrong_scale);
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<FaultPlan> ParseFaultPlan(absl::string_view list) {
  FaultPlan plan;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    absl::string_view name = entry, value;
    bool has_value = false;
    if (size_t eq = entry.find('='); eq != absl::string_view::npos) {
      name = entry.substr(0, eq);
      value = entry.substr(eq + 1);
      has_value = true;
    }
    int64_t n = FaultPlan::kAlways;
    if (has_value && (!absl::SimpleAtoi(value, &n) || n <= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fault_inject: '", entry, "': the value must be a positive integer"));
    }
    if (name == "fused_launch_error") plan.fused_launch_error = n;
    else if (name == "alloc_failure") plan.alloc_failure = n;
    else if (name == "prepare_failure") plan.prepare_failure = n;
    else if (name == "ulp_flip") plan.ulp_flip = n;
    else if (name == "wrong_scale") plan.wrong_scale = n;
    else if (name == "slow_kernel") {
      if (!has_value) return absl::InvalidArgumentError("--fault_inject: slow_kernel needs =MILLISECONDS");
      plan.slow_kernel_ms = n;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fault_inject: unknown fault '", name,
          "' (known: fused_launch_error[=N], alloc_failure[=N], prepare_failure[=N], slow_kernel=MS, "
          "ulp_flip[=N], wrong_scale[=N])"));
    }
  }
  return plan;
}

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<Backend> inner, const FaultPlan& plan)
    : inner_(std::move(inner)),
      stage_through_device_(plan.alloc_failure != 0),
      slow_kernel_ms_(plan.slow_kernel_ms),
      fused_launch_error_(plan.fused_launch_error),
      alloc_failure_(plan.alloc_failure),
      prepare_failure_(plan.prepare_failure),
      ulp_flip_(plan.ulp_flip),
      wrong_scale_(plan.wrong_scale) {}

void FaultInjectingBackend::Arm() { armed_.store(true); }

bool FaultInjectingBackend::Take(std::atomic<int64_t>& budget) {
  if (!armed_.load()) return false;
  int64_t left = budget.load();
  for (;;) {
    if (left == FaultPlan::kAlways) return true;
    if (left <= 0) return false;
    if (budget.compare_exchange_weak(left, left - 1)) return true;
  }
}

bool FaultInjectingBackend::host_accessible() const {
  return inner_->host_accessible() && !stage_through_device_;
}

absl::StatusOr<DeviceBuffer> FaultInjectingBackend::Allocate(size_t bytes) {
  if (Take(alloc_failure_)) {
    return absl::ResourceExhaustedError(absl::StrCat("injected device allocation failure (", bytes, " bytes)"));
  }
  return inner_->Allocate(bytes);
}

absl::Status FaultInjectingBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
  return inner_->CopyToDevice(dst, src, bytes);
}

absl::Status FaultInjectingBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  return inner_->CopyToHost(dst, src, bytes);
}

absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> FaultInjectingBackend::PrepareMhc(const MhcHyperParams& p,
                                                                                      const MhcWeightsHost& w) {
  if (Take(prepare_failure_)) return absl::ResourceExhaustedError("injected device out of memory (weight upload)");
  return inner_->PrepareMhc(p, w);
}

absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> FaultInjectingBackend::PrepareSwa(const SwaHyperParams& p,
                                                                                      const SwaWeightsHost& w) {
  if (Take(prepare_failure_)) return absl::ResourceExhaustedError("injected device out of memory (weight upload)");
  return inner_->PrepareSwa(p, w);
}

void FaultInjectingBackend::BeforeRun() {
  if (slow_kernel_ms_ > 0 && armed_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(slow_kernel_ms_));
}

template <typename T, typename Edit>
absl::Status FaultInjectingBackend::EditElement(const TensorView& t, int64_t index, Edit edit) {
  T value;
  void* at = static_cast<char*>(t.data) + index * static_cast<int64_t>(sizeof(T));
  if (absl::Status s = inner_->CopyToHost(&value, at, sizeof(T)); !s.ok()) return s;
  value = edit(value);
  return inner_->CopyToDevice(at, &value, sizeof(T));
}

absl::StatusOr<RunStats> FaultInjectingBackend::RunMhc(const PreparedMhcWeights& w, const MhcArgs& a, Path path) {
  BeforeRun();
  if (path == Path::kFused && Take(fused_launch_error_)) return absl::InternalError("injected fused launch failure");
  absl::StatusOr<RunStats> stats = inner_->RunMhc(w, a, path);
  if (stats.ok() && path == Path::kFused && a.tokens > 0 && Take(ulp_flip_)) {
    absl::Status s = EditElement<uint16_t>(a.new_residual, 0, [](uint16_t b) { return uint16_t(b ^ 1u); });
    if (!s.ok()) return s;
  }
  return stats;
}

absl::StatusOr<RunStats> FaultInjectingBackend::RunSwa(const PreparedSwaWeights& w, const SwaArgs& a, Path path) {
  BeforeRun();
  if (path == Path::kFused && Take(fused_launch_error_)) return absl::InternalError("injected fused launch failure");
  absl::StatusOr<RunStats> stats = inner_->RunSwa(w, a, path);
  if (stats.ok() && path == Path::kFused && a.tokens > 0) {
    if (Take(ulp_flip_)) {
      absl::Status s = EditElement<uint16_t>(a.kv, 0, [](uint16_t b) { return uint16_t(b ^ 1u); });
      if (!s.ok()) return s;
    }
    if (Take(wrong_scale_)) {
      // Element 0 is (row 0, group 0) in both scale layouts.
      absl::Status s = EditElement<float>(a.q_scale, 0, [](float v) { return v * 16.0f; });
      if (!s.ok()) return s;
    }
  }
  return stats;
}

absl::StatusOr<std::unique_ptr<Backend>> WrapWithFaultInjectionFromFlag(std::unique_ptr<Backend> backend,
                                                                         FaultInjectingBackend** handle) {
  *handle = nullptr;
  absl::StatusOr<FaultPlan> plan = ParseFaultPlan(absl::GetFlag(FLAGS_fault_inject));
  if (!plan.ok()) return plan.status();
  if (plan->empty()) return std::move(backend);
  LogWarning("TEST-ONLY fault injection configured (armed once serving): --fault_inject=", plan->ToString());
  auto wrapped = std::make_unique<FaultInjectingBackend>(std::move(backend), *plan);
  *handle = wrapped.get();
  return std::unique_ptr<Backend>(std::move(wrapped));
}

}  // namespace fusedlayer::server
