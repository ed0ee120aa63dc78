#include "runtime/device_staging.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace fusedlayer::server {

size_t ViewExtentBytes(const TensorView& v) {
  if (v.rank == 0 || v.numel() == 0) return 0;
  int64_t last = 0;
  for (int k = 0; k < v.rank; ++k) last += (v.shape[k] - 1) * v.stride[k];
  return static_cast<size_t>(last + 1) * DTypeSize(v.dtype);
}

absl::StatusOr<TensorView> DeviceStaging::Mirror(const TensorView& host, bool copy_in) {
  if (direct_ || host.empty_view()) return host;
  const size_t bytes = ViewExtentBytes(host);
  if (resident_.Contains(host.data, bytes)) return host;  // already in backend memory
  absl::StatusOr<DeviceBuffer> buf = backend_.Allocate(bytes);
  if (!buf.ok()) return buf.status();
  TensorView dev = host;
  dev.data = buf->data();
  if (copy_in && bytes > 0) {
    if (absl::Status s = backend_.CopyToDevice(dev.data, host.data, bytes); !s.ok()) return s;
  }
  buffers_.push_back(std::move(*buf));
  return dev;
}

absl::StatusOr<TensorView> DeviceStaging::Input(const TensorView& host) { return Mirror(host, /*copy_in=*/true); }

absl::StatusOr<TensorView> DeviceStaging::Output(const TensorView& host) {
  absl::StatusOr<TensorView> dev = Mirror(host, /*copy_in=*/false);
  if (dev.ok() && dev->data != host.data) outputs_.emplace_back(host, *dev);
  return dev;
}

