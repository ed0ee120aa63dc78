// fusedctl bench: N concurrent callers, each with one call in flight at a time, for a fixed duration.
//
// Closed loop (a caller sends its next request when the previous one returns), so the offered load
// adapts to the server; throughput at concurrency N and the latency distribution are the output. The
// request is generated once and reused: generation of a large random request costs far more than
// the call, and the server does not cache anything by content. Sharing one const request between
// threads is safe: serialisation is const, and protobuf 3.21 caches sizes in a relaxed atomic.
//
// --echo_floor then runs the same closed loop against a bare gRPC echo of the same byte counts
// (client/fusedctl/echo_floor.h) and prints it next to the real call: the transport floor of that row.
//
// The calls are spread over the client's connections (--connections, ClientOptions::connections;
// by default chosen from --concurrency), and the echo over as many: each row says how many.
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/fusedctl/bench_stats.h"
#include "client/lib/call_ring.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/echo_floor.h"
#include "client/lib/wire_request.h"
#include "client/lib/latency_stats.h"
#include "client/fusedctl/commands.h"
#include "client/lib/random_inputs.h"
#include "client/lib/shared_memory.h"

namespace fusedlayer::client {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxConcurrency = 1024;
constexpr absl::Duration kMaxDuration = absl::Hours(24);

// One call of the op; fills the outcome. The request types differ, the measurement does not.
struct Caller {
  virtual ~Caller() = default;
  virtual CallOutcome Call() const = 0;
  virtual uint64_t RequestBytes() const = 0;
};

// FusedLayerClient's compute calls, picked by the request: serialized by protobuf (const&), or
// a shared request whose tensor data is sent by reference.
absl::StatusOr<v1::MhcSeamResponse> Send(const FusedLayerClient& c, const v1::MhcSeamRequest& r) { return c.MhcSeam(r); }
absl::StatusOr<v1::SwaNormQuantResponse> Send(const FusedLayerClient& c, const v1::SwaNormQuantRequest& r) {
  return c.SwaNormQuant(r);
}
absl::StatusOr<v1::MhcSeamResponse> Send(const FusedLayerClient& c, std::shared_ptr<const v1::MhcSeamRequest> r) {
  return c.MhcSeam(std::move(r));
}
absl::StatusOr<v1::SwaNormQuantResponse> Send(const FusedLayerClient& c,
                                              std::shared_ptr<const v1::SwaNormQuantRequest> r) {
  return c.SwaNormQuant(std::move(r));
}

template <typename Request, typename Response>
class TypedCaller : public Caller {
 public:
  // Every call sends the one shared request, its tensor data by reference, as an embedder that
  // keeps its inputs does; with `copy` (--copy_requests) the generated stub's call, which
  // serializes (copies) them every time.
  TypedCaller(const FusedLayerClient& client, Request request, bool copy)
      : client_(client),
        request_(std::make_shared<const Request>(std::move(request))),
        copy_(copy),
        request_bytes_(copy ? request_->ByteSizeLong() : EncodeRequestByReference(request_).Length()) {}

  CallOutcome Call() const override {
    CallOutcome o;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<Response> r = copy_ ? Send(client_, *request_) : Send(client_, request_);
    o.round_trip_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r.ok()) {
      o.report = r->report();
      last_response_bytes_.store(r->ByteSizeLong(), std::memory_order_relaxed);
    } else {
      o.status = r.status();
    }
    return o;
  }
  // On the wire: a shared request's tensors go as patches after the message (a few bytes more).
  uint64_t RequestBytes() const override { return request_bytes_; }
  uint64_t ResponseBytes() const { return last_response_bytes_.load(std::memory_order_relaxed); }

 private:
  const FusedLayerClient& client_;
  const std::shared_ptr<const Request> request_;
  const bool copy_;
  const uint64_t request_bytes_;
  mutable std::atomic<uint64_t> last_response_bytes_{0};
};

// One thread's request of a PerThreadCaller, and what it refers to (its object or its session).
template <typename Request>
struct CallerSlot {
  std::shared_ptr<void> held;
  Request request;
};

