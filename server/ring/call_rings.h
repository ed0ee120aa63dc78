// Call rings (proto OpenCallRing, proto/fusedlayer/wire/call_ring.h): the per-op data plane of
// clients on this host. A ring is a memfd of fixed-size slots that the client and the server both
// map; its calls are compute calls like any other: the poller copies each descriptor out once,
// turns it into the MhcSeam/SwaNormQuant request it stands for (tensors as shared-memory
// references into the regions bound at open) and submits it to the compute engine
// (exec/compute_engine.h) with a RingCall as its transport, so admission, identity checks, batching
// across rings and RPCs, fallback accounting, metrics and shadow sampling are the RPC's own. The
// completion is written back into the slot by the thread that completes the call.
//
// Threads: one handover thread (accepts on the ring socket, hands a ring's memfd and doorbell
// eventfd to the client that presents the ring's one-time token) and --call_ring_pollers poller
// threads. Each ring is served by one poller, the one with the fewest rings when it was handed
// over: a poller spins over the slots of its rings for --call_ring_spin_us after its last call,
// then sleeps in epoll on their doorbells and their clients' connections (a connection that closes
// closes its ring). A ring's header says whether its poller sleeps, so the ring protocol does not
// change with the number of pollers; the calls of one ring are taken by one thread, those of
// different rings in parallel.
//
// Safety: the memfd is sealed against shrinking (a client cannot make the server's mapping fault);
// rings are bounded per identity and in all, slots per ring; a ring's calls act as the identity
// that opened it; a call still queued when its ring closes is dropped at its launch check.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/annotated_mutex.h"
#include "exec/compute_engine.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/component_metrics.h"
#include "metrics/metrics.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace fusedlayer::server::ring {

struct CallRingOptions {
  std::string socket_path;       // where rings are handed over (a unix stream socket)
  int max_rings = 64;            // open (and handed-over-pending) rings of all identities
  int max_per_identity = 16;     // ... of one identity
  uint32_t max_slots = 64;       // per ring
  int64_t spin_us = 100;         // the poller spins this long after the last call before it sleeps
  int pollers = 1;               // poller threads (>= 1); each ring is served by one of them
  int64_t handover_seconds = 10; // a token not presented within this is void
  // A device backend (null on a CPU server): each ring's memory is page-locked for it, so that the
  // GPU stream of a CUDA call stores its completion (ring/ring_call.cc, PrepareDeviceAnswer).
  Backend* device = nullptr;
};

class Ring;

class CallRingService {
 public:
  // Binds the socket and starts the threads. The engine and metrics outlive the service.
  static absl::StatusOr<std::unique_ptr<CallRingService>> Start(CallRingOptions options, ComputeEngine& engine,
                                                                Metrics& metrics);
  ~CallRingService();  // Stop()

  // A new ring for `identity` binding `request`'s weight sets and regions (the caller checked they
  // exist for the identity): its memory is made and the token is pending until presented on the
  // socket.
  absl::StatusOr<v1::OpenCallRingResponse> Open(const std::string& identity, const v1::OpenCallRingRequest& request);

  // Stops taking calls and handing over rings, closes every ring (queued calls of a closed ring
  // are dropped at their launch check) and waits until `deadline` for the ring calls in flight.
  void Stop(std::chrono::steady_clock::time_point deadline);

  const std::string& socket_path() const { return options_.socket_path; }
  int open_rings() const;

 private:
  CallRingService(CallRingOptions options, ComputeEngine& engine, Metrics& metrics);
  // A poller thread and the rings it serves.
  struct Poller {
    int wake_fd = -1;   // eventfd: its wake-up (a new ring, Stop)
    int epoll_fd = -1;  // its rings' doorbells and connections, wake_fd
    // Rings handed over to it, waiting to be taken in (guarded by the service's mu_).
    std::vector<std::shared_ptr<Ring>> incoming;
    int rings = 0;  // handed over to it and not closed (guarded by the service's mu_)
    // Its own list of open rings (its thread only).
    std::vector<std::shared_ptr<Ring>> active;
    std::thread thread;
  };

  void HandoverLoop();
  void PollLoop(Poller& poller);
  void Handover(int connection);
  // Looks at every slot of `ring` once; submits what is new. Returns whether it found a call.
  bool Scan(const std::shared_ptr<Ring>& ring);
  void CloseRing(Poller& poller, const std::shared_ptr<Ring>& ring);

  const CallRingOptions options_;
  ComputeEngine& engine_;
  Metrics& metrics_;
  CallRingMetrics ring_metrics_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;    // eventfd: the handover thread's wake-up at Stop
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_ring_id_{1};
  mutable Mutex mu_;
  // Rings opened and not yet presented, by token.
  std::map<std::string, std::shared_ptr<Ring>> pending_ ABSL_GUARDED_BY(mu_);
  // Rings per identity (pending and open), and in all.
  std::map<std::string, int> per_identity_ ABSL_GUARDED_BY(mu_);
  int rings_ ABSL_GUARDED_BY(mu_) = 0;
  // Ring calls submitted and not yet completed, all rings (shared with the calls, which may finish
  // after the service is gone).
  std::shared_ptr<std::atomic<int64_t>> in_flight_;
  std::thread handover_thread_;
  // Made in Start, before any thread runs; never resized.
  std::vector<std::unique_ptr<Poller>> pollers_;
};

}  // namespace fusedlayer::server::ring
