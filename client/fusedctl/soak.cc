// fusedctl soak: N concurrent clients for a bounded duration, mixing valid requests (both ops, every
// weight set, random T) with invalid ones whose status code is known in advance. The question it
// answers is "does the server stay correct and bounded under sustained mixed load": any status that
// is not the expected one for its kind (including RESOURCE_EXHAUSTED or INTERNAL on a valid call) is
// an unexpected error, and the server's resident memory (VmRSS of --server_pid, read from /proc on
// the same host) must not grow by more than --max_rss_growth_mb between the end of the warm-up and
// the end of the soak. Exit status 1 on either.
//
// Beyond compute, the mix can include the server's other two fronts: with --churn one more client
// loads a weight set (soak/churn) and unloads it again and again, both expected OK, so uploads,
// builds, warm-ups and frees interleave with the compute calls; when the main client has a bearer
// token, calls with an unknown token and with none (UNAUTHENTICATED) join the pool, and with
// --compute_token_file the compute-only token's compute calls (OK) and its UnloadWeightSet of a
// loaded set (PERMISSION_DENIED; were it allowed, later calls on that set would fail too).
//
// Requests come from a pool built before the clock starts (generating megabytes of random bf16 per
// call would make the client, not the server, the bottleneck); the server caches nothing by content,
// so reusing a request costs it the same as a fresh one.
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "client/lib/transport_credentials.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/commands.h"
#include "client/lib/latency_stats.h"
#include "client/lib/random_inputs.h"

namespace fusedlayer::client {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxClients = 1024;
// Valid requests draw T from these (clipped to the server's --max_tokens): 1, odd sizes that are
// not multiples of any tile, and a few powers of two.
constexpr int64_t kTokenChoices[] = {1, 2, 3, 7, 16, 33, 64};
// A deadline no server meets: the call must end DEADLINE_EXCEEDED (the server sees a cancelled call).
// Sent with the largest valid mHC request of the pool: with a small one (T = 1, ~72 KiB) a fast
// GPU server answered 114 such probes OK before the client's deadline timer fired (H200, a churn
// run); a request of MiBs cannot even be sent in 1 us.
constexpr absl::Duration kExpiredDeadline = absl::Microseconds(1);

// One pool entry: how to send it and which status it must come back with.
struct Case {
  std::string kind;  // "valid_mhc", "wrong_byte_length", ...
  absl::StatusCode expected = absl::StatusCode::kOk;
  std::function<absl::Status(const FusedLayerClient&)> call;
};

Case MhcCase(std::string kind, absl::StatusCode expected, v1::MhcSeamRequest req, CallOptions options = {}) {
  auto shared = std::make_shared<const v1::MhcSeamRequest>(std::move(req));
  return Case{std::move(kind), expected, [shared, options](const FusedLayerClient& c) {
                return c.MhcSeam(*shared, options).status();
              }};
}

Case SwaCase(std::string kind, absl::StatusCode expected, v1::SwaNormQuantRequest req, CallOptions options = {}) {
  auto shared = std::make_shared<const v1::SwaNormQuantRequest>(std::move(req));
  return Case{std::move(kind), expected, [shared, options](const FusedLayerClient& c) {
                return c.SwaNormQuant(*shared, options).status();
              }};
}

// 64 hex characters from the seeded generator: a token the server does not know.
std::string UnknownToken(std::mt19937_64& rng) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < 64; ++i) t.push_back(kHex[rng() % 16]);
  return t;
}

// A client like `client` (same target, transport and limits) with another bearer token ("" = none).
absl::StatusOr<std::shared_ptr<const FusedLayerClient>> WithToken(const FusedLayerClient& client,
                                                                  const std::string& target,
                                                                  const std::string& token) {
  ClientOptions o = client.options();
  o.bearer_token = token;
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(target, std::move(o));
  if (!c.ok()) return c.status();
  return std::shared_ptr<const FusedLayerClient>(*std::move(c));
}