// Callers that need state of their own per thread: --transport=shm (each thread's shared-memory
// object holds its request's inputs, written once as the TCP caller builds its request once, and
// its outputs: one object serves one call at a time) and --transport=session (each thread's
// residual session: calls of one session are serial). The messages carry references, or x alone.
template <typename Request, typename Response>
class PerThreadCaller : public Caller {
 public:
  using Slot = CallerSlot<Request>;
  PerThreadCaller(const FusedLayerClient& client, std::vector<Slot> slots) : client_(client), slots_(std::move(slots)) {}

  CallOutcome Call() const override {
    // One slot per thread for the caller's life (threads call back to back, never two at once).
    thread_local const Slot* mine = nullptr;
    thread_local const void* owner = nullptr;
    if (owner != this) {
      mine = &slots_[next_.fetch_add(1, std::memory_order_relaxed) % slots_.size()];
      owner = this;
    }
    CallOutcome o;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<Response> r = Send(client_, mine->request);
    o.round_trip_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r.ok()) {
      o.report = r->report();
      last_response_bytes_.store(r->ByteSizeLong(), std::memory_order_relaxed);
    } else {
      o.status = r.status();
    }
    return o;
  }
  uint64_t RequestBytes() const override { return slots_.front().request.ByteSizeLong(); }
  uint64_t ResponseBytes() const { return last_response_bytes_.load(std::memory_order_relaxed); }

 private:
  const FusedLayerClient& client_;
  const std::vector<Slot> slots_;
  mutable std::atomic<size_t> next_{0};
  mutable std::atomic<uint64_t> last_response_bytes_{0};
};

// Makes one registered region of `bytes` bytes: a shared-memory object (shm) or a device
// allocation exported over CUDA IPC (cuda_ipc).
using RegionMaker = std::function<absl::StatusOr<std::unique_ptr<ClientRegion>>(uint64_t bytes)>;

// The shm and cuda_ipc callers' slots: `count` regions, each registered and holding a copy of `request`.
template <typename Request, typename Prepare>
absl::StatusOr<std::vector<CallerSlot<Request>>> MakeSlots(const RegionMaker& make, const Request& request,
                                                           uint64_t bytes, int count, Prepare prepare) {
  std::vector<CallerSlot<Request>> slots;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::unique_ptr<ClientRegion>> region = make(bytes);
    if (!region.ok()) return region.status();
    Request r = request;
    if (absl::Status s = prepare(**region, r); !s.ok()) return s;
    slots.push_back({std::shared_ptr<ClientRegion>(std::move(*region)), std::move(r)});
  }
  return slots;
}

// --transport=ring|ring_cuda_ipc: the shm (cuda_ipc) callers' slots, each thread's call going
// through its own slot of one call ring that binds every slot's region; no RPC per call.
template <typename Request>
class RingCaller : public Caller {
 public:
  // A ring per client thread (a thread's slot and its region bound to its ring), as an
  // orchestration process with a thread per stream would hold them, up to kMaxRings (the server's
  // default rings per identity); past that, rings hold several slots (slot k: ring k % rings). The
  // server spreads rings over its pollers.
  static constexpr size_t kMaxRings = 16;
  static absl::StatusOr<std::unique_ptr<RingCaller>> Make(const FusedLayerClient& client,
                                                          const std::vector<CallerSlot<Request>>& slots, bool cuda) {
    std::unique_ptr<RingCaller> caller(new RingCaller());
    const size_t rings = std::min(slots.size(), kMaxRings);
    for (size_t ring_index = 0; ring_index < rings; ++ring_index) {
      std::vector<std::string> regions;
      for (size_t k = ring_index; k < slots.size(); k += rings) {
        regions.push_back(static_cast<const ClientRegion*>(slots[k].held.get())->region_name());
      }
      CallRing::Options o = CallRing::Options::ForRegions(slots.front().request.weight_set(), regions, cuda);
      absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(client, o);
      if (!ring.ok()) {
        return absl::Status(ring.status().code(), absl::StrCat("opening call ring ", ring_index + 1, " of ", rings,
                                                               ": ", ring.status().message()));
      }
      caller->rings_.push_back(std::move(*ring));
      caller->options_.push_back(std::move(o));
    }
    for (size_t k = 0; k < slots.size(); ++k) {
      const CallRing::Options& o = caller->options_[k % rings];
      // The slot's region is the only one its call references: bound as region k / rings.
      absl::StatusOr<wire::RingCallDescriptor> call = RingCallOf(slots[k].request, o.weight_sets, o.regions);
      if (!call.ok()) return call.status();
      caller->calls_.push_back(*call);
    }
    return caller;
  }

  CallOutcome Call() const override {
    // One ring per thread for the caller's life (threads call back to back, never two at once).
    thread_local uint32_t mine = 0;
    thread_local const void* owner = nullptr;
    if (owner != this) {
      mine = static_cast<uint32_t>(next_.fetch_add(1, std::memory_order_relaxed) % calls_.size());
      owner = this;
    }
    CallOutcome o;
    const Clock::time_point t0 = Clock::now();
    const RingCallResult r = rings_[mine % rings_.size()]->Call(mine / rings_.size(), calls_[mine]);
    o.round_trip_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    o.status = r.status;
    o.report = ReportOf(r);
    o.completed_by_device = r.completed_by_device;
    return o;
  }
  // Nothing crosses a socket: the descriptor is written into shared memory.
  uint64_t RequestBytes() const override { return sizeof(wire::RingCallDescriptor); }

 private:
  RingCaller() = default;
  std::vector<std::unique_ptr<CallRing>> rings_;
  std::vector<CallRing::Options> options_;       // rings_[i]'s bindings
  std::vector<wire::RingCallDescriptor> calls_;  // slot k's call, on ring k % rings, slot k / rings
  mutable std::atomic<size_t> next_{0};
};

// The session callers' slots: `count` residual sessions of `seam`'s shape, each started with a
// FIRST-stage call, and `seam` turned into a call of each: x only, the state stays on the server.
// A session is closed when its slot goes.
absl::StatusOr<std::vector<CallerSlot<v1::MhcSeamRequest>>> MakeSessionSlots(
    const FusedLayerClient& client, const v1::MhcSeamRequest& seam, const v1::MhcConfig& mhc, int count) {
  std::vector<CallerSlot<v1::MhcSeamRequest>> slots;
  const int64_t tokens = seam.x().shape(0);
  for (int i = 0; i < count; ++i) {
    const std::string name = absl::StrCat("fusedctl-bench-", ::getpid(), "-", i);
    if (absl::StatusOr<uint64_t> opened = client.OpenResidualSession(name, tokens, mhc.hc_mult(), mhc.hidden());
        !opened.ok()) {
      return opened.status();
    }
    std::shared_ptr<void> closer(nullptr, [&client, name](void*) { (void)client.CloseResidualSession(name); });
    v1::MhcSeamRequest first;
    first.set_weight_set(seam.weight_set());
    first.set_stage(v1::MHC_STAGE_FIRST);
    first.set_mode(seam.mode());
    *first.mutable_x() = seam.x();
    first.set_session(name);
    if (absl::StatusOr<v1::MhcSeamResponse> r = client.MhcSeam(first); !r.ok()) return r.status();
    v1::MhcSeamRequest call = seam;
    call.clear_residual();
    call.clear_post_mix();
    call.clear_comb_mix();
    call.clear_pre_mix();
    call.set_session(name);
    slots.push_back({std::move(closer), std::move(call)});
  }
  return slots;
}

// A row's callers. `caller` sends the measured calls; with a region or session transport,
// `tcp_caller` sends the same request with its tensors inline, for the comparison row after it.
struct RowCallers {
  std::unique_ptr<Caller> caller;
  std::function<uint64_t()> response_bytes;
  uint64_t inline_request_bytes = 0;  // shm, session: what the request weighs with its tensors inline
  std::unique_ptr<Caller> tcp_caller;
  std::function<uint64_t()> tcp_response_bytes;
  // What tcp_caller's row is called: the same request inline over TCP, or (ring transports) the
  // same request by RPC with its tensors in the same regions.
  std::string compare_label = "tcp (the same request, tensors inline)";
  std::string compare_short = "tcp";
};

