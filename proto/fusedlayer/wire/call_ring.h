// The call ring: the per-op data plane of a client on the server's host (proto OpenCallRing). gRPC
// opens the ring and stays for control; each call is a fixed-size descriptor the client writes into
// a slot of shared memory, and its completion record the server writes back into the same slot.
// No byte of the call crosses a socket, and no system call is made while both sides are busy: the
// server's poller spins on the slots, the client spins on its completion word; each side sleeps
// (the server on an eventfd, the client on a futex) only after spinning for a bounded time, and the
// other side wakes it only when it said it sleeps.
//
// This header is the memory layout both sides agree on (version kCallRingLayoutVersion), the futex
// and descriptor-passing helpers they share; the server is server/ring/, the C++ client
// client/lib/call_ring.h, the Python client fusedlayer/ring.py (which mirrors these offsets).
//
// The ring's memory is a memfd the server creates and seals against shrinking, mapped by both; the
// server hands it over (with the doorbell eventfd) on a unix socket by SCM_RIGHTS, and the client
// keeps that socket open for as long as it uses the ring: the ring closes when it closes (or the
// client dies). The client can write anything into the memory at any time: the server copies a
// descriptor out once before it reads any field of it and never reads the slot again for that call,
// so a garbage-writing client gets errors in its own completion records and nothing else.
//
// One call in a slot (client, then server):
//   client: writes slot.call, then stores slot.submit_seq = s (release; s = the previous seq + 1);
//           if header.poller_sleeping, writes 1 to the doorbell eventfd
//   server: sees submit_seq != the last seq it took from the slot, copies slot.call, runs it,
//           writes slot.completion, then stores slot.complete_seq = s (release); if
//           slot.client_waiting, FUTEX_WAKE on complete_seq. A CUDA call whose outputs all lie
//           in CUDA shared memory has its record written when its work is enqueued and
//           complete_seq = s stored by the GPU stream after that work (kRingCompletedByDevice):
//           the return needs no server thread; the server still wakes a sleeping client after.
//   client: spins until complete_seq == s (acquire), else sets client_waiting, re-checks and
//           FUTEX_WAITs on complete_seq; then reads slot.completion
// A slot holds one call at a time; a client with several slots has several calls in flight.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fusedlayer::wire {

inline constexpr uint32_t kCallRingMagic = 0x46524C43;  // "CLRF" little-endian: "call ring, fusedlayer"
inline constexpr uint32_t kCallRingLayoutVersion = 2;
inline constexpr int kRingMaxTensors = 12;
inline constexpr size_t kRingMessageBytes = 336;
inline constexpr size_t kRingDetailBytes = 192;

// RingCallDescriptor.op
enum class RingOp : uint32_t { kMhcSeam = 1, kSwaNormQuant = 2 };

// RingTensorRef.role: which request tensor (input) or response tensor (output) a reference is.
enum class RingRole : uint32_t {
  kNone = 0,
  // mHC inputs
  kX = 1,
  kResidual = 2,
  kPostMix = 3,
  kCombMix = 4,
  kPreMix = 5,
  // SWA input
  kQrKv = 6,
  // mHC outputs
  kNewResidual = 16,
  kNewPreMix = 17,
  kNewPostMix = 18,
  kNewCombMix = 19,
  kY = 20,
  kAux = 21,
  // SWA outputs
  kQFp8 = 24,
  kQScale = 25,
  kKv = 26,
  kQProj = 27,
};
// The proto field name of a role ("x", "new_residual", ...); "" for an unknown role.
const char* RingRoleName(RingRole role);
// Whether `role` is one of `op`'s inputs, or one of its outputs.
bool RingRoleIsInput(RingOp op, RingRole role);
bool RingRoleIsOutput(RingOp op, RingRole role);

// RingTensorRef.memory
enum class RingMemory : uint32_t { kSystem = 1, kCuda = 2 };

// One tensor of a call: bytes [offset, offset + byte_size) of a region bound when the ring was
// opened (OpenCallRingRequest.regions[region]). An input carries dtype and shape (as Tensor does);
// an output only where it goes (the server knows its shape).
struct RingTensorRef {
  uint32_t role;    // RingRole
  uint32_t region;  // index into the ring's bound regions
  uint32_t dtype;   // v1::DataType (inputs)
  uint32_t rank;    // 0..3 (inputs)
  int64_t shape[3];
  uint64_t offset;
  uint64_t byte_size;
};
static_assert(sizeof(RingTensorRef) == 56);

// RingCallDescriptor.flags
inline constexpr uint32_t kRingFlagCaptureAux = 1u << 0;

// What the client writes for one call. Plain data: the server copies it out whole (one memcpy)
// before it looks at any field.
struct RingCallDescriptor {
  uint32_t op;               // RingOp
  uint32_t weight_set;       // index into the ring's bound weight sets
  uint32_t path_preference;  // v1::PathPreference
  uint32_t stage;            // v1::MhcStage (mHC)
  uint32_t mode;             // v1::MhcMode (mHC)
  uint32_t flags;            // kRingFlag*
  // CLOCK_MONOTONIC nanoseconds after which the call is not launched (DEADLINE_EXCEEDED); 0: none.
  int64_t deadline_ns;
  uint32_t num_tensors;  // <= kRingMaxTensors
  uint32_t reserved;
  RingTensorRef tensors[kRingMaxTensors];
};