// The authorization cases: calls whose code is decided by their credentials, not their content.
absl::Status AddAuthCases(const FusedLayerClient& client, const CommandLine& cl, const v1::MhcSeamRequest& seam,
                          const std::string& loaded_set, std::mt19937_64& rng, std::vector<Case>& pool,
                          std::ostream& out) {
  auto with = [&](std::shared_ptr<const FusedLayerClient> other, std::string kind, absl::StatusCode expected,
                  std::function<absl::Status(const FusedLayerClient&)> call) {
    pool.push_back(Case{std::move(kind), expected,
                        [other, call](const FusedLayerClient&) { return call(*other); }});
  };
  auto seam_call = [shared = std::make_shared<const v1::MhcSeamRequest>(seam)](const FusedLayerClient& c) {
    return c.MhcSeam(*shared).status();
  };
  if (!client.options().bearer_token.empty()) {
    absl::StatusOr<std::shared_ptr<const FusedLayerClient>> unknown = WithToken(client, cl.target, UnknownToken(rng));
    if (!unknown.ok()) return unknown.status();
    absl::StatusOr<std::shared_ptr<const FusedLayerClient>> none = WithToken(client, cl.target, "");
    if (!none.ok()) return none.status();
    with(*unknown, "unknown_token", absl::StatusCode::kUnauthenticated, seam_call);
    with(*none, "no_token", absl::StatusCode::kUnauthenticated, seam_call);
  }
  if (!cl.compute_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadBearerTokenFile(cl.compute_token_file);
    if (!token.ok()) return token.status();
    absl::StatusOr<std::shared_ptr<const FusedLayerClient>> compute = WithToken(client, cl.target, *token);
    if (!compute.ok()) return compute.status();
    with(*compute, "compute_token_mhc", absl::StatusCode::kOk, seam_call);
    with(*compute, "compute_token_unload", absl::StatusCode::kPermissionDenied,
         [loaded_set](const FusedLayerClient& c) { return c.UnloadWeightSet(loaded_set).status(); });
  }
  size_t n = 0;
  for (const Case& c : pool) n += c.kind.find("token") != std::string::npos;
  if (n > 0) out << "auth: " << n << " authorization kinds in the pool\n";
  return absl::OkStatus();
}

// Valid requests for every set and op at several T, one request of each invalid kind, and the
// authorization kinds.
absl::StatusOr<std::vector<Case>> BuildPool(const FusedLayerClient& client, const CommandLine& cl,
                                           std::mt19937_64& rng, std::ostream& out) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  absl::StatusOr<v1::ListWeightSetsResponse> list = client.ListWeightSets();
  if (!list.ok()) return list.status();
  if (list->weight_sets_size() == 0) return absl::FailedPreconditionError("the server has no weight sets to soak");

  std::vector<Case> pool;
  std::optional<v1::MhcSeamRequest> some_mhc;
  std::optional<v1::MhcSeamRequest> largest_mhc;  // the most bytes: the expired_deadline probe
  std::optional<std::pair<v1::SwaConfig, std::string>> some_swa;
  for (const v1::WeightSetInfo& ws : list->weight_sets()) {
    for (int64_t t : kTokenChoices) {
      if (t > info->max_tokens()) continue;
      if (ws.has_mhc()) {
        MhcRequestSpec spec{.weight_set = ws.name(), .tokens = t};
        absl::StatusOr<v1::MhcSeamRequest> r = RandomMhcRequest(ws.mhc(), spec, rng);
        if (!r.ok()) return r.status();
        if (!some_mhc) some_mhc = *r;
        if (!largest_mhc || r->ByteSizeLong() > largest_mhc->ByteSizeLong()) largest_mhc = *r;
        pool.push_back(MhcCase("valid_mhc", absl::StatusCode::kOk, *std::move(r)));
      }
      if (ws.has_swa()) {
        SwaRequestSpec spec{.weight_set = ws.name(), .tokens = t};
        absl::StatusOr<v1::SwaNormQuantRequest> r = RandomSwaRequest(ws.swa(), spec, rng);
        if (!r.ok()) return r.status();
        if (!some_swa) some_swa = std::make_pair(ws.swa(), ws.name());
        pool.push_back(SwaCase("valid_swa", absl::StatusCode::kOk, *std::move(r)));
      }
    }
  }
  const size_t valid = pool.size();

  if (some_mhc) {
    v1::MhcSeamRequest r = *some_mhc;  // x bytes one element short of its shape
    r.mutable_x()->mutable_data()->resize(r.x().data().size() - 2);
    pool.push_back(MhcCase("wrong_byte_length", absl::StatusCode::kInvalidArgument, r));

    r = *some_mhc;  // x as fp32 with a byte length that matches fp32: the dtype alone is wrong
    r.mutable_x()->set_dtype(v1::DATA_TYPE_FP32);
    r.mutable_x()->mutable_data()->resize(r.x().data().size() * 2, '\x3f');
    pool.push_back(MhcCase("bad_dtype", absl::StatusCode::kInvalidArgument, r));

    r = *some_mhc;
    r.set_weight_set("soak/no-such-weight-set");
    pool.push_back(MhcCase("unknown_weight_set", absl::StatusCode::kNotFound, r));

    pool.push_back(MhcCase("expired_deadline", absl::StatusCode::kDeadlineExceeded, *largest_mhc,
                           CallOptions{.deadline = kExpiredDeadline}));
  }
  if (some_swa) {
    // T one above --max_tokens, every byte length consistent: only the limit is violated. Built
    // only when the limit is small enough to send (soak.sh starts the server with a low limit).
    const int64_t over = info->max_tokens() + 1;
    if (over <= 4096) {
      SwaRequestSpec spec{.weight_set = some_swa->second, .tokens = over};
      absl::StatusOr<v1::SwaNormQuantRequest> r = RandomSwaRequest(some_swa->first, spec, rng);
      if (!r.ok()) return r.status();
      pool.push_back(SwaCase("tokens_over_limit", absl::StatusCode::kInvalidArgument, *std::move(r)));
    } else {
      out << "note: --max_tokens=" << info->max_tokens() << " is too large to send T above it; "
          << "tokens_over_limit not exercised\n";
    }
  }
  out << "pool: " << valid << " valid requests over " << list->weight_sets_size() << " weight sets, "
      << pool.size() - valid << " invalid kinds (server max_tokens " << info->max_tokens() << ")\n";
  if (some_mhc) {
    if (absl::Status s = AddAuthCases(client, cl, *some_mhc, some_mhc->weight_set(), rng, pool, out); !s.ok()) {
      return s;
    }
  } else if (!cl.compute_token_file.empty() || !client.options().bearer_token.empty()) {
    out << "note: no mHC weight set: authorization kinds not exercised\n";
  }
  return pool;
}

