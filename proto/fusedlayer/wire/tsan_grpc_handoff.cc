// ThreadSanitizer builds only (CMakeLists.txt links this object into every target when
// FUSEDLAYER_TSAN is on): the happens-before edge of a gRPC callback operation, made visible.
//
// Why: the C++ callback API's per-operation glue is header-only (grpcpp/support/callback_common.h
// CallbackWithSuccessTag, grpcpp/impl/call_op_set.h CallOpSet, server_callback_handlers.h), so it
// is compiled into OUR binaries and instrumented: the thread that starts an operation (Finish,
// StartRead, a client's StartCall) writes the tag and the op set, and the gRPC thread that
// completes it reads them in CallbackWithSuccessTag::Run, BEFORE any callback of ours runs. The
// ordering between the two is libgrpc's completion queue, prebuilt without TSan, so every such
// access was reported (fusedlayer/wire/tsan_annotations.h covers only what our own callbacks touch).
//
// What: the way an instrumented libgrpc would do it, at its C API boundary. grpc_call_start_batch
// is interposed (this executable's definition wins over libgrpc.so's for libgrpc++'s calls; the
// real one is found with dlsym(RTLD_NEXT)): when the batch's tag is a CallbackWithSuccessTag,
// everything the starting thread did is released on the tag, and the tag's run function is
// replaced by a trampoline that acquires it on the completing thread before running the original
// StaticRun. Nothing else changes: the same function runs, on the same thread, with the same
// arguments. Tags of other kinds (the sync API's CallOpSet on a pluck queue, server request tags,
// which libgrpc++ itself fills) are left alone.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "fusedlayer/wire/tsan_annotations.h"
#include "grpc/grpc.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/callback_common.h"
#include "grpcpp/support/server_callback.h"

namespace {

using RunFn = void (*)(grpc_completion_queue_functor*, int);

// CallbackWithSuccessTag::StaticRun is private: its address is named in an explicit template
// instantiation, which is exempt from access checking ([temp.spec.general]/6), and handed out by
// a friend defined in that instantiation: the standard way to name a private member from outside
// without changing gRPC's header.
RunFn StaticRunAddress();
template <RunFn F>
struct StaticRunOf {
  friend RunFn StaticRunAddress() { return F; }
};
template struct StaticRunOf<&grpc::internal::CallbackWithSuccessTag::StaticRun>;

const RunFn g_static_run = StaticRunAddress();

void Trampoline(grpc_completion_queue_functor* functor, int ok) {
  __tsan_acquire(functor);  // what the thread that started the operation did happens before
  g_static_run(functor, ok);
}

using StartBatchFn = grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*);

StartBatchFn RealStartBatch() {
  static const StartBatchFn real = [] {
    auto fn = reinterpret_cast<StartBatchFn>(dlsym(RTLD_NEXT, "grpc_call_start_batch"));
    if (fn == nullptr) {
      std::fprintf(stderr, "tsan_grpc_handoff: grpc_call_start_batch not found after this object\n");
      std::abort();
    }
    return fn;
  }();
  return real;
}

}  // namespace

extern "C" grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                                 void* reserved) {
  // A callback-queue tag is a grpc_completion_queue_functor whose first member is its run
  // function; any other tag (a C++ object with a vtable, or null) never holds StaticRun's address.
  auto* functor = static_cast<grpc_completion_queue_functor*>(tag);
  // A tag already routed through the trampoline is one that a reactor reuses for each operation
  // of its kind (a streaming reader's read tag is Set once, then every StartRead starts a batch
  // with it): each start must release again, or every read after the first is unordered with its
  // completion (TSan then reported CallOpSet's fields in LoadWeights streams of several chunks).
  if (functor != nullptr && (functor->functor_run == g_static_run || functor->functor_run == &Trampoline)) {
    __tsan_release(functor);
    functor->functor_run = &Trampoline;
  }
  return RealStartBatch()(call, ops, nops, tag, reserved);
}

// ---- the reference count of a server call, for the reactors' OnDone ------------------------------
// fusedlayer/wire/tsan_annotations.h, TsanAcquireCallReferences, says why. The count and the reactor's
// pointer to its call are private members of gRPC's header classes: named through explicit
// instantiations, as StaticRun is above.
namespace {

template <typename Tag, typename Tag::type kMember>
struct PrivateMember {
  friend typename Tag::type Get(Tag) { return kMember; }
};

struct CallReferences {
  using type = std::atomic_int grpc::internal::ServerCallbackCall::*;
  friend type Get(CallReferences);
};
template struct PrivateMember<CallReferences, &grpc::internal::ServerCallbackCall::callbacks_outstanding_>;

struct UnaryReactorCall {
  using type = std::atomic<grpc::ServerCallbackUnary*> grpc::ServerUnaryReactor::*;
  friend type Get(UnaryReactorCall);
};
template struct PrivateMember<UnaryReactorCall, &grpc::ServerUnaryReactor::call_>;

using ChunkReactor = grpc::ServerReadReactor<grpc::ByteBuffer>;  // LoadWeights, a raw method
struct ChunkReactorReader {
  using type = std::atomic<grpc::ServerCallbackReader<grpc::ByteBuffer>*> ChunkReactor::*;
  friend type Get(ChunkReactorReader);
};
template struct PrivateMember<ChunkReactorReader, &ChunkReactor::reader_>;

void AcquireReferences(grpc::internal::ServerCallbackCall* call) {
  if (call != nullptr) __tsan_acquire(&(call->*Get(CallReferences{})));
}

}  // namespace

namespace fusedlayer::wire {

void TsanAcquireCallReferences(grpc::ServerUnaryReactor* reactor) {
  AcquireReferences((reactor->*Get(UnaryReactorCall{})).load(std::memory_order_acquire));
}

void TsanAcquireCallReferences(grpc::ServerReadReactor<grpc::ByteBuffer>* reactor) {
  AcquireReferences((reactor->*Get(ChunkReactorReader{})).load(std::memory_order_acquire));
}

}  // namespace fusedlayer::wire

// ---- absl::Mutex / absl::CondVar, as libgrpc and libgpr use them ----------------------------------
// gpr_mu (libgpr) and grpc_core::Mutex / grpc::internal::Mutex are absl::Mutex in Debian's gRPC
// (GPR_ABSEIL_SYNC), and gRPC's completion queues, call combiners' slow paths, server request
// matching and executors hand work between threads under them. libabsl_synchronization is not
// instrumented either, so these are interposed the same way (libgrpc/libgpr call them through the
// PLT): acquire on the mutex after every lock, release before every unlock, both around a condition
// variable wait. That is exactly the ordering a mutex gives, no more: an access made without
// holding the mutex is still unordered, and fusedlayer's own locks (common/annotated_mutex.h) keep
// their full TSan mutex model on top.
namespace {

template <typename Fn>
Fn Next(const char* mangled) {
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, mangled));
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_grpc_handoff: %s not found after this object\n", mangled);
    std::abort();
  }
  return fn;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Next<void (*)(Mutex*)>("_ZN4absl7debian35Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}

bool Mutex::TryLock() {
  static const auto real = Next<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::Unlock() {
  static const auto real = Next<void (*)(Mutex*)>("_ZN4absl7debian35Mutex6UnlockEv");
  __tsan_release(this);
  real(this);
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Next<void (*)(CondVar*, Mutex*)>("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(this, mu);
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static const auto real = Next<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static const auto real = Next<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl
