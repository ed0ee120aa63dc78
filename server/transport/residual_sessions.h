// Residual sessions: one request stream's mHC state (the residual R [T, n, C] bf16 and the pre,
// post and comb mixes) kept in the backend's memory between seams, so a client sends x and gets y
// per call instead of shipping R and the mixes both ways (proto: MhcSeamRequest.session).
//
// Memory: a session holds two copies of its state in ONE backend block (device memory on a GPU,
// host memory on the CPU backend), allocated at open. A call reads the current copy and writes the
// other; only a call that succeeded makes its copy current (Lease::Commit), so a failed call (or a
// fused launch re-run unfused) leaves the state as it was. The views of both copies lie in the
// block, which the lanes pass to the kernels untouched (runtime/device_range.h): no tensor byte of
// the state crosses PCIe or the socket.
//
// Calls of one session are serial: a call holds the session (Acquire) from decode to its response,
// and a second call meanwhile is ABORTED. So the state needs no lock of its own; the store's mutex
// guards the map, the busy flags and the bookkeeping.
//
// Ownership and limits as for shared-memory regions (transport/shared_memory.h): a session belongs
// to the identity that opened it, in a per-identity namespace (another identity's session is
// NOT_FOUND); per identity at most max_sessions sessions and max_bytes bytes, and total_bytes for all
// identities together (so that many identities cannot take the memory requests need). A session idle for
// idle_seconds is closed by the store's reaper thread; a session is closed when a weight set it
// used is unloaded (CloseUsing). Closing never waits for a call in flight: that call keeps the
// block alive until it is done and its commit is dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/annotated_mutex.h"
#include "common/periodic_task.h"
#include "runtime/device_range.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/tensor.h"
#include "metrics/component_metrics.h"
#include "prometheus/registry.h"

namespace fusedlayer::server::transport {

struct ResidualSessionLimits {
  int64_t max_sessions = 64;                // per identity; 0: sessions are off
  uint64_t max_bytes = uint64_t{4} << 30;   // backend bytes per identity
  uint64_t total_bytes = uint64_t{16} << 30;  // backend bytes, all identities together
  int64_t max_tokens = int64_t{1} << 16;    // T of a session (the server's --max_tokens)
  double idle_seconds = 600;                // closed after this long without a call
};

struct ResidualSessionShape {
  int64_t tokens = 0;  // T
  int hc_mult = 0;     // n
  int64_t hidden = 0;  // C
};

// One copy of a session's state, as views of backend memory.
struct ResidualState {
  TensorView residual;  // bf16 [T, n, C]
  TensorView pre_mix;   // fp32 [T, n]
  TensorView post_mix;  // fp32 [T, n]
  TensorView comb_mix;  // fp32 [T, n, n]
};

// What List reports of one session.
struct ResidualSessionInfo {
  std::string name;
  ResidualSessionShape shape;
  uint64_t bytes = 0;
  bool has_residual = false;
  bool has_mixes = false;
  uint64_t calls = 0;
  double idle_seconds = 0;
  std::string last_weight_set;
  size_t device = 0;  // the ordinal of the serving device that holds it
};

class ResidualSessionStore;

// One open session. Its mutable fields are the store's (guarded by its mutex), except the state
// bytes, which only the call holding the session touches.
class ResidualSession {
 public:
  ResidualSession(std::string identity, std::string name, ResidualSessionShape shape, DeviceBuffer block,
                  size_t copy_bytes, size_t device = 0);
  const std::string& identity() const { return identity_; }
  const std::string& name() const { return name_; }
  const ResidualSessionShape& shape() const { return shape_; }
  uint64_t bytes() const { return block_.bytes(); }
  // The serving device (its ordinal) whose memory holds the state: the session's calls run there.
  size_t device() const { return device_; }
  // Copy `which` (0 or 1) of the state.
  ResidualState State(int which) const;
  DeviceRange memory() const;

 private:
  friend class ResidualSessionStore;
  const std::string identity_, name_;
  const ResidualSessionShape shape_;
  DeviceBuffer block_;
  const size_t copy_bytes_;
  const size_t device_;
  // Guarded by the store's mutex.
  int current_ = 0;
  bool has_residual_ = false;
  bool has_mixes_ = false;
  bool busy_ = false;
  bool closed_ = false;
  // Closed while a call held it: its bytes stay counted until that call lets go of the block.
  bool uncount_on_release_ = false;
  uint64_t calls_ = 0;
  std::chrono::steady_clock::time_point last_used_;
  std::string last_weight_set_;
  std::set<std::string> weight_sets_;  // every set a call of the session used (CloseUsing)
};

class ResidualSessionStore {
 public:
  // `backends` allocate the sessions' blocks (Backend::Allocate, thread-safe), by the serving
  // devices' ordinals: a session opened on device d is held by backends[d].
  ResidualSessionStore(ResidualSessionLimits limits, std::vector<Backend*> backends, prometheus::Registry& metrics);
  ResidualSessionStore(ResidualSessionLimits limits, Backend& backend, prometheus::Registry& metrics)
      : ResidualSessionStore(limits, std::vector<Backend*>{&backend}, metrics) {}
  ~ResidualSessionStore();  // stops the reaper; blocks of sessions still open are freed

  bool enabled() const { return limits_.max_sessions > 0; }

  // The RPCs (rpc/residual_session_rpcs.cc); `identity` is the caller's (auth/caller_identity.h).
  // Open: INVALID_ARGUMENT for a bad name or shape, ALREADY_EXISTS, RESOURCE_EXHAUSTED over the
  // identity's limits or out of backend memory; returns the bytes held.
  // `device`: the ordinal of the serving device whose memory holds the session.
  absl::StatusOr<uint64_t> Open(const std::string& identity, const std::string& name, ResidualSessionShape shape,
                                size_t device = 0);
  std::vector<ResidualSessionInfo> List(const std::string& identity);
  // `name` empty: every session of the identity. Returns (sessions closed, bytes freed).
  absl::StatusOr<std::pair<uint32_t, uint64_t>> Close(const std::string& identity, const std::string& name);
  // Closes every session (all identities) that used the weight set `weight_set`.
  void CloseUsing(const std::string& weight_set);
  // Closes the sessions idle for at least limits.idle_seconds at `now` (the reaper's step).
  void CloseIdle(std::chrono::steady_clock::time_point now);

  // One call's hold on a session (move-only; releases it when destroyed).
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }

    bool held() const { return session_ != nullptr; }
    const ResidualSession& session() const { return *session_; }
    // What the session had when the call took it (nothing else can change it meanwhile).
    bool has_residual() const { return has_residual_; }
    bool has_mixes() const { return has_mixes_; }
    const ResidualState& current() const { return current_state_; }  // the call's inputs
    const ResidualState& next() const { return next_state_; }        // the call's outputs
    DeviceRange memory() const { return session_->memory(); }
    // The call succeeded: `next` becomes the state. `has_mixes`: the call wrote the mixes too (not
    // the HEAD stage). Dropped when the session was closed meanwhile.
    void Commit(bool has_mixes);

   private:
    friend class ResidualSessionStore;
    void Release();
    ResidualSessionStore* store_ = nullptr;
    std::shared_ptr<ResidualSession> session_;
    std::string weight_set_;
    bool weight_set_added_ = false;  // Acquire added it to the session's sets (taken back unless committed)
    bool committed_ = false;
    bool has_residual_ = false, has_mixes_ = false;
    ResidualState current_state_, next_state_;
  };
  // NOT_FOUND when the identity has no such session, ABORTED while another call holds it,
  // FAILED_PRECONDITION when sessions are off. The call runs through `weight_set`: the session
  // counts as using it from here (an unload while the call runs closes the session, CloseUsing),
  // and keeps it only if the call commits.
  absl::StatusOr<Lease> Acquire(const std::string& identity, const std::string& name, const std::string& weight_set);

 private:
  using Key = std::pair<std::string, std::string>;  // (identity, session name)
  struct Usage {
    int64_t sessions = 0;
    uint64_t bytes = 0;
  };
  absl::Status CheckEnabled() const;
  // Removes the session from the map and the accounting; its block is freed when the last lease
  // (a call in flight) lets go.
  void EraseLocked(std::map<Key, std::shared_ptr<ResidualSession>>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (or takes away) one session of `bytes` to the identity's and the server's counts, and
  // the gauges. An open counts from before its allocation (opening_) until it fails or is closed.
  void CountLocked(const std::string& identity, bool add, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool FitsTotalLocked(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return bytes <= limits_.total_bytes && total_bytes_ <= limits_.total_bytes - bytes;
  }
  absl::Status TotalExhausted(const std::string& name, uint64_t bytes) const;

  const ResidualSessionLimits limits_;
  const std::vector<Backend*> backends_;
  const ResidualSessionMetrics metrics_;  // metrics/component_metrics.h
  Mutex mu_;
  std::map<Key, std::shared_ptr<ResidualSession>> sessions_ ABSL_GUARDED_BY(mu_);
  std::set<Key> opening_ ABSL_GUARDED_BY(mu_);  // names being opened: counted, not usable yet
  std::map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  int64_t total_sessions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Closes idle sessions (CloseIdle); declared last, so it stops before anything it uses goes.
  std::optional<PeriodicTask> reaper_;
};

}  // namespace fusedlayer::server::transport