// `request` over TCP without `slots`; else the slots' requests (one region or session per
// thread), with `request` inline over TCP beside them.
template <typename Request, typename Response>
RowCallers MakeRowCallers(const FusedLayerClient& client, Request request, bool copy_requests,
                          std::optional<std::vector<CallerSlot<Request>>> slots) {
  RowCallers row;
  if (slots.has_value()) row.inline_request_bytes = request.ByteSizeLong();
  auto tcp = std::make_unique<TypedCaller<Request, Response>>(client, std::move(request), copy_requests);
  TypedCaller<Request, Response>* const tcp_raw = tcp.get();
  if (!slots.has_value()) {
    row.response_bytes = [tcp_raw] { return tcp_raw->ResponseBytes(); };
    row.caller = std::move(tcp);
    return row;
  }
  using PerThread = PerThreadCaller<Request, Response>;
  auto per_thread = std::make_unique<PerThread>(client, std::move(*slots));
  PerThread* const raw = per_thread.get();
  row.response_bytes = [raw] { return raw->ResponseBytes(); };
  row.caller = std::move(per_thread);
  row.tcp_response_bytes = [tcp_raw] { return tcp_raw->ResponseBytes(); };
  row.tcp_caller = std::move(tcp);
  return row;
}

// The ring transports: the ring caller over `slots`, and the RPC over the same slots beside it.
template <typename Request, typename Response>
absl::StatusOr<RowCallers> MakeRingRowCallers(const FusedLayerClient& client, std::vector<CallerSlot<Request>> slots,
                                              bool cuda) {
  RowCallers row;
  absl::StatusOr<std::unique_ptr<RingCaller<Request>>> ring = RingCaller<Request>::Make(client, slots, cuda);
  if (!ring.ok()) return ring.status();
  row.caller = std::move(*ring);
  row.response_bytes = [] { return uint64_t{0}; };
  using PerThread = PerThreadCaller<Request, Response>;
  auto rpc = std::make_unique<PerThread>(client, std::move(slots));
  PerThread* const raw = rpc.get();
  row.inline_request_bytes = rpc->RequestBytes();
  row.tcp_response_bytes = [raw] { return raw->ResponseBytes(); };
  row.tcp_caller = std::move(rpc);
  row.compare_label = cuda ? "rpc over cuda_ipc (the same request and regions)"
                           : "rpc over shm (the same request and regions)";
  row.compare_short = cuda ? "rpc cuda_ipc" : "rpc shm";
  return row;
}

// `concurrency` threads, each calling `call` back to back until `duration` has passed.
struct ClosedLoopResult {
  BenchStats stats;
  double elapsed_seconds = 0;
};
ClosedLoopResult RunClosedLoop(int concurrency, absl::Duration duration, const std::function<CallOutcome()>& call) {
  std::vector<BenchStats> per_thread(static_cast<size_t>(concurrency));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(concurrency));
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = start + absl::ToChronoNanoseconds(duration);
  for (int i = 0; i < concurrency; ++i) {
    threads.emplace_back([&, i] {
      BenchStats& stats = per_thread[size_t(i)];
      // No call starts after `end`; a call in flight at `end` finishes (bounded by --deadline).
      while (Clock::now() < end) stats.Add(call());
    });
  }
  for (std::thread& t : threads) t.join();
  ClosedLoopResult r;
  r.elapsed_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (const BenchStats& s : per_thread) r.stats.Merge(s);
  return r;
}

