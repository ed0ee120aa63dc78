// absl::Mutex made visible to ThreadSanitizer. Use these instead of absl::Mutex / absl::MutexLock /
// absl::ReaderMutexLock in fusedlayer code.
//
// Why: Debian's Abseil is a prebuilt shared library without TSan instrumentation, so absl::Mutex's
// Lock/Unlock (spin + futex inside libabsl_synchronization) create no happens-before edges TSan can
// see, and every access guarded by an absl::Mutex is reported as a data race. Abseil's own TSan hooks
// (ABSL_TSAN_MUTEX_*) are compiled into the library only when the library itself is built with TSan.
//
// What: in TSan builds (-fsanitize=thread: GCC's __SANITIZE_THREAD__, clang's
// __has_feature(thread_sanitizer)) every lock and unlock is bracketed by TSan's mutex API
// (__tsan_mutex_pre_lock/post_lock/pre_unlock/post_unlock, <sanitizer/tsan_interface.h>), exactly
// what Abseil does internally when instrumented. TSan then models the mutex like a pthread mutex:
// it orders the critical sections (writer and reader) and STILL reports an access that is not done
// under the lock, or a lock-order inversion. In other builds the wrappers are the plain absl calls
// (inline, zero cost) and the Abseil thread-safety annotations are kept (clang -Wthread-safety).
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
// FUSEDLAYER_TSAN (TSan detection) and, when set, <sanitizer/tsan_interface.h>: defined once
// there, shared with the gRPC hand-off annotations.
#include "fusedlayer/wire/tsan_annotations.h"

namespace fusedlayer::server {

class ABSL_LOCKABLE Mutex {
 public:
#ifdef FUSEDLAYER_TSAN
  Mutex() { __tsan_mutex_create(&mu_, __tsan_mutex_not_static); }
  ~Mutex() { __tsan_mutex_destroy(&mu_, __tsan_mutex_not_static); }
#else
  Mutex() = default;
#endif
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
#ifdef FUSEDLAYER_TSAN
    __tsan_mutex_pre_lock(&mu_, 0);
    mu_.Lock();
    __tsan_mutex_post_lock(&mu_, 0, 0);
#else
    mu_.Lock();
#endif
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
#ifdef FUSEDLAYER_TSAN
    __tsan_mutex_pre_unlock(&mu_, 0);
    mu_.Unlock();
    __tsan_mutex_post_unlock(&mu_, 0);
#else
    mu_.Unlock();
#endif
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() {
#ifdef FUSEDLAYER_TSAN
    __tsan_mutex_pre_lock(&mu_, __tsan_mutex_read_lock);
    mu_.ReaderLock();
    __tsan_mutex_post_lock(&mu_, __tsan_mutex_read_lock, 0);
#else
    mu_.ReaderLock();
#endif
  }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() {
#ifdef FUSEDLAYER_TSAN
    __tsan_mutex_pre_unlock(&mu_, __tsan_mutex_read_lock);
    mu_.ReaderUnlock();
    __tsan_mutex_post_unlock(&mu_, __tsan_mutex_read_lock);
#else
    mu_.ReaderUnlock();
#endif
  }

 private:
  absl::Mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace fusedlayer::server
