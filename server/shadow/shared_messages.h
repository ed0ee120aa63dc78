// Zero-copy shadow capture (docs/shadow.md "Lifetime of a sampled request's messages"): the
// messages of a compute call (MhcSeam, SwaNormQuant), reference counted, so a shadow job can keep
// reading the RPC's own request and fused response after the response was sent, without copying
// them.
//
//   the call's reference   taken at construction, in the raw method's handler
//                          (rpc/compute_rpcs.cc), which parses the request into it; dropped in
//                          ComputeCall::ReleaseWhenDone, from OnDone (rpc/unary_call.cc), once the response was encoded
//                          into gRPC's ByteBuffer (inside Complete, before Finish) and the call is
//                          over;
//   a job's reference      SharedMessagesRef, taken on the executor worker before the response is
//                          sent (the call's reference is certainly alive then: OnDone cannot run
//                          before Finish), dropped when the job is destroyed (ran, or dropped at
//                          shutdown).
//   whoever drops the last reference deletes the messages (acq_rel on the count, so every write
//   made before the other side's drop is visible to the deleting thread).
//
// What may happen to the messages while both references are held: the response is encoded from a
// `const Message&` (rpc/wire_messages.h) and never written, cleared or moved afterwards; the
// request is only written by the parse, before the call is queued. The job only reads (const
// accessors): concurrent const access to a protobuf message is safe (its only mutable state, the
// cached sizes, is atomic in protobuf 3.21: internal::CachedSize). A sampled request keeps its
// outputs in the response message (exec/compute_engine.cc), so the job finds them there.
//
// Plain heap objects rather than a protobuf arena: the holder is one heap allocation per call, and
// must outlive the call when a job holds it.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server::shadow {

// Process-wide counts of holders created and freed (tests: nothing leaks, nothing is freed early).
struct SharedMessagesCounters {
  static inline std::atomic<uint64_t> allocated{0};
  static inline std::atomic<uint64_t> freed{0};
  static uint64_t live() {
    return allocated.load(std::memory_order_acquire) - freed.load(std::memory_order_acquire);
  }
};

template <typename Req, typename Resp>
class SharedMessagesRef;

// The count, apart from the message types: UnaryCall (rpc/unary_call.cc) holds the call's
// reference without knowing the method.
class SharedMessagesCount {
 public:
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) Destroy();
  }
  int refs_for_test() const { return refs_.load(std::memory_order_acquire); }

 protected:
  virtual ~SharedMessagesCount() = default;
  virtual void Destroy() = 0;

 private:
  std::atomic<int> refs_{1};  // the call's
};

// A plain holder (the raw compute methods parse the request themselves, so gRPC's MessageHolder
// and its allocator hooks are not involved).
template <typename Req, typename Resp>
class SharedMessages final : public SharedMessagesCount {
 public:
  SharedMessages() { SharedMessagesCounters::allocated.fetch_add(1, std::memory_order_relaxed); }
  SharedMessages(const SharedMessages&) = delete;
  SharedMessages& operator=(const SharedMessages&) = delete;

  // Written only by the handler's parse and by the call's run, while the call's reference is held.
  Req* request() { return &request_; }
  Resp* response() { return &response_; }

  // The call's reference ends (once, when the call is done).
  void Release() { Unref(); }
  using SharedMessagesCount::Unref;

  // Another reference, for a reader that outlives the call. Only while a reference is held.
  SharedMessagesRef<Req, Resp> AddRef() {
    Ref();
    return SharedMessagesRef<Req, Resp>(this);
  }

 private:
  friend class SharedMessagesRef<Req, Resp>;
  ~SharedMessages() override { SharedMessagesCounters::freed.fetch_add(1, std::memory_order_release); }
  void Destroy() override { delete this; }

  Req request_;
  Resp response_;
};

// A reader's reference (move-only): const access to the messages, dropped when destroyed.
template <typename Req, typename Resp>
class SharedMessagesRef {
 public:
  SharedMessagesRef() = default;
  SharedMessagesRef(SharedMessagesRef&& o) noexcept : held_(std::exchange(o.held_, nullptr)) {}
  SharedMessagesRef& operator=(SharedMessagesRef&& o) noexcept {
    if (this != &o) {
      reset();
      held_ = std::exchange(o.held_, nullptr);
    }
    return *this;
  }
  SharedMessagesRef(const SharedMessagesRef&) = delete;
  SharedMessagesRef& operator=(const SharedMessagesRef&) = delete;
  ~SharedMessagesRef() { reset(); }

  explicit operator bool() const { return held_ != nullptr; }
  const Req& request() const { return held_->request_; }
  const Resp& response() const { return held_->response_; }
  void reset() {
    if (held_ != nullptr) std::exchange(held_, nullptr)->Unref();
  }

 private:
  friend class SharedMessages<Req, Resp>;
  explicit SharedMessagesRef(SharedMessages<Req, Resp>* held) : held_(held) {}
  SharedMessages<Req, Resp>* held_ = nullptr;
};

using MhcMessages = SharedMessages<v1::MhcSeamRequest, v1::MhcSeamResponse>;
using MhcMessagesRef = SharedMessagesRef<v1::MhcSeamRequest, v1::MhcSeamResponse>;
using SwaMessages = SharedMessages<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>;
using SwaMessagesRef = SharedMessagesRef<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>;

}  // namespace fusedlayer::server::shadow
