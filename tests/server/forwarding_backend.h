// A test Backend that forwards every call to an inner backend (by default, the CPU backend's
// answers as they are): a test's backend overrides only what it changes or records.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "fusedlayer/backend.h"

namespace fusedlayer::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string_view kind() const override { return inner_->kind(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::string arch() const override { return inner_->arch(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override { return inner_->Allocate(bytes); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return inner_->CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return inner_->CopyToHost(dst, src, bytes);
  }
  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override {
    return inner_->PrepareMhc(p, w);
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& w, const MhcShapeQuery& q) const override {
    return inner_->MhcFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& w, const MhcArgs& a, Path path) override {
    return inner_->RunMhc(w, a, path);
  }
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& p,
                                                                 const SwaWeightsHost& w) override {
    return inner_->PrepareSwa(p, w);
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& w, const SwaShapeQuery& q) const override {
    return inner_->SwaFusedSupport(w, q);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& w, const SwaArgs& a, Path path) override {
    return inner_->RunSwa(w, a, path);
  }

 protected:
  Backend& inner() const { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace fusedlayer::testing
