#include "ring/call_rings.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "exec/op_traits.h"
#include "fusedlayer/wire/call_ring.h"
#include "ring/ring.h"
#include "ring/ring_call.h"

namespace fusedlayer::server::ring {

using wire::RingCallDescriptor;
using wire::RingSlot;

namespace {

// The one-time token a client presents on the ring socket.
constexpr size_t kTokenBytes = 32;
// What the server answers on the ring socket: "OK" + ring id, or an error text.
constexpr size_t kMaxHandoverReply = 256;

std::string RandomToken() {
  std::string token(kTokenBytes, '\0');
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  urandom.read(token.data(), static_cast<std::streamsize>(token.size()));
  return token;
}

absl::Status BindSocket(const std::string& path, int* out) {
  sockaddr_un sa{};
  if (path.empty() || path.size() >= sizeof(sa.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--call_ring_socket: '", path, "' is empty or longer than ", sizeof(sa.sun_path) - 1, " bytes"));
  }
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--call_ring_socket: ", path, " exists and is not a socket (not removing it)"));
    }
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live = probe >= 0 && ::connect(probe, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0;
    if (probe >= 0) ::close(probe);
    if (live) {
      return absl::UnavailableError(
          absl::StrCat("--call_ring_socket: another process is accepting connections on ", path));
    }
    ::unlink(path.c_str());
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0 || ::listen(fd, 64) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("--call_ring_socket: cannot listen on ", path, ": ", std::strerror(e)));
  }
  // Anyone on the host may connect: a ring is handed over only for its one-time token, which only
  // the identity that opened the ring (over gRPC, authenticated) has seen.
  ::chmod(path.c_str(), 0666);
  *out = fd;
  return absl::OkStatus();
}

void Signal(int eventfd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(eventfd, &one, sizeof(one));
}

void Drain(int eventfd) {
  uint64_t value;
  while (::read(eventfd, &value, sizeof(value)) > 0) {
  }
}

// epoll user data: the ring's id with the kind of descriptor in the top bit.
constexpr uint64_t kConnectionBit = uint64_t{1} << 63;
constexpr uint64_t kWakeTag = ~uint64_t{0};

}  // namespace

CallRingService::CallRingService(CallRingOptions options, ComputeEngine& engine, Metrics& metrics)
    : options_(std::move(options)),
      engine_(engine),
      metrics_(metrics),
      ring_metrics_(*metrics.registry()),
      in_flight_(std::make_shared<std::atomic<int64_t>>(0)) {}

absl::StatusOr<std::unique_ptr<CallRingService>> CallRingService::Start(CallRingOptions options,
                                                                        ComputeEngine& engine, Metrics& metrics) {
  std::unique_ptr<CallRingService> s(new CallRingService(std::move(options), engine, metrics));
  if (absl::Status st = BindSocket(s->options_.socket_path, &s->listen_fd_); !st.ok()) return st;
  s->stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->stop_fd_ < 0) return absl::UnavailableError(absl::StrCat("call rings: eventfd: ", std::strerror(errno)));
  for (int i = 0; i < std::max(1, s->options_.pollers); ++i) {
    auto poller = std::make_unique<Poller>();
    poller->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    poller->epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    const bool made = poller->wake_fd >= 0 && poller->epoll_fd >= 0;
    s->pollers_.push_back(std::move(poller));  // closed by the destructor, made or not
    if (!made) return absl::UnavailableError(absl::StrCat("call rings: eventfd/epoll: ", std::strerror(errno)));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeTag;
    ::epoll_ctl(s->pollers_.back()->epoll_fd, EPOLL_CTL_ADD, s->pollers_.back()->wake_fd, &ev);
  }
  s->handover_thread_ = std::thread([p = s.get()] { p->HandoverLoop(); });
  for (auto& poller : s->pollers_) poller->thread = std::thread([p = s.get(), q = poller.get()] { p->PollLoop(*q); });
  LogInfo("call rings: handed over on ", s->options_.socket_path, " (at most ", s->options_.max_rings, " rings, ",
          s->options_.max_per_identity, " per identity, ", s->options_.max_slots, " slots each; ",
          s->pollers_.size(), " poller thread(s), each spins ", s->options_.spin_us, " us",
          s->options_.device != nullptr ? "; completions of CUDA calls stored by the GPU stream" : "", ")");
  return s;
}

CallRingService::~CallRingService() {
  Stop(std::chrono::steady_clock::now());
  for (int fd : {listen_fd_, stop_fd_}) {
    if (fd >= 0) ::close(fd);
  }
  for (const auto& poller : pollers_) {
    for (int fd : {poller->wake_fd, poller->epoll_fd}) {
      if (fd >= 0) ::close(fd);
    }
  }
}

int CallRingService::open_rings() const {
  MutexLock lock(&mu_);
  return rings_;
}