// VmRSS of `pid` in bytes, from /proc (same host only).
absl::StatusOr<int64_t> ReadRssBytes(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read /proc/", pid, "/status (--server_pid)"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    int64_t kb = 0;
    std::string digits;
    for (char c : line) if (c >= '0' && c <= '9') digits += c;
    if (!absl::SimpleAtoi(digits, &kb)) break;
    return kb * 1024;
  }
  return absl::InternalError(absl::StrCat("no VmRSS line in /proc/", pid, "/status"));
}

// Per-thread tallies, merged at the end.
struct Tally {
  std::map<std::string, int64_t> calls;                    // kind -> calls
  std::map<std::string, std::map<std::string, int64_t>> unexpected;  // kind -> code -> count
  std::map<std::string, std::string> first_unexpected;     // kind -> first message
  std::vector<double> valid_latencies;

  void Merge(const Tally& o) {
    for (const auto& [k, n] : o.calls) calls[k] += n;
    for (const auto& [k, m] : o.unexpected) for (const auto& [c, n] : m) unexpected[k][c] += n;
    for (const auto& [k, msg] : o.first_unexpected) first_unexpected.emplace(k, msg);
    valid_latencies.insert(valid_latencies.end(), o.valid_latencies.begin(), o.valid_latencies.end());
  }
  int64_t total_unexpected() const {
    int64_t n = 0;
    for (const auto& [k, m] : unexpected) for (const auto& [c, v] : m) n += v;
    return n;
  }
};

// The churn client's loop: load `set` (OK), unload it (OK), until `end`. A load that fails leaves
// nothing to unload; an unload that fails may leave the set loaded, so the next load is refused
// ALREADY_EXISTS: each counts as unexpected, and the loop unloads first the next time round.
void Churn(const FusedLayerClient& client, const ChurnSet& set, Clock::time_point end, Tally& t) {
  bool loaded = false;
  while (Clock::now() < end) {
    if (!loaded) {
      const absl::Status s = client.LoadWeights(set.header, set.payload).status();
      ++t.calls["churn_load"];
      if (!s.ok()) {
        ++t.unexpected["churn_load"][absl::StatusCodeToString(s.code())];
        t.first_unexpected.emplace("churn_load", std::string(s.message()));
      }
      loaded = s.ok() || absl::IsAlreadyExists(s);
      continue;
    }
    const absl::Status s = client.UnloadWeightSet(set.header.name()).status();
    ++t.calls["churn_unload"];
    if (!s.ok()) {
      ++t.unexpected["churn_unload"][absl::StatusCodeToString(s.code())];
      t.first_unexpected.emplace("churn_unload", std::string(s.message()));
    }
    loaded = false;
  }
  // Leave the server as it was: nothing of the churn stays loaded.
  if (loaded) (void)client.UnloadWeightSet(set.header.name());
}