// RingCompletion.flags
// The GPU stream stored complete_seq after the call's kernels (a call whose outputs all lie in CUDA
// shared memory, on a GPU server): the record was written when the work was enqueued, so
// server_seconds ends there and kernel_seconds and the device stage are not in it (0).
inline constexpr uint32_t kRingCompletedByDevice = 1u << 0;

// What the server writes back. Strings are NUL-terminated (cut to fit).
struct RingCompletion {
  int32_t code;              // absl/gRPC status code; 0 = OK
  uint32_t path;             // v1::ExecutionPath
  uint32_t fallback_reason;  // v1::FallbackReason
  uint32_t batch_requests;   // requests that shared the launch (1: alone)
  uint32_t flags;            // kRingCompleted*
  uint32_t reserved;
  double server_seconds;     // from the poller taking the call to the completion
  double queue_seconds;
  double kernel_seconds;
  // Where server_seconds went (v1::StageSeconds, the same stages an RPC's report has; 0 on errors).
  double decode_seconds;
  double copy_in_seconds;
  double device_seconds;
  double copy_out_seconds;
  double response_seconds;
  char message[kRingMessageBytes];         // the status message when code != 0
  char fallback_detail[kRingDetailBytes];  // ExecutionReport.fallback_detail
};

// The control words of a slot, each on its own cache line: the client writes submit_seq and
// client_waiting, the server complete_seq.
struct alignas(64) RingSlotControl {
  std::atomic<uint32_t> submit_seq;
  uint8_t pad0_[60];
  std::atomic<uint32_t> complete_seq;  // the futex word the client waits on
  std::atomic<uint32_t> client_waiting;
  uint8_t pad1_[56];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the ring's words are shared between processes");

struct alignas(64) RingSlot {
  RingSlotControl control;
  RingCallDescriptor call;
  alignas(64) RingCompletion completion;
};

// The first page of the ring. The server writes magic..slot_offset once before handing the ring
// over; poller_sleeping is the server's "wake me" flag (the client writes the doorbell eventfd only
// when it is set).
struct alignas(64) RingHeader {
  uint32_t magic;
  uint32_t layout_version;
  uint32_t slots;
  uint32_t slot_bytes;  // sizeof(RingSlot)
  uint64_t ring_id;
  uint64_t slot_offset;  // of slot 0 from the start of the ring
  uint8_t pad0_[32];
  std::atomic<uint32_t> poller_sleeping;
  uint8_t pad1_[60];
};

inline constexpr uint64_t kRingSlotOffset = 4096;
inline uint64_t RingBytes(uint32_t slots) {
  const uint64_t bytes = kRingSlotOffset + uint64_t{slots} * sizeof(RingSlot);
  return (bytes + 4095) / 4096 * 4096;
}
inline RingHeader* RingHeaderAt(void* base) { return static_cast<RingHeader*>(base); }
inline RingSlot* RingSlotAt(void* base, uint32_t i) {
  return reinterpret_cast<RingSlot*>(static_cast<char*>(base) + kRingSlotOffset) + i;
}

// Layout facts the Python client checks against its own offsets (client/python/fusedlayer/ring.py).
inline constexpr size_t kRingSlotBytes = sizeof(RingSlot);
inline constexpr size_t kRingCallOffsetInSlot = offsetof(RingSlot, call);
inline constexpr size_t kRingCompletionOffsetInSlot = offsetof(RingSlot, completion);
// ring.py hard-codes these same numbers (RING_SLOT_BYTES, ..., and layout_mismatches(), which its
// tests check): a layout change here must change them there too, or this fails to compile.
static_assert(kRingSlotBytes == 1536 && kRingCallOffsetInSlot == 128 && kRingCompletionOffsetInSlot == 896,
              "client/python/fusedlayer/ring.py mirrors the slot layout");
static_assert(sizeof(RingCallDescriptor) == 712 && offsetof(RingCallDescriptor, tensors) == 40 &&
                  sizeof(RingCompletion) == 616 && offsetof(RingCompletion, message) == 88,
              "client/python/fusedlayer/ring.py mirrors the descriptor and the completion");
static_assert(sizeof(RingSlotControl) == 128 && offsetof(RingSlotControl, complete_seq) == 64 &&
                  offsetof(RingSlotControl, client_waiting) == 68,
              "client/python/fusedlayer/ring.py mirrors the control words");
static_assert(sizeof(RingHeader) == 128 && offsetof(RingHeader, poller_sleeping) == 64 && kRingSlotOffset == 4096,
              "client/python/fusedlayer/ring.py mirrors the header");

// Futex on a word of shared memory (not FUTEX_PRIVATE: the two processes map the page apart).
// Wait returns when *word != expected, on a wake, or after timeout_ns (< 0: no timeout).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
void FutexWakeAll(std::atomic<uint32_t>* word);

// CLOCK_MONOTONIC now, nanoseconds (the clock of RingCallDescriptor.deadline_ns).
int64_t MonotonicNanos();

// Descriptor passing on a connected unix stream socket: `bytes` with the descriptors attached
// (SCM_RIGHTS). Receive returns the number of descriptors received (at most `max_fds`) and the
// payload in *bytes, or -1 with errno set.
bool SendWithDescriptors(int socket, std::string_view bytes, const int* fds, int num_fds);
int ReceiveWithDescriptors(int socket, std::string* bytes, size_t max_bytes, int* fds, int max_fds);

}  // namespace fusedlayer::wire
