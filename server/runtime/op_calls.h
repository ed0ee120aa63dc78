// One compute call of each op: the call (backend arguments over host views of the request and
// response bytes, built by codec/request_codec.h's Decode*Request) and its run on `path`.
//
// Where it runs (ExecTarget):
//   - host-accessible backend (CPU): the host views are handed to the kernels as they are, no copy;
//   - a lane (runtime/device_lanes.h), the serving path of a GPU: the request's tensors are memcpy'd
//     into ONE block of pinned staging (runtime/host_staging_pool.h), copied to the device with
//     stream-ordered copies, the op runs, the outputs are copied back into the staging block, and
//     the call waits once on its lane (an event, never a device-wide sync) before memcpy'ing the
//     outputs into the response bytes:
//
//       request bytes --memcpy--> staging --H2D--> device --kernel--> device --D2H--> staging
//                                                                       --memcpy--> response bytes
//       (host, the lane's worker)  (async on the lane's stream ..................)  (after Wait)
//
//     where the response's outputs are outside its message (runtime/output_buffers.h), the last
//     memcpy is replaced by lending the staging block to the response, which gRPC then sends
//     from as it is;
//
//   - otherwise the backend's default context, synchronously (runtime/device_staging.h): warm-up and
//     shadow verification, which are rare and serialised by the executor.
#pragma once

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/device_range.h"
#include "runtime/host_staging_pool.h"
#include "runtime/stage_times.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

class OutputBuffers;

struct MhcCall {
  MhcArgs args;  // host views: inputs over the request, outputs over the response
  MhcShapeQuery query;
  // Outputs that the run leaves in backend memory the server keeps (a residual session's state,
  // ExecTarget::resident) and that the response also wants: copied to `host` after the run.
  struct CopyBack {
    void* host;
    const void* device;
    size_t bytes;
  };
  std::vector<CopyBack> copies_after_run;
};

struct SwaCall {
  SwaArgs args;
  SwaShapeQuery query;
};

struct ExecTarget {
  Backend& backend;
  Lane* lane = nullptr;                // null: the backend's default context (or host views on a CPU)
  HostStagingPool* staging = nullptr;  // set with `lane`
  StageTimes* times = nullptr;         // when set, the run's stage times are added to it
  // The buffers the call's host output views point into (one request's response outside its
  // message, runtime/output_buffers.h), or null: on a lane they may take over the staging block
  // instead of having the outputs copied into them.
  OutputBuffers* outputs = nullptr;
  // Page-locked host memory that outlives the run, or empty: inputs viewed inside it are copied to
  // the device from there, not memcpy'd into staging first (one request's tensor data as
  // ReadWireRequest read it, rpc/wire_messages.h).
  HostRange pinned_inputs;
  // Page-locked host memory that outlives the run, or empty: outputs viewed inside it are copied
  // back there by the device, each where it lies, never through staging (a request's outputs in
  // its page-locked shared-memory region, transport/shared_memory.h).
  HostRange pinned_outputs;
  // Backend memory that outlives the run (a residual session's block, transport/
  // residual_sessions.h; the client's CUDA shared-memory regions, transport/cuda_shared_memory.h),
  // or empty: views inside it are handed to the kernels as they are.
  DeviceRanges resident;
  // Called on a lane once the run's last device work (kernels, copies back) is enqueued and before
  // the wait, to enqueue the call's answer on the lane (TransportCall::PrepareDeviceAnswer). Empty:
  // the call is answered after the wait.
  std::function<void(Lane&)> answer_on_device;
};

absl::StatusOr<RunStats> RunMhcCall(const ExecTarget& target, const PreparedMhcWeights& weights,
                                    const MhcArgs& host_args, Path path);
absl::StatusOr<RunStats> RunSwaCall(const ExecTarget& target, const PreparedSwaWeights& weights,
                                    const SwaArgs& host_args, Path path);
// On the backend's default context.
inline absl::StatusOr<RunStats> RunMhcCall(Backend& backend, const PreparedMhcWeights& weights,
                                           const MhcArgs& host_args, Path path) {
  return RunMhcCall(ExecTarget{backend}, weights, host_args, path);
}
inline absl::StatusOr<RunStats> RunSwaCall(Backend& backend, const PreparedSwaWeights& weights,
                                           const SwaArgs& host_args, Path path) {
  return RunSwaCall(ExecTarget{backend}, weights, host_args, path);
}

}  // namespace fusedlayer::server