// Runs `clients` closed-loop callers over random pool entries until `duration` has passed, plus
// the churn client when `churn` is given.
Tally Drive(const FusedLayerClient& client, const std::vector<Case>& pool, int clients, absl::Duration duration,
            uint64_t seed, double* elapsed, const ChurnSet* churn) {
  std::vector<Tally> per(size_t(clients) + 1, Tally{});
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = start + absl::ToChronoNanoseconds(duration);
  if (churn != nullptr) threads.emplace_back([&] { Churn(client, *churn, end, per[size_t(clients)]); });
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(seed + uint64_t(i) * 0x9E3779B97F4A7C15ull);
      std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
      Tally& t = per[size_t(i)];
      while (Clock::now() < end) {
        const Case& c = pool[pick(rng)];
        const Clock::time_point t0 = Clock::now();
        const absl::Status s = c.call(client);
        const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        ++t.calls[c.kind];
        if (s.code() != c.expected) {
          ++t.unexpected[c.kind][absl::StatusCodeToString(s.code())];
          t.first_unexpected.emplace(c.kind, std::string(s.message()));
        } else if (c.expected == absl::StatusCode::kOk) {
          t.valid_latencies.push_back(seconds);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  *elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  Tally total;
  for (const Tally& t : per) total.Merge(t);
  return total;
}

}  // namespace

absl::Status RunSoak(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out, const ChurnSet* churn) {
  if (cl.concurrency < 1 || cl.concurrency > kMaxClients) {
    return absl::InvalidArgumentError(absl::StrCat("--concurrency=", cl.concurrency, " is outside 1..", kMaxClients));
  }
  if (cl.duration <= absl::ZeroDuration() || cl.duration > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat("--duration=", absl::FormatDuration(cl.duration), " is outside (0, 24h]"));
  }
  if (cl.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (cl.max_rss_growth_mb < 0) return absl::InvalidArgumentError("--max_rss_growth_mb must be >= 0");
  const uint64_t seed = cl.seed ? cl.seed : FreshSeed();
  std::mt19937_64 rng(seed);
  absl::StatusOr<std::vector<Case>> pool = BuildPool(client, cl, rng, out);
  if (!pool.ok()) return pool.status();
  out << "soak clients=" << cl.concurrency << " duration=" << absl::FormatDuration(cl.duration)
      << " warmup=" << absl::FormatDuration(cl.warmup) << " seed=" << seed
      << (churn != nullptr ? absl::StrCat(" churn=", churn->header.name(), " (", churn->payload.size(), " bytes)") : "")
      << "\n";
  out.flush();

  // Warm-up at full concurrency, so allocator arenas, gRPC thread pools and caches reach their
  // steady size before the baseline RSS is taken. Its errors count too.
  Tally total;
  if (cl.warmup > absl::ZeroDuration()) {
    double warm_elapsed = 0;
    total.Merge(Drive(client, *pool, cl.concurrency, cl.warmup, seed ^ 0x5eed, &warm_elapsed, churn));
  }
  std::optional<int64_t> rss_before;
  if (cl.server_pid > 0) {
    absl::StatusOr<int64_t> r = ReadRssBytes(cl.server_pid);
    if (!r.ok()) return r.status();
    rss_before = *r;
  }
  double elapsed = 0;
  Tally soak = Drive(client, *pool, cl.concurrency, cl.duration, seed, &elapsed, churn);
  std::optional<int64_t> rss_after;
  if (cl.server_pid > 0) {
    absl::StatusOr<int64_t> r = ReadRssBytes(cl.server_pid);
    if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat("after the soak: ", r.status().message()));
    rss_after = *r;
  }

  int64_t calls = 0;
  for (const auto& [k, n] : soak.calls) calls += n;
  const LatencySummary lat = SummarizeLatencies(soak.valid_latencies);
  out << absl::StrFormat("calls %d in %.1f s: %.1f calls/s, %.1f valid calls/s\n", calls, elapsed,
                         double(calls) / elapsed, double(lat.count) / elapsed);
  out << "valid latency p50 " << FormatSeconds(lat.p50) << "  p99 " << FormatSeconds(lat.p99) << "  max "
      << FormatSeconds(lat.max) << "\n";
  total.Merge(soak);
  for (const auto& [kind, n] : total.calls) {
    out << absl::StrFormat("  %-20s %10d calls", kind, n);
    auto it = total.unexpected.find(kind);
    if (it != total.unexpected.end()) {
      for (const auto& [code, c] : it->second) out << "  UNEXPECTED " << code << " x" << c;
      out << "  (first: " << OneLine(total.first_unexpected[kind]) << ")";
    }
    out << "\n";
  }
  const int64_t unexpected = total.total_unexpected();
  out << "unexpected errors (warm-up + soak): " << unexpected << "\n";
  absl::Status result;
  if (rss_before && rss_after) {
    const double growth_mb = double(*rss_after - *rss_before) / (1 << 20);
    out << absl::StrFormat("server RSS before %.1f MiB, after %.1f MiB, growth %.1f MiB (limit %d MiB)\n",
                           double(*rss_before) / (1 << 20), double(*rss_after) / (1 << 20), growth_mb,
                           cl.max_rss_growth_mb);
    if (growth_mb > double(cl.max_rss_growth_mb)) {
      result = absl::ResourceExhaustedError(absl::StrFormat(
          "server RSS grew by %.1f MiB during the soak (--max_rss_growth_mb=%d)", growth_mb, cl.max_rss_growth_mb));
    }
  }
  if (unexpected > 0) {
    result = absl::InternalError(absl::StrCat(unexpected, " unexpected status codes during the soak (listed above)"));
  }
  return result;
}

}  // namespace fusedlayer::client