// A scratch directory for the echo's unix socket, removed with everything in it at scope exit
// (gRPC unlinks the socket at server shutdown; the rmdir is for the directory itself).
class ScratchDir {
 public:
  ScratchDir() {
    char tmpl[] = "/tmp/fusedctl-echo-floor-XXXXXX";
    if (const char* d = ::mkdtemp(tmpl); d != nullptr) path_ = d;
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    ::unlink((path_ + "/echo-floor.sock").c_str());
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The echo floor at the call's concurrency and duration; prints its block of output. An error when
// the echo cannot start or any echo call failed (their codes are in the output).
absl::Status RunEchoFloor(const FusedLayerClient& client, const CommandLine& cl, uint64_t request_bytes,
                          uint64_t response_bytes, const ClosedLoopResult& call, std::ostream& out) {
  ScratchDir scratch;
  const std::string listen = EchoListenAddressFor(cl.target, scratch.path());
  if (absl::StartsWith(listen, "unix:") && scratch.path().empty()) {
    return absl::InternalError("echo floor: cannot create a scratch directory under /tmp for its socket");
  }
  ClientOptions options = client.options();
  // As many connections as the real call had, whatever the echo's address would default to.
  options.connections = client.connections();
  absl::StatusOr<std::unique_ptr<EchoFloorServer>> echo =
      EchoFloorServer::Start(listen, response_bytes, options.max_message_bytes);
  if (!echo.ok()) return echo.status();
  // The same channel construction as the real one: same message limits, deadline, token header and
  // number of connections.
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> echo_channel = FusedLayerClient::Connect((*echo)->target(), options);
  if (!echo_channel.ok()) return echo_channel.status();
  const EchoFloorClient echo_client((*echo_channel)->channels(), request_bytes, options);

  std::atomic<uint64_t> response_min{UINT64_MAX}, response_max{0};
  auto echo_call = [&]() {
    CallOutcome o;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<uint64_t> got = echo_client.Call();
    o.round_trip_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!got.ok()) {
      o.status = got.status();
      return o;
    }
    for (uint64_t lo = response_min.load(); *got < lo && !response_min.compare_exchange_weak(lo, *got);) {
    }
    for (uint64_t hi = response_max.load(); *got > hi && !response_max.compare_exchange_weak(hi, *got);) {
    }
    return o;
  };
  // A probe first, as for the real call (and it opens the connection).
  if (CallOutcome probe = echo_call(); !probe.status.ok()) {
    return absl::Status(probe.status.code(), absl::StrCat("echo floor probe failed: ", probe.status.message()));
  }
  const ClosedLoopResult floor = RunClosedLoop(cl.concurrency, cl.duration, echo_call);

  BenchStats::EchoFloorInfo info;
  info.transport = absl::StartsWith(listen, "unix:")            ? "a unix socket (plaintext)"
                   : absl::StartsWith(listen, "unix-abstract:") ? "an abstract unix socket (plaintext)"
                                                                : "127.0.0.1 (plaintext)";
  info.call_request_bytes = request_bytes;
  info.call_response_bytes = response_bytes;
  info.echo_request_bytes_min = (*echo)->min_request_bytes();
  info.echo_request_bytes_max = (*echo)->max_request_bytes();
  info.echo_response_bytes_min = response_min.load();
  info.echo_response_bytes_max = response_max.load();
  info.call_elapsed_seconds = call.elapsed_seconds;
  info.echo_elapsed_seconds = floor.elapsed_seconds;
  info.connections = echo_client.connections();
  out << BenchStats::FormatEchoFloor(call.stats, floor.stats, info);
  if (floor.stats.failed() > 0) {
    return absl::Status(floor.stats.MostFrequentError(),
                        absl::StrCat(floor.stats.failed(), " of ", floor.stats.failed() + floor.stats.ok(),
                                     " echo-floor calls failed (codes in the echo error lines above)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunBench(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  if (cl.op.empty()) return absl::InvalidArgumentError("bench needs --op=mhc|swa");
  absl::StatusOr<BenchOp> op = ParseBenchOp(cl.op);
  if (!op.ok()) return op.status();
  if (cl.weight_set.empty()) return absl::InvalidArgumentError("bench needs --weight_set=NAME");
  if (!cl.tokens_set) return absl::InvalidArgumentError("bench needs --tokens=T");
  if (cl.concurrency < 1 || cl.concurrency > kMaxConcurrency) {
    return absl::InvalidArgumentError(absl::StrCat("--concurrency=", cl.concurrency, " is outside 1..", kMaxConcurrency));
  }
  if (cl.duration <= absl::ZeroDuration() || cl.duration > kMaxDuration) {
    return absl::InvalidArgumentError(
        absl::StrCat("--duration=", absl::FormatDuration(cl.duration), " is outside (0, 24h]"));
  }
  absl::StatusOr<v1::PathPreference> path = ParsePathPreference(cl.path.empty() ? "auto" : cl.path);
  if (!path.ok()) return path.status();
  if (cl.echo_floor && client.options().credentials != nullptr) {
    // The echo server has no certificate the channel's CA would accept, and a plaintext floor under
    // a TLS call would flatter the ratio.
    return absl::InvalidArgumentError(
        "--echo_floor measures plaintext channels only (unix sockets, loopback, tokens included); drop the --tls_* "
        "flags for the floor run");
  }

  absl::StatusOr<v1::WeightSetInfo> ws = client.FindWeightSet(cl.weight_set);
  if (!ws.ok()) return ws.status();
  const uint64_t seed = cl.seed ? cl.seed : FreshSeed();
  std::mt19937_64 rng(seed);

  const bool session_transport = cl.transport == "session";
  // ring, ring_cuda_ipc: the shm / cuda_ipc regions, each call through a call ring instead of an RPC.
  const bool ring_transport = IsRingTransport(cl.transport);
  const bool cuda_transport = cl.transport == "cuda_ipc" || cl.transport == "ring_cuda_ipc";
  // shm and cuda_ipc: every tensor in a region of the caller's (the same code, another memory).
  absl::StatusOr<bool> region_parsed =
      session_transport || ring_transport ? false : ParseRegionTransport(cl.transport);
  if (!region_parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport=", cl.transport, ": want tcp, shm, cuda_ipc, session, ring or ring_cuda_ipc"));
  }
  if (cuda_transport && !cl.cuda_regions) {
    return absl::FailedPreconditionError(
        absl::StrCat("--transport=", cl.transport, " needs a fusedctl built with a GPU backend"));
  }
  if (ring_transport && cl.concurrency + 1 > 256) {
    return absl::InvalidArgumentError("--transport=ring binds one region per caller: --concurrency at most 255");
  }
  const bool region_transport = *region_parsed || ring_transport;
  const std::string transport_name = cl.transport.empty() ? "tcp" : cl.transport;
  const RegionMaker make_region = [&](uint64_t bytes) { return MakeRegion(client, cl, bytes); };
  if (session_transport && *op != BenchOp::kMhc) {
    return absl::InvalidArgumentError("--transport=session applies to --op=mhc only (SWA has no state between calls)");
  }
  RowCallers row;
  std::string what;
  if (*op == BenchOp::kMhc) {
    if (!ws->has_mhc()) return absl::InvalidArgumentError(absl::StrCat("weight set \"", cl.weight_set, "\" has no mHC part"));
    if (cl.row_stride != 0) return absl::InvalidArgumentError("--row_stride applies to --op=swa only");
    absl::StatusOr<v1::MhcMode> mode = ParseMhcMode(cl.mode.empty() ? "shifted" : cl.mode);
    if (!mode.ok()) return mode.status();
    absl::StatusOr<v1::MhcStage> stage = ParseMhcStage(cl.stage.empty() ? "seam" : cl.stage);
    if (!stage.ok()) return stage.status();
    MhcRequestSpec spec{.weight_set = cl.weight_set, .stage = *stage, .mode = *mode, .tokens = cl.tokens,
                        .include_pre_mix = !cl.no_pre_mix, .capture_aux = cl.capture_aux, .path = *path};
    absl::StatusOr<v1::MhcSeamRequest> req = RandomMhcRequest(ws->mhc(), spec, rng);
    if (!req.ok()) return req.status();
    std::optional<std::vector<CallerSlot<v1::MhcSeamRequest>>> slots;
    if (region_transport || session_transport) {
      if (session_transport && *stage != v1::MHC_STAGE_SEAM) {
        return absl::InvalidArgumentError("--transport=session measures SEAM calls (--stage=seam)");
      }
      const v1::MhcConfig mhc = ws->mhc();
      auto made = session_transport
                      ? MakeSessionSlots(client, *req, mhc, cl.concurrency + 1)
                      : MakeSlots(make_region, *req, MhcRequestSharedBytes(*req, mhc), cl.concurrency + 1,
                                  [&](ClientRegion& m, v1::MhcSeamRequest& r) { return m.Prepare(r, mhc); });
      if (!made.ok()) return made.status();
      slots = *std::move(made);
    }
    if (ring_transport) {
      absl::StatusOr<RowCallers> ring_row =
          MakeRingRowCallers<v1::MhcSeamRequest, v1::MhcSeamResponse>(client, *std::move(slots), cuda_transport);
      if (!ring_row.ok()) return ring_row.status();
      row = *std::move(ring_row);
    } else {
      row = MakeRowCallers<v1::MhcSeamRequest, v1::MhcSeamResponse>(client, *std::move(req), cl.copy_requests,
                                                                     std::move(slots));
    }
    what = absl::StrCat("stage=", MhcStageName(*stage), " mode=", MhcModeName(*mode));
  } else {
    if (!ws->has_swa()) return absl::InvalidArgumentError(absl::StrCat("weight set \"", cl.weight_set, "\" has no SWA part"));
    if (!cl.mode.empty() || !cl.stage.empty() || cl.no_pre_mix || cl.capture_aux) {
      return absl::InvalidArgumentError("--mode/--stage/--no_pre_mix/--capture_aux apply to --op=mhc only");
    }
    SwaRequestSpec spec{.weight_set = cl.weight_set, .tokens = cl.tokens, .row_stride = cl.row_stride, .path = *path};
    absl::StatusOr<v1::SwaNormQuantRequest> req = RandomSwaRequest(ws->swa(), spec, rng);
    if (!req.ok()) return req.status();
    std::optional<std::vector<CallerSlot<v1::SwaNormQuantRequest>>> slots;
    if (region_transport) {
      const v1::SwaConfig swa = ws->swa();
      const int64_t rows = ws->wq_b_rows();
      auto made =
          MakeSlots(make_region, *req, SwaRequestSharedBytes(*req, swa, rows), cl.concurrency + 1,
                    [&](ClientRegion& m, v1::SwaNormQuantRequest& r) { return m.Prepare(r, swa, rows); });
      if (!made.ok()) return made.status();
      slots = *std::move(made);
    }
    if (ring_transport) {
      absl::StatusOr<RowCallers> ring_row = MakeRingRowCallers<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>(
          client, *std::move(slots), cuda_transport);
      if (!ring_row.ok()) return ring_row.status();
      row = *std::move(ring_row);
    } else {
      row = MakeRowCallers<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse>(client, *std::move(req),
                                                                               cl.copy_requests, std::move(slots));
    }
    what = absl::StrCat("row_stride=", cl.row_stride ? cl.row_stride : ws->swa().q_rank() + ws->swa().head_dim());
  }

  out << "bench op=" << cl.op << " weight_set=" << cl.weight_set << " tokens=" << cl.tokens << " " << what
      << " path=" << PathPreferenceName(*path) << " concurrency=" << cl.concurrency
      << " connections=" << client.connections() << " duration=" << absl::FormatDuration(cl.duration) << " seed=" << seed
      << " transport=" << transport_name
      << " requests=" << (cl.copy_requests ? "serialized" : "shared") << "\n";
  out << "request " << FormatBytes(double(row.caller->RequestBytes()));
  if (ring_transport) {
    out << " (a call descriptor in a slot of one call ring; tensors in " << cl.concurrency + 1
        << (cuda_transport ? " CUDA shared-memory allocations; " : " shared-memory objects; ")
        << FormatBytes(double(row.inline_request_bytes)) << " by RPC with references)";
  } else if (region_transport) {
    out << " (tensors in " << cl.concurrency + 1 << (cuda_transport ? " CUDA shared-memory allocations; " : " shared-memory objects; ")
        << FormatBytes(double(row.inline_request_bytes)) << " inline)";
  }
  if (session_transport) {
    out << " (x only: residual and mixes in " << cl.concurrency + 1 << " residual sessions; "
        << FormatBytes(double(row.inline_request_bytes)) << " inline)";
  }
  out << "\n";

  // A probe call first: a wrong weight set or an unreachable server fails here with its real
  // error instead of as N x thousands of identical errors. It also warms the connection.
  {
    CallOutcome probe = row.caller->Call();
    if (!probe.status.ok()) {
      return absl::Status(probe.status.code(), absl::StrCat("probe call failed: ", probe.status.message()));
    }
    out << "probe   " << FormatSeconds(probe.round_trip_seconds) << " round trip, path " << PathName(probe.report.path())
        << ", response " << FormatBytes(double(row.response_bytes())) << "\n";
    out.flush();
  }

  const ClosedLoopResult measured = RunClosedLoop(cl.concurrency, cl.duration, [&] { return row.caller->Call(); });
  const BenchStats& total = measured.stats;
  BenchStats::RunInfo info{.op = cl.op,
                           .tokens_per_request = cl.tokens,
                           .request_bytes = row.caller->RequestBytes(),
                           .response_bytes = row.response_bytes(),
                           .elapsed_seconds = measured.elapsed_seconds,
                           .connections = client.connections()};
  out << total.Format(info);
  out.flush();
  uint64_t floor_request_bytes = info.request_bytes, floor_response_bytes = info.response_bytes;
  bool inline_refused = false;  // the TCP row's request cannot go inline (e.g. over a message limit)
  if (row.tcp_caller != nullptr) {
    // The TCP row of the same request, same concurrency and duration: what shm or the session is
    // measured against. A call that only fits by reference (its tensors over a message limit) has
    // no TCP row: the refusal is printed, and the row above stands on its own.
    if (CallOutcome probe = row.tcp_caller->Call(); !probe.status.ok()) {
      if (probe.status.code() != absl::StatusCode::kResourceExhausted) {
        return absl::Status(probe.status.code(), absl::StrCat("tcp probe call failed: ", probe.status.message()));
      }
      out << row.compare_label << ": refused, " << absl::StatusCodeToString(probe.status.code())
          << ": " << probe.status.message() << "\n";
      inline_refused = true;
    }
  }
  if (row.tcp_caller != nullptr && !inline_refused) {
    const ClosedLoopResult tcp = RunClosedLoop(cl.concurrency, cl.duration, [&] { return row.tcp_caller->Call(); });
    BenchStats::RunInfo tcp_info{.op = cl.op,
                                 .tokens_per_request = cl.tokens,
                                 .request_bytes = row.tcp_caller->RequestBytes(),
                                 .response_bytes = row.tcp_response_bytes(),
                                 .elapsed_seconds = tcp.elapsed_seconds,
                                 .connections = client.connections()};
    out << row.compare_label << "\n" << tcp.stats.Format(tcp_info);
    if (tcp.stats.ok() > 0 && total.ok() > 0) {
      out << absl::StrFormat("%s vs %s  p50 %.3fx, req/s %.2fx, bytes per call %.3fx\n",
                             transport_name.c_str(), row.compare_short.c_str(),
                             SummarizeLatencies(total.latencies()).p50 / SummarizeLatencies(tcp.stats.latencies()).p50,
                             (double(total.ok()) / measured.elapsed_seconds) / (double(tcp.stats.ok()) / tcp.elapsed_seconds),
                             double(info.request_bytes + info.response_bytes) /
                                 double(tcp_info.request_bytes + tcp_info.response_bytes));
    }
    out.flush();
    // shm, cuda_ipc: the floor is that of the bytes the tensors would have cost over the socket. A
    // session call's bytes do cross the socket: its floor is its own. A ring call's: the floor of
    // the RPC it replaces (its own bytes, references only, over the socket), below which no RPC goes.
    if (ring_transport) {
      floor_request_bytes = tcp_info.request_bytes;
      floor_response_bytes = tcp_info.response_bytes;
    } else if (region_transport) {
      floor_request_bytes = tcp_info.request_bytes;
      floor_response_bytes = tcp_info.response_bytes;
    }
  }
  if (cl.echo_floor && ring_transport) {
    out << "echo of the RPC's own bytes (the floor of any RPC of this call)\n";
    if (absl::Status s = RunEchoFloor(client, cl, floor_request_bytes, floor_response_bytes, measured, out); !s.ok()) {
      return s;
    }
  } else if (cl.echo_floor) {
    if (region_transport) {
      // First the floor of the bytes this call itself sends (names, shapes and the report: what no
      // way of moving the tensors goes below), then that of the bytes the tensors cost inline.
      out << "echo of this call's own bytes\n";
      if (absl::Status s = RunEchoFloor(client, cl, info.request_bytes, info.response_bytes, measured, out); !s.ok()) {
        return s;
      }
      if (!inline_refused) out << "echo of the bytes inline\n";
    }
    if (!(region_transport && inline_refused)) {
      if (absl::Status s = RunEchoFloor(client, cl, floor_request_bytes, floor_response_bytes, measured, out); !s.ok()) {
        return s;
      }
    }
  }
  if (total.failed() > 0) {
    return absl::Status(total.MostFrequentError(),
                        absl::StrCat(total.failed(), " of ", total.failed() + total.ok(),
                                     " requests failed (most frequent code shown; all codes in the error lines above)"));
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
