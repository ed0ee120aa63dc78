// Happens-before edges through gRPC, made visible to ThreadSanitizer.
//
// Why: Debian's libgrpc / libgrpc++ are prebuilt without TSan instrumentation. When our code hands
// a call to gRPC (StartRead, StartWrite, Finish) and gRPC later calls us back for it on another of
// its threads (OnReadDone, OnWriteDone, OnDone), the synchronisation that orders the two (its
// completion queues, combiners, executors: atomics and futexes inside libgrpc) is invisible to TSan.
// Every object our code touched before the hand-off and touches (or gRPC frees, through the
// intercepted free) after it then looks unsynchronised: the messages a reactor fills, the reactor
// itself when OnDone deletes it, the call arena gRPC frees after OnDone. TSan reports these as data
// races although gRPC does order them.
//
// What: the reactors announce the hand-off themselves, the way an instrumented gRPC would:
// TsanReleaseTo(reactor) just before every StartRead / Finish (everything this thread did so far
// happens before what follows), TsanAcquireFrom(reactor) first thing in every callback gRPC runs for
// the call (OnReadDone, OnCancel, OnDone). The address is only a key for TSan's sync object: the
// reactor's own address, alive for as long as gRPC may call it back. gRPC does deliver each callback
// after the operation that triggered it, so the edges are the ones gRPC really provides; they add
// no ordering TSan could not otherwise prove wrong in our code: an access made on another thread
// WITHOUT going through such a hand-off (or one of our own locks) is still reported.
//
// OnCancel ends with TsanReleaseTo(reactor) too: gRPC runs it in a closure inside libgrpc++ that
// drops the call's reference after it returns (not instrumented), and the thread that drops the
// last reference runs OnDone, which may delete the reactor on another thread.
//
// In builds without TSan these are empty inline functions (no code).
//
// TSan detection (GCC: __SANITIZE_THREAD__, clang: __has_feature(thread_sanitizer)) is defined
// here once, as FUSEDLAYER_TSAN, with <sanitizer/tsan_interface.h> included when it is set;
// common/annotated_mutex.h includes this header and uses the same macro.
#pragma once

#ifndef FUSEDLAYER_TSAN
#if defined(__SANITIZE_THREAD__)
#define FUSEDLAYER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FUSEDLAYER_TSAN 1
#endif
#endif
#endif

#ifdef FUSEDLAYER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace grpc {
class ByteBuffer;
class ServerUnaryReactor;
template <class Request>
class ServerReadReactor;
}  // namespace grpc

namespace fusedlayer::wire {

// Before handing the call keyed by `key` to gRPC (StartRead, StartWrite, Finish, ...).
inline void TsanReleaseTo(const void* key) {
#ifdef FUSEDLAYER_TSAN
  __tsan_release(const_cast<void*>(key));
#else
  (void)key;
#endif
}

// First thing in a callback gRPC runs for the call keyed by `key` (OnReadDone, OnCancel, OnDone).
inline void TsanAcquireFrom(const void* key) {
#ifdef FUSEDLAYER_TSAN
  __tsan_acquire(const_cast<void*>(key));
#else
  (void)key;
#endif
}

// First thing in OnDone, before TsanAcquireFrom: everything every gRPC thread did with the call
// before it let go of its last operation happens before, also the threads that never ran a callback
// of ours. Why it is needed besides TsanAcquireFrom: gRPC calls OnDone once its call's reference
// count (grpc::internal::ServerCallbackCall::callbacks_outstanding_, one reference per pending
// operation) reaches 0. The header-compiled part of gRPC drops a reference after the completion of
// Finish or a read (instrumented: it reads the reactor's vtable for InternalInlineable, then
// fetch_sub's with acq_rel), but the reference that OnCancel's closure drops is dropped inside
// libgrpc++ (not instrumented), and that thread may then run OnDone and delete the reactor. TSan
// saw the Finish thread's vtable read unordered with the destructor's vtable write (the clean-clone
// CI's ServerBatching.DeadlinesAndCancellationWhileWaitingForABatch, stop 21). Acquiring the
// reference count's own address is the edge its acq_rel atomics really give: every instrumented
// fetch_sub released there. Defined in tsan_grpc_handoff.cc (TSan builds only: it names
// gRPC's private members the way that file names StaticRun).
#ifdef FUSEDLAYER_TSAN
void TsanAcquireCallReferences(grpc::ServerUnaryReactor* reactor);
void TsanAcquireCallReferences(grpc::ServerReadReactor<grpc::ByteBuffer>* reactor);  // LoadWeights (raw)
#else
template <typename Reactor>
inline void TsanAcquireCallReferences(Reactor* reactor) {
  (void)reactor;
}
#endif

}  // namespace fusedlayer::wire
