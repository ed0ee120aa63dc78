// Zero-copy shadow capture (docs/shadow.md "Lifetime of a sampled request's messages"): a gRPC
// MessageAllocator for the callback unary compute methods whose MessageHolder is reference
// counted, so a shadow job can keep reading the RPC's own request and fused response after the
// response was sent, without copying them.
//
//   gRPC's reference   taken at allocation (the holder starts at 1); dropped by Release(), which
//                      gRPC calls exactly once, last, in ServerCallbackUnaryImpl::CallOnDone
//                      (grpcpp/impl/codegen/server_callback_handlers.h: reactor->OnDone(), then
//                      allocator_state_->Release()), i.e. after the response was serialized and the
//                      call is over. Deserialize() allocates the holder and RunHandler() always
//                      follows (also for a request that failed to parse), so Release() always comes.
//   a job's reference  SharedMessagesRef, taken on the executor worker before the response is sent
//                      (the RPC's reference is certainly alive then: OnDone cannot run before
//                      Finish), dropped when the job is destroyed (ran, or dropped at shutdown).
//   whoever drops the last reference deletes the messages (acq_rel on the count, so every write
//   made before the other side's drop is visible to the deleting thread).
//
// What may happen to the messages while both references are held: gRPC serializes the response
// from a `const M&` (CallOpSendMessage::SendMessagePtr stores a `const void*`; the serializer runs
// SerializationTraits<M>::Serialize(const M&), grpcpp/impl/call_op_set.h and
// grpcpp/impl/codegen/proto_utils.h GenericSerialize) synchronously inside Finish() when no
// interceptor is registered (this server registers none), and never writes, clears or moves
// either message; the request is only written by Deserialize(), before the reactor starts. The
// job only reads (const accessors): concurrent const access to a protobuf message is safe (its
// only mutable state, the cached sizes, is atomic in protobuf 3.21: internal::CachedSize).
//
// Plain heap objects rather than a protobuf arena: the default holder (DefaultMessageHolder,
// grpcpp/support/server_callback.h) embeds the two messages in gRPC's *call* arena, not a protobuf
// Arena, so their fields were heap-allocated already; the messages here are the same, and the
// holder itself is one heap allocation per call instead of a call-arena slice (the call arena dies
// with the call, which is exactly what a job must outlive).
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include "fusedlayer/v1/fusedlayer.pb.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/message_allocator.h"

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

// The count, apart from the message types: UnaryCall (rpc/unary_call.cc) holds a reference across
// its Finish() without knowing the method. Why: gRPC serializes the response inside Finish() on the
// calling thread, and the call may complete (OnDone, then Release() on a gRPC thread) before
// Finish() returns. gRPC orders that, but through its uninstrumented internals; with this
// reference the messages are deleted by whoever lets go last, ordered by the count's acq_rel, so
// ThreadSanitizer sees the serialization happen before the delete (common/tsan_annotations.h).
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
  std::atomic<int> refs_{1};  // gRPC's
};

template <typename Req, typename Resp>
class SharedMessages final : public grpc::MessageHolder<Req, Resp>, public SharedMessagesCount {
 public:
  SharedMessages() {
    this->set_request(&request_);
    this->set_response(&response_);
    SharedMessagesCounters::allocated.fetch_add(1, std::memory_order_relaxed);
  }
  SharedMessages(const SharedMessages&) = delete;
  SharedMessages& operator=(const SharedMessages&) = delete;

  // gRPC's reference ends (once, when the call is done).
  void Release() override { Unref(); }
  using SharedMessagesCount::Unref;

  // Another reference, for a reader that outlives the call. Only while a reference is held.
  SharedMessagesRef<Req, Resp> AddRef() {
    Ref();
    return SharedMessagesRef<Req, Resp>(this);
  }

  // The holder of this call's messages, or null when the method has no SharedMessageAllocator.
  static SharedMessages* Of(grpc::CallbackServerContext* ctx) {
    return dynamic_cast<SharedMessages*>(ctx->GetRpcAllocatorState());
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

// Registered with SetMessageAllocatorFor_<Method> (FusedLayerService's constructor); stateless, so
// holders never refer back to it and may outlive it.
template <typename Req, typename Resp>
class SharedMessageAllocator final : public grpc::MessageAllocator<Req, Resp> {
 public:
  grpc::MessageHolder<Req, Resp>* AllocateMessages() override { return new SharedMessages<Req, Resp>(); }
};

using MhcMessages = SharedMessages<v1::MhcSeamRequest, v1::MhcSeamResponse>;
using MhcMessagesRef = SharedMessagesRef<v1::MhcSeamRequest, v1::MhcSeamResponse>;
using SwaMessages = SharedMessages<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>;
using SwaMessagesRef = SharedMessagesRef<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>;

}  // namespace fusedlayer::server::shadow
