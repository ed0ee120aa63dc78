// Moves one call's tensors between the request/response bytes (host) and the backend's memory.
// On a host-accessible backend (CPU) the host views are handed to the kernels as they are: no
// copies. Otherwise each input is allocated on the device and copied in, each output allocated,
// and CopyOutputsBack() copies the results into the response bytes after the run. Runs on the
// executor thread (it drives the backend).
#pragma once

#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/device_range.h"
#include "runtime/host_staging_pool.h"
#include "runtime/output_buffers.h"
#include "runtime/stage_times.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

class DeviceStaging {
 public:
  // Views inside `resident` (backend memory the server keeps, runtime/device_range.h) pass through.
  explicit DeviceStaging(Backend& backend, DeviceRanges resident = {})
      : backend_(backend), direct_(backend.host_accessible()), resident_(resident) {}

  // The view to give the backend for a host input / output view. Empty views (absent optional
  // tensors) pass through. ResourceExhausted when the device is out of memory.
  absl::StatusOr<TensorView> Input(const TensorView& host);
  absl::StatusOr<TensorView> Output(const TensorView& host);
  absl::Status CopyOutputsBack();

 private:
  absl::StatusOr<TensorView> Mirror(const TensorView& host, bool copy_in);

  Backend& backend_;
  const bool direct_;
  const DeviceRanges resident_;
  std::vector<DeviceBuffer> buffers_;
  std::vector<std::pair<TensorView, TensorView>> outputs_;  // (host, device)
};

// A call's tensors on a lane (see runtime/op_calls.h for the stages): Input/Output record where each
// host view's device copy goes, Stage() takes one staging block for all of them (inputs first,
// then outputs), memcpy's the inputs in and enqueues their copy to the device (one copy per ~1 MiB
// chunk of the inputs' range, not per tensor); after the op is enqueued, EnqueueCopiesBack()
// queues one copy of the outputs' range into the block, and Finish() waits once on the lane and
// memcpy's the outputs into their host views, or, when the host views are a response's
// OutputBuffers and the pool lends the block, hands the block to those buffers instead (no
// memcpy). Finish() must be called once Stage() was (whatever failed in
// between): the staging block goes back to the pool only after the lane's Wait(), when the device
// no longer reads or writes it. Runs on the lane's worker.
//
// Inputs that all lie in `pinned` (page-locked memory that outlives the call, each 64-byte
// aligned relative to the first) are not memcpy'd: their span is copied to the device from there
// in one copy, and the staging block holds only the outputs. When `pinned` is device_only (a
// client's page-locked shared memory) and the inputs do not lie so, Stage() fails rather than read it.
// Outputs that lie in `pinned_outputs` (page-locked memory that outlives the call) are copied back
// by the device each where it lies, one copy per output, and never pass through staging.
// Views that lie in `resident` (device memory the server keeps between calls: a residual session,
// runtime/device_range.h) are the kernels' as they are: neither staged nor copied.
class LaneStaging {
 public:
  LaneStaging(Lane& lane, HostStagingPool& pool, HostRange pinned = {}, HostRange pinned_outputs = {},
              DeviceRanges resident = {})
      : lane_(lane), pool_(pool), pinned_(pinned), pinned_outputs_(pinned_outputs), resident_(resident) {}
  ~LaneStaging();

  // `*dev` is set by Stage() (empty views pass through unchanged).
  void Input(const TensorView& host, TensorView* dev);
  void Output(const TensorView& host, TensorView* dev);
  absl::Status Stage();
  absl::Status EnqueueCopiesBack();
  // Waits for the lane; when `copy_out`, copies the outputs into their host views, except those
  // that `lend_to` (the buffers the host views point into, or null) takes over in the lent
  // staging block. The lane's error (Internal) if its work failed. When `times` is set, the wait
  // (from `device_from`, the end of Stage()) is added to its device stage and the copy out (or
  // the lending) to its copy_out stage.
  absl::StatusOr<RunStats> Finish(bool copy_out, StageTimes* times = nullptr,
                                  std::chrono::steady_clock::time_point device_from = {},
                                  OutputBuffers* lend_to = nullptr);

 private:
  struct Tensor {
    TensorView host;
    TensorView* dev;
    size_t bytes = 0;
    size_t offset = 0;  // in the staging block and in the device block alike
    bool input = false;
    bool direct = false;  // an output copied back where it lies (pinned_outputs_), device block only
  };
  // Lays the inputs out as they lie in pinned_ (offset = address - the first input's) when they
  // all do, and returns the span's start; null otherwise (nothing laid out).
  const char* LayOutPinnedInputs();

  Lane& lane_;
  HostStagingPool& pool_;
  const HostRange pinned_;
  const HostRange pinned_outputs_;
  const DeviceRanges resident_;
  std::vector<Tensor> tensors_;
  // Stage()'s layout: inputs in [0, inputs_end_), outputs in [outputs_begin_, outputs_end_).
  size_t inputs_end_ = 0;
  size_t outputs_begin_ = 0;
  size_t outputs_end_ = 0;
  // The device block's offset of the staging block's first byte: 0, or outputs_begin_ when the
  // inputs are copied from pinned_ and the staging block holds only the outputs.
  size_t staging_base_ = 0;
  HostStagingPool::Lease block_;
  DeviceBuffer device_;
  bool enqueued_ = false;  // work on the lane not yet waited for
};

// Bytes spanned by a view: from its first element to one past its last (strided rows included).
size_t ViewExtentBytes(const TensorView& v);

}  // namespace fusedlayer::server
