// Test-only fault injection: a Backend decorator driven by --fault_inject=LIST, compiled only into
// fault-injection builds (CMake FUSEDLAYER_FAULT_INJECTION=ON, or the test-only executable
// fusedlayer_server_faults that tests/server builds). A production fusedlayer_server has no
// --fault_inject flag at all: absl rejects it as an unknown flag and the server exits 1.
//
// It lets end-to-end tests drive the real binary through failures the CPU backend never produces:
//
//   fused_launch_error[=N]  fused Run* fails with INTERNAL (the server must re-run unfused and
//                           report fused_kernel_error); N = only the next N fused runs, else all.
//   alloc_failure[=N]       device Allocate fails with RESOURCE_EXHAUSTED (the request fails with
//                           RESOURCE_EXHAUSTED, the server keeps serving); N as above. While this
//                           fault is listed the backend reports host_accessible() = false, so the
//                           server stages every tensor through Allocate/Copy* as on a GPU.
//   prepare_failure[=N]     Prepare* (weight upload) fails with RESOURCE_EXHAUSTED; N as above.
//   slow_kernel=MS          every Run* sleeps MS milliseconds first (keeps calls in flight for
//                           drain and overload tests).
//   ulp_flip[=N]            numeric fault after a successful fused run: the first element of the
//                           bitwise-contracted output (mHC new_residual, SWA kv) moves by one ulp
//                           (its lowest bit flips). Shadow verification must catch it (docs/shadow.md).
//   wrong_scale[=N]         numeric fault after a successful fused SWA run: the first q_scale
//                           (row 0, group 0) is multiplied by 16.
//
// Faults are inert until Arm(): main.cc arms them once the server is serving, so the startup
// weight uploads and warm-ups run clean and the server can come up at all.
#pragma once

#if !defined(FUSEDLAYER_FAULT_INJECTION) || !FUSEDLAYER_FAULT_INJECTION
#error "fault_injection.h is for fault-injection builds only (FUSEDLAYER_FAULT_INJECTION=1)"
#endif

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

struct FaultPlan {
  static constexpr int64_t kAlways = -1;
  // Remaining injections per fault: 0 = off, kAlways = every time, N > 0 = the next N times.
  int64_t fused_launch_error = 0;
  int64_t alloc_failure = 0;
  int64_t prepare_failure = 0;
  int64_t slow_kernel_ms = 0;
  int64_t ulp_flip = 0;
  int64_t wrong_scale = 0;

  bool empty() const {
    return fused_launch_error == 0 && alloc_failure == 0 && prepare_failure == 0 && slow_kernel_ms == 0 &&
           ulp_flip == 0 && wrong_scale == 0;
  }
  std::string ToString() const;
};

// Parses "name[=N],name[=N]..." (names above). InvalidArgument naming the bad entry.
absl::StatusOr<FaultPlan> ParseFaultPlan(absl::string_view list);

class FaultInjectingBackend final : public Backend {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> inner, const FaultPlan& plan);

  // Starts injecting (idempotent). Before this every call passes straight through.
  void Arm();

  std::string_view kind() const override { return inner_->kind(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::string arch() const override { return inner_->arch(); }
  bool host_accessible() const override;
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;

  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override;
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& w, const MhcShapeQuery& q) const override {
    return inner_->MhcFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& w, const MhcArgs& a, Path path) override;

  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& p,
                                                                 const SwaWeightsHost& w) override;
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& w, const SwaShapeQuery& q) const override {
    return inner_->SwaFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& w, const SwaArgs& a, Path path) override;

 private:
  // True when `budget` (one of the plan's counters) says inject now; consumes one when counted.
  bool Take(std::atomic<int64_t>& budget);
  void BeforeRun();
  // Applies `edit` to the element `index` of `t` (device memory, through the inner backend's copies).
  template <typename T, typename Edit>
  absl::Status EditElement(const TensorView& t, int64_t index, Edit edit);

  std::unique_ptr<Backend> inner_;
  const bool stage_through_device_;  // alloc_failure listed: make the server use Allocate
  const int64_t slow_kernel_ms_;
  std::atomic<bool> armed_{false};
  std::atomic<int64_t> fused_launch_error_;
  std::atomic<int64_t> alloc_failure_;
  std::atomic<int64_t> prepare_failure_;
  std::atomic<int64_t> ulp_flip_;
  std::atomic<int64_t> wrong_scale_;
};

// Reads --fault_inject. With an empty flag `backend` comes back unchanged and *handle is null;
// otherwise it is wrapped, *handle points at the wrapper (owned by the returned backend) and a
// WARNING says which faults are configured. InvalidArgument on a bad list.
absl::StatusOr<std::unique_ptr<Backend>> WrapWithFaultInjectionFromFlag(std::unique_ptr<Backend> backend,
                                                                         FaultInjectingBackend** handle);

}  // namespace fusedlayer::server