absl::StatusOr<v1::OpenCallRingResponse> CallRingService::Open(const std::string& identity,
                                                               const v1::OpenCallRingRequest& request) {
  const uint32_t slots = request.slots() == 0 ? 8 : request.slots();
  if (slots > options_.max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots = ", request.slots(), " is outside 1..", options_.max_slots, " (--call_ring_max_slots)"));
  }
  if (request.weight_sets_size() > 64 || request.regions_size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("a ring binds at most 64 weight sets and 256 regions (got ",
                                                   request.weight_sets_size(), " and ", request.regions_size(), ")"));
  }
  if (stopping_.load(std::memory_order_acquire)) return absl::UnavailableError("the server is draining");
  {
    MutexLock lock(&mu_);
    if (per_identity_[identity] >= options_.max_per_identity) {
      return absl::ResourceExhaustedError(absl::StrCat("this identity has ", per_identity_[identity],
                                                       " call rings open, the most allowed (--call_ring_max_per_identity)"));
    }
    if (rings_ >= options_.max_rings) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the server has ", rings_, " call rings open, the most allowed (--call_ring_max_rings)"));
    }
    ++per_identity_[identity];
    ++rings_;
  }
  auto ring = std::make_shared<Ring>(next_ring_id_.fetch_add(1), identity,
                                     std::vector<std::string>(request.weight_sets().begin(), request.weight_sets().end()),
                                     std::vector<v1::CallRingRegion>(request.regions().begin(), request.regions().end()),
                                     slots, request.has_device_id() ? std::optional<int>(request.device_id()) : std::nullopt);
  absl::Status created = ring->Create(options_.device);
  const std::string token = RandomToken();
  MutexLock lock(&mu_);
  if (!created.ok() || token.size() != kTokenBytes) {
    --per_identity_[identity];
    --rings_;
    return created.ok() ? absl::InternalError("cannot read /dev/urandom for the ring's token") : created;
  }
  pending_[token] = ring;
  v1::OpenCallRingResponse response;
  response.set_socket_path(options_.socket_path);
  response.set_token(token);
  response.set_ring_id(ring->id());
  response.set_slots(slots);
  response.set_layout_version(wire::kCallRingLayoutVersion);
  response.set_ring_bytes(ring->bytes());
  return response;
}

