// A test-only Backend decorator around the CPU backend. It reaches the fallback reasons the CPU
// backend never produces (backend_has_no_fused_kernel, device_arch_unsupported,
// aux_capture_requested, workspace_unavailable: forced capability answers; fused_kernel_error: a
// failing fused launch), and it can hold the executor inside a kernel (a gate) so tests can queue,
// cancel or expire requests deterministically, without timing assumptions.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/status/status.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::testing {

class FaultBackend final : public Backend {
 public:
  // Shared with the test: the server owns the backend, the test keeps the control.
  struct Control {
    // Answer of every *FusedSupport query while set (the CPU's answer otherwise).
    std::atomic<int> forced_reason{-1};
    // Fused runs fail with INTERNAL while set.
    std::atomic<bool> fail_fused{false};
    // Report host_accessible() = false, so the server stages every tensor through Allocate /
    // CopyToDevice / CopyToHost as it does on a GPU (the memory is still host memory underneath).
    std::atomic<bool> device_memory{false};
    std::atomic<int> copies_to_device{0};
    std::atomic<int> copies_to_host{0};

    void ForceReason(std::optional<FallbackReason> r) { forced_reason = r ? static_cast<int>(*r) : -1; }

    // Gate: while closed, every Run* blocks on entry (after counting itself in `entered`).
    void CloseGate() {
      std::lock_guard<std::mutex> l(mu);
      closed = true;
    }
    void OpenGate() {
      {
        std::lock_guard<std::mutex> l(mu);
        closed = false;
      }
      cv.notify_all();
    }
    // Waits until `n` runs have entered since the start.
    void WaitEntered(int n) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return entered >= n; });
    }
    int Entered() {
      std::lock_guard<std::mutex> l(mu);
      return entered;
    }
    void Enter() {
      std::unique_lock<std::mutex> l(mu);
      ++entered;
      cv.notify_all();
      cv.wait(l, [&] { return !closed; });
    }

    std::mutex mu;
    std::condition_variable cv;
    bool closed = false;
    int entered = 0;
  };

  explicit FaultBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)), control_(std::make_shared<Control>()) {}

  std::shared_ptr<Control> control() const { return control_; }

  std::string_view kind() const override { return inner_->kind(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::string arch() const override { return inner_->arch(); }
  bool host_accessible() const override { return inner_->host_accessible() && !control_->device_memory; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override { return inner_->Allocate(bytes); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    ++control_->copies_to_device;
    return inner_->CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    ++control_->copies_to_host;
    return inner_->CopyToHost(dst, src, bytes);
  }

  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override {
    return inner_->PrepareMhc(p, w);
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& w, const MhcShapeQuery& q) const override {
    if (auto forced = Forced()) return *forced;
    return inner_->MhcFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& w, const MhcArgs& a, Path path) override {
    control_->Enter();
    if (path == Path::kFused && control_->fail_fused) return absl::InternalError("injected fused kernel failure");
    return inner_->RunMhc(w, a, path);
  }

  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& p,
                                                                 const SwaWeightsHost& w) override {
    return inner_->PrepareSwa(p, w);
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& w, const SwaShapeQuery& q) const override {
    if (auto forced = Forced()) return *forced;
    return inner_->SwaFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& w, const SwaArgs& a, Path path) override {
    control_->Enter();
    if (path == Path::kFused && control_->fail_fused) return absl::InternalError("injected fused kernel failure");
    return inner_->RunSwa(w, a, path);
  }

 private:
  std::optional<FusedSupport> Forced() const {
    const int r = control_->forced_reason.load();
    if (r < 0) return std::nullopt;
    return FusedSupport::No(static_cast<FallbackReason>(r), "injected by the test backend");
  }

  std::unique_ptr<Backend> inner_;
  std::shared_ptr<Control> control_;
};

}  // namespace fusedlayer::testing
