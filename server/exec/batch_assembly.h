// Dynamic batching's data movement: the host views of several compatible calls (each token-major,
// [T_i, ...]) gathered into one batch of sum T_i tokens, and the batch's outputs scattered back into
// each call's response bytes. The batch is then run like any single call (runtime/op_calls.h), so the
// device staging is the same. Our kernels are batch-invariant (docs/spec/: every output of a token
// depends only on that token's inputs and the weights), so each call's outputs are bitwise those of
// the call alone; tests assert it on every backend.
//
// Layouts handled: dense token-major tensors, the SWA qr_kv input with any row stride (gathered into
// dense rows), and the SWA column-major (TMA) q_scale layout [G, align4(M)] (scattered per group;
// every call's padding rows are zero, as the kernels write them for a call alone).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/op_calls.h"

namespace fusedlayer::server {

// Holds the batch's host buffers (from a per-thread cache: one BatchAssembly at a time per thread)
// and remembers where each call's outputs go.
class BatchAssembly {
 public:
  // The batched arguments of `calls` (at least one; all compatible: same stage, mode, aux flag and
  // optional tensors present). Valid while this object lives.
  const MhcArgs& Gather(const std::vector<const MhcArgs*>& calls);
  const SwaArgs& Gather(const std::vector<const SwaArgs*>& calls, ScaleLayout scale_layout);
  // Copies the batch's outputs into each call's output views.
  void Scatter();

 private:
  struct OutputSlices {
    TensorView batched;
    std::vector<TensorView> parts;
    std::vector<int64_t> column_tokens;  // SWA q_scale in the [G, align4(M)] layout: each part's tokens
  };
  TensorView Input(const std::vector<const TensorView*>& parts, int64_t total_tokens);
  TensorView Output(const std::vector<const TensorView*>& parts, int64_t total_tokens);
  TensorView ColumnMajorScaleOutput(const std::vector<const TensorView*>& parts, std::vector<int64_t> tokens,
                                    int64_t total_tokens);
  void* NewBuffer(size_t bytes);

  size_t next_buffer_ = 0;  // slots of the per-thread buffer cache taken by this batch
  std::vector<OutputSlices> outputs_;
  MhcArgs mhc_;
  SwaArgs swa_;
};

}  // namespace fusedlayer::server