void CallRingService::HandoverLoop() {
  while (!stopping_.load(std::memory_order_acquire)) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int n = ::poll(fds, 2, 1000);
    // Tokens not presented in time: the ring is dropped (its count given back).
    {
      MutexLock lock(&mu_);
      const auto now = std::chrono::steady_clock::now();
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (now - it->second->opened() > std::chrono::seconds(options_.handover_seconds)) {
          --per_identity_[it->second->identity()];
          --rings_;
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (n <= 0 || !(fds[0].revents & POLLIN)) continue;
    const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;  // EMFILE and friends: the client sees its connection refused or reset
    Handover(connection);
  }
}

void CallRingService::Handover(int connection) {
  // The client sends its token at once; one that does not within a second loses its turn.
  timeval timeout{1, 0};
  ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string token(kTokenBytes, '\0');
  size_t got = 0;
  while (got < kTokenBytes) {
    const ssize_t n = ::recv(connection, token.data() + got, kTokenBytes - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  std::shared_ptr<Ring> ring;
  if (got == kTokenBytes) {
    MutexLock lock(&mu_);
    auto it = pending_.find(token);
    if (it != pending_.end()) {
      ring = std::move(it->second);
      pending_.erase(it);
    }
  }
  if (ring == nullptr) {
    const std::string reply = "ERR unknown or expired call-ring token (OpenCallRing gives one, valid once, for 10 s)";
    wire::SendWithDescriptors(connection, reply, nullptr, 0);
    ::close(connection);
    return;
  }
  const int fds[2] = {ring->memfd(), ring->doorbell()};
  const std::string reply = absl::StrCat("OK ", ring->id());
  if (!wire::SendWithDescriptors(connection, reply, fds, 2)) {
    ::close(connection);
    MutexLock lock(&mu_);
    --per_identity_[ring->identity()];
    --rings_;
    return;
  }
  timeval none{0, 0};
  ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  ring->set_connection(connection);
  Poller* least = nullptr;
  {
    MutexLock lock(&mu_);
    for (const auto& poller : pollers_) {
      if (least == nullptr || poller->rings < least->rings) least = poller.get();
    }
    ++least->rings;
    least->incoming.push_back(std::move(ring));
  }
  Signal(least->wake_fd);
}

void CallRingService::CloseRing(Poller& poller, const std::shared_ptr<Ring>& ring) {
  ring->Close();
  ::epoll_ctl(poller.epoll_fd, EPOLL_CTL_DEL, ring->doorbell(), nullptr);
  ::epoll_ctl(poller.epoll_fd, EPOLL_CTL_DEL, ring->connection(), nullptr);
  ring_metrics_.open->Decrement();
  MutexLock lock(&mu_);
  --poller.rings;
  --per_identity_[ring->identity()];
  if (per_identity_[ring->identity()] <= 0) per_identity_.erase(ring->identity());
  --rings_;
}

bool CallRingService::Scan(const std::shared_ptr<Ring>& ring) {
  bool found = false;
  for (uint32_t i = 0; i < ring->slots(); ++i) {
    if (ring->busy(i).load(std::memory_order_acquire)) continue;  // its call is in flight
    RingSlot* slot = ring->slot(i);
    const uint32_t seq = slot->control.submit_seq.load(std::memory_order_acquire);
    if (seq == ring->taken(i)) continue;
    ring->taken(i) = seq;
    // Copied once, before any field is looked at: what the client writes from now on is not read.
    RingCallDescriptor call;
    std::memcpy(&call, &slot->call, sizeof(call));
    ring->busy(i).store(true, std::memory_order_relaxed);
    found = true;
    const RingCallTarget target{ring, i, seq, in_flight_, &metrics_, &ring_metrics_};
    SubmitRingCall(engine_, target, call);
  }
  return found;
}

void CallRingService::PollLoop(Poller& poller) {
  std::vector<std::shared_ptr<Ring>>& active = poller.active;
  using Clock = std::chrono::steady_clock;
  const auto spin = std::chrono::microseconds(options_.spin_us);
  auto last_call = Clock::now();
  auto awake_since = Clock::now();
  epoll_event events[64];
  while (!stopping_.load(std::memory_order_acquire)) {
    bool found = false;
    for (const auto& ring : active) found |= Scan(ring);
    const auto now = Clock::now();
    if (found) last_call = now;
    if (found) continue;
    if (now - last_call < spin) {
      // A spinning poller must not keep the executor's workers (which run the calls it submits)
      // off a core: on a host with as many busy threads as cores, they would wait for its time
      // slice to end. Yielding costs ~1 us when nobody else wants the core.
      std::this_thread::yield();
      continue;
    }
    // Going to sleep: say so in every ring, then look once more (a call submitted before the flag
    // was visible would otherwise wait for the next doorbell), then wait for a doorbell, a
    // connection's end, a new ring or Stop.
    for (const auto& ring : active) ring->header()->poller_sleeping.store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (const auto& ring : active) found |= Scan(ring);
    int n = 0;
    if (!found) {
      ring_metrics_.poller_busy_seconds->Increment(std::chrono::duration<double>(Clock::now() - awake_since).count());
      n = ::epoll_wait(poller.epoll_fd, events, 64, -1);
      awake_since = Clock::now();
    }
    for (const auto& ring : active) ring->header()->poller_sleeping.store(0, std::memory_order_relaxed);
    last_call = Clock::now();
    for (int e = 0; e < n; ++e) {
      const uint64_t tag = events[e].data.u64;
      if (tag == kWakeTag) {
        Drain(poller.wake_fd);
        continue;
      }
      const uint64_t id = tag & ~kConnectionBit;
      for (auto it = active.begin(); it != active.end(); ++it) {
        if ((*it)->id() != id) continue;
        if (tag & kConnectionBit) {
          // The client closed its connection (or died): the ring closes. It sends nothing on it, so
          // anything readable is treated the same way.
          CloseRing(poller, *it);
          active.erase(it);
        } else {
          Drain((*it)->doorbell());
        }
        break;
      }
    }
    std::vector<std::shared_ptr<Ring>> incoming;
    {
      MutexLock lock(&mu_);
      incoming.swap(poller.incoming);
    }
    for (auto& ring : incoming) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = ring->id();
      ::epoll_ctl(poller.epoll_fd, EPOLL_CTL_ADD, ring->doorbell(), &ev);
      ev.events = EPOLLIN | EPOLLRDHUP | EPOLLHUP;
      ev.data.u64 = ring->id() | kConnectionBit;
      ::epoll_ctl(poller.epoll_fd, EPOLL_CTL_ADD, ring->connection(), &ev);
      ring_metrics_.open->Increment();
      active.push_back(std::move(ring));
    }
  }
}

void CallRingService::Stop(std::chrono::steady_clock::time_point deadline) {
  if (stopping_.exchange(true, std::memory_order_acq_rel)) return;
  Signal(stop_fd_);
  for (const auto& poller : pollers_) Signal(poller->wake_fd);
  if (handover_thread_.joinable()) handover_thread_.join();
  for (const auto& poller : pollers_) {
    if (poller->thread.joinable()) poller->thread.join();
    for (const auto& ring : poller->active) CloseRing(*poller, ring);
    poller->active.clear();
  }
  {
    MutexLock lock(&mu_);
    for (const auto& poller : pollers_) {
      for (auto& ring : poller->incoming) ring->Close();
      poller->incoming.clear();
    }
    pending_.clear();
  }
  // Calls already queued finish (or are dropped at their launch check: their ring is closed) on the
  // executor; their completions go to memory they hold.
  while (in_flight_->load(std::memory_order_acquire) > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (listen_fd_ >= 0) ::unlink(options_.socket_path.c_str());
}

}  // namespace fusedlayer::server::ring