absl::Status DeviceStaging::CopyOutputsBack() {
  for (const auto& [host, dev] : outputs_) {
    const size_t bytes = ViewExtentBytes(host);
    if (bytes == 0) continue;
    if (absl::Status s = backend_.CopyToHost(host.data, dev.data, bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

namespace {
// Each tensor starts on its own 256-byte boundary in the staging and device blocks (copy engines
// and vectorised kernel loads want aligned bases; cudaMalloc itself gives 256).
constexpr size_t kTensorAlign = 256;
size_t AlignUp(size_t n) { return (n + kTensorAlign - 1) / kTensorAlign * kTensorAlign; }
// Inputs are staged and copied in pieces of this size (see Stage). 1 MiB: ~20-40 us of copy at
// PCIe rates, long enough that the ~3-5 us per enqueued copy stays small.
constexpr size_t kStageChunkBytes = size_t{1} << 20;
}  // namespace

LaneStaging::~LaneStaging() {
  // A caller that skipped Finish() after Stage(): never free memory the device may still use.
  if (enqueued_) (void)lane_.Wait();
}

void LaneStaging::Input(const TensorView& host, TensorView* dev) {
  *dev = host;
  const size_t bytes = ViewExtentBytes(host);
  if (!host.empty_view() && !resident_.Contains(host.data, bytes)) tensors_.push_back(Tensor{host, dev, bytes, 0, true});
}

void LaneStaging::Output(const TensorView& host, TensorView* dev) {
  *dev = host;
  const size_t bytes = ViewExtentBytes(host);
  if (!host.empty_view() && !resident_.Contains(host.data, bytes)) {
    tensors_.push_back(Tensor{host, dev, bytes, 0, false});
  }
}

const char* LaneStaging::LayOutPinnedInputs() {
  if (pinned_.begin == nullptr) return nullptr;
  std::vector<HostPiece> pieces;
  for (const Tensor& t : tensors_) {
    if (!t.input || t.bytes == 0) continue;
    const char* p = static_cast<const char*>(t.host.data);
    if (!pinned_.Contains(p, t.bytes)) return nullptr;
    pieces.push_back(HostPiece{p, t.bytes});
  }
  // Offsets in the device block as in pinned_ (no input bytes: nothing to save).
  const HostRange span = OneCopySpan(pieces);
  if (span.begin == nullptr) return nullptr;
  for (Tensor& t : tensors_) {
    if (t.input && t.bytes > 0) t.offset = static_cast<size_t>(static_cast<const char*>(t.host.data) - span.begin);
  }
  inputs_end_ = static_cast<size_t>(span.end - span.begin);
  return span.begin;
}

absl::Status LaneStaging::Stage() {
  // Inputs first, then outputs, each on its own aligned offset: the inputs are one range of the
  // staging and device blocks and the outputs another, so each direction is one copy (or one per
  // chunk), not one per tensor. Why: every enqueued copy costs the lane's thread a few us of CUDA
  // runtime (cudaMemcpyAsync: 7 us a call under CUPTI on the H200), and an mHC call has 5 inputs
  // and 5 outputs.
  // Inputs already in pinned memory keep their layout there and skip the staging block.
  const char* const pinned_inputs = LayOutPinnedInputs();
  if (pinned_inputs == nullptr && pinned_.device_only) {
    // Never memcpy'd on the CPU (HostRange::device_only): TensorTransfer::UseInputsInPlace admits only
    // layouts LayOutPinnedInputs takes, so this is a bug, not a client's doing.
    return absl::InternalError("inputs in page-locked shared memory are not laid out for the device's copy");
  }
  size_t total = 0;
  for (bool inputs : {true, false}) {
    if (inputs && pinned_inputs != nullptr) {
      total = AlignUp(inputs_end_);
    } else {
      for (Tensor& t : tensors_) {
        if (t.input != inputs || t.bytes == 0) continue;
        if (!inputs && pinned_outputs_.Contains(t.host.data, t.bytes)) {
          t.direct = true;  // laid out below, after the staged outputs
          continue;
        }
        t.offset = total;
        total += AlignUp(t.bytes);
        (inputs ? inputs_end_ : outputs_end_) = t.offset + t.bytes;
      }
    }
    if (inputs) outputs_begin_ = total;
  }
  if (outputs_end_ < outputs_begin_) outputs_end_ = outputs_begin_;  // no staged outputs
  const size_t staging_end = std::max(outputs_end_, pinned_inputs != nullptr ? outputs_begin_ : inputs_end_);
  // Direct outputs: in the device block only.
  for (Tensor& t : tensors_) {
    if (!t.direct) continue;
    t.offset = total;
    total += AlignUp(t.bytes);
  }
  if (total == 0) {
    // Nothing to move (e.g. T = 0): the kernels get no memory, as from a zero-byte Allocate.
    for (Tensor& t : tensors_) t.dev->data = nullptr;
    return absl::OkStatus();
  }
  staging_base_ = pinned_inputs != nullptr ? outputs_begin_ : 0;
  if (staging_end > staging_base_) {
    absl::StatusOr<HostStagingPool::Lease> block = pool_.Acquire(staging_end - staging_base_);
    if (!block.ok()) return block.status();
    block_ = std::move(*block);
  }
  absl::StatusOr<DeviceBuffer> device = lane_.Allocate(total);
  if (!device.ok()) return device.status();
  device_ = std::move(*device);
  char* const dev = static_cast<char*>(device_.data());
  for (Tensor& t : tensors_) t.dev->data = dev + t.offset;  // a zero-byte tensor: the block's start
  if (pinned_inputs != nullptr) {
    // Already in page-locked memory that outlives the call: one copy of their span, no memcpy.
    enqueued_ = true;
    return lane_.EnqueueCopyToDevice(dev, pinned_inputs, inputs_end_);
  }
  char* const staging = block_.data();
  // The input range goes to the device in copies of about kStageChunkBytes, each enqueued as soon as
  // its bytes are in staging: the device copies chunk k while the host memcpy's chunk k + 1, so a
  // large input costs about the slower of the two instead of their sum. Small inputs share one copy
  // (with the alignment gaps between them, which nothing reads).
  size_t sent_up_to = 0;  // staging offset up to which the copies to the device are enqueued
  auto enqueue_to = [&](size_t end) -> absl::Status {
    if (end <= sent_up_to) return absl::OkStatus();
    enqueued_ = true;
    absl::Status s = lane_.EnqueueCopyToDevice(dev + sent_up_to, staging + sent_up_to, end - sent_up_to);
    sent_up_to = end;
    return s;
  };
  for (const Tensor& t : tensors_) {
    if (!t.input || t.bytes == 0) continue;
    const char* const src = static_cast<const char*>(t.host.data);
    for (size_t done = 0; done < t.bytes;) {
      const size_t n = std::min(kStageChunkBytes, t.bytes - done);
      pool_.copier().Copy(staging + t.offset + done, src + done, n, ParallelCopy::Destination::kPinnedStaging);
      done += n;
      if (t.offset + done - sent_up_to >= kStageChunkBytes) {
        if (absl::Status s = enqueue_to(t.offset + done); !s.ok()) return s;
      }
    }
  }
  return enqueue_to(inputs_end_);
}

absl::Status LaneStaging::EnqueueCopiesBack() {
  const char* const dev = static_cast<const char*>(device_.data());
  // The staged outputs' range in one copy (Stage() put them after the inputs).
  if (outputs_end_ > outputs_begin_) {
    enqueued_ = true;
    if (absl::Status s = lane_.EnqueueCopyToHost(block_.data() + (outputs_begin_ - staging_base_), dev + outputs_begin_,
                                                 outputs_end_ - outputs_begin_);
        !s.ok()) {
      return s;
    }
  }
  // Each direct output where it lies.
  for (const Tensor& t : tensors_) {
    if (!t.direct) continue;
    enqueued_ = true;
    if (absl::Status s = lane_.EnqueueCopyToHost(t.host.data, dev + t.offset, t.bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<RunStats> LaneStaging::Finish(bool copy_out, StageTimes* times,
                                             std::chrono::steady_clock::time_point device_from, OutputBuffers* lend_to) {
  // Always wait, even for a call that enqueued nothing: the lane's kernel time (and the error of
  // a launch that was enqueued) belongs to this call.
  absl::StatusOr<RunStats> waited = lane_.Wait();
  const auto waited_at = std::chrono::steady_clock::now();
  if (times != nullptr) times->device += SecondsBetween(device_from, waited_at);
  enqueued_ = false;
  if (!waited.ok()) {
    // The device's state is unknown: do not hand this block to the next request.
    block_.Discard();
    return waited;
  }
  if (copy_out) {
    char* const staging = block_.data();
    // The response's buffers take the block as it is (the copies back are done: Wait above; the
    // inputs staged in it, if any, go along, never read again).
    std::shared_ptr<const void> lent = lend_to != nullptr && staging != nullptr ? pool_.Lend(block_) : nullptr;
    for (const Tensor& t : tensors_) {
      if (t.input || t.bytes == 0 || t.direct) continue;
      char* const staged = staging + (t.offset - staging_base_);
      if (lent != nullptr && lend_to->Move(t.host.data, t.bytes, staged, lent)) continue;
      pool_.copier().Copy(t.host.data, staged, t.bytes, ParallelCopy::Destination::kHostMemory);
    }
    if (times != nullptr) times->copy_out += SecondsBetween(waited_at, std::chrono::steady_clock::now());
  }
  return waited;
}

}  // namespace fusedlayer::server
