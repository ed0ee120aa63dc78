#include "rpc/plaintext_listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "grpcpp/server_posix.h"

namespace fusedlayer::server {

socklen_t UnixSocketAddress(std::string_view address, sockaddr_un* sa) {
  *sa = sockaddr_un{};
  sa->sun_family = AF_UNIX;
  if (ListenKindOf(address) == ListenKind::kUnixAbstract) {
    const std::string name = UnixAbstractName(address);
    std::memcpy(sa->sun_path + 1, name.data(), name.size());
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  const std::string path = UnixSocketPath(address);
  std::memcpy(sa->sun_path, path.data(), path.size());
  return static_cast<socklen_t>(sizeof(*sa));
}

namespace {

int64_t NowNanos() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

struct HostPort {
  std::string host;  // without brackets; empty for the wildcard
  uint16_t port = 0;
};

// HOST:PORT, [V6]:PORT or :PORT; nullopt for any other form (ipv4:, ipv6:, dns:///..., a bare IPv6
// address without brackets), which gRPC's own listener parses.
std::optional<HostPort> SplitHostPort(std::string_view address) {
  HostPort out;
  std::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string_view::npos || close + 1 >= address.size() || address[close + 1] != ':') return std::nullopt;
    out.host = std::string(address.substr(1, close - 1));
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string_view::npos) return std::nullopt;
    if (address.substr(0, colon).find(':') != std::string_view::npos) return std::nullopt;
    if (address.substr(0, colon).find('/') != std::string_view::npos) return std::nullopt;
    out.host = std::string(address.substr(0, colon));
    port = address.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit)) {
    return std::nullopt;
  }
  uint32_t value = 0;
  for (char c : port) value = value * 10 + static_cast<uint32_t>(c - '0');
  if (value > 65535) return std::nullopt;
  out.port = static_cast<uint16_t>(value);
  if (out.host == "0.0.0.0" || out.host == "::") out.host.clear();
  return out;
}

uint16_t PortOf(const sockaddr_storage& sa) {
  return ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(sa).sin6_port
                                        : reinterpret_cast<const sockaddr_in&>(sa).sin_port);
}

void SetPort(sockaddr_storage* sa, uint16_t port) {
  if (sa->ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(sa)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(sa)->sin_port = htons(port);
  }
}

// A listening TCP socket on `sa` (its port filled in when it was 0); -1 with errno set otherwise.
int ListenTcp(sockaddr_storage* sa, socklen_t len, bool dual_stack) {
  const int fd = ::socket(sa->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1, v6only = dual_stack ? 0 : 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (sa->ss_family == AF_INET6) (void)::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
  // Accepted sockets inherit it: small gRPC frames go out at once.
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(sa), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  socklen_t got = sizeof(*sa);
  (void)::getsockname(fd, reinterpret_cast<sockaddr*>(sa), &got);
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlaintextListener>> PlaintextListener::Listen(const std::string& address) {
  const ListenKind kind = ListenKindOf(address);
  std::vector<int> fds;
  std::string path;
  int port = 0;
  auto close_all = [&fds] {
    for (int fd : fds) ::close(fd);
    fds.clear();
  };
  if (kind != ListenKind::kTcp) {
    sockaddr_un sa;
    const socklen_t len = UnixSocketAddress(address, &sa);
    path = UnixSocketPath(address);  // unlinked at Stop; empty for an abstract name
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      const int e = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (--address): ", std::strerror(e)));
    }
    fds.push_back(fd);
  } else {
    const std::optional<HostPort> hp = SplitHostPort(address);
    if (!hp) {
      return absl::UnimplementedError(absl::StrCat("--address=", address, " is not HOST:PORT, [V6]:PORT or :PORT"));
    }
    std::vector<std::pair<sockaddr_storage, socklen_t>> addresses;
    bool dual_stack = false;
    if (hp->host.empty()) {
      // The wildcard: IPv6 and IPv4 on one socket, or IPv4 alone where the host has no IPv6.
      sockaddr_storage v6{};
      v6.ss_family = AF_INET6;
      reinterpret_cast<sockaddr_in6&>(v6).sin6_addr = in6addr_any;
      addresses.emplace_back(v6, sizeof(sockaddr_in6));
      dual_stack = true;
    } else {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* found = nullptr;
      if (const int rc = ::getaddrinfo(hp->host.c_str(), nullptr, &hints, &found); rc != 0) {
        return absl::UnavailableError(
            absl::StrCat("cannot listen on ", address, " (--address): ", hp->host, ": ", ::gai_strerror(rc)));
      }
      for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
        if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
        sockaddr_storage sa{};
        std::memcpy(&sa, a->ai_addr, a->ai_addrlen);
        const bool seen = std::any_of(addresses.begin(), addresses.end(), [&](const auto& e) {
          return e.second == a->ai_addrlen && std::memcmp(&e.first, &sa, a->ai_addrlen) == 0;
        });
        if (!seen) addresses.emplace_back(sa, static_cast<socklen_t>(a->ai_addrlen));
      }
      ::freeaddrinfo(found);
    }
    // Port 0: the first socket's port for the others (a name with an IPv4 and an IPv6 address).
    uint16_t want = hp->port;
    std::string failures;
    for (auto& [sa, len] : addresses) {
      SetPort(&sa, want);
      int fd = ListenTcp(&sa, len, dual_stack);
      if (fd < 0 && dual_stack && (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL)) {
        sockaddr_storage v4{};
        v4.ss_family = AF_INET;
        reinterpret_cast<sockaddr_in&>(v4).sin_addr.s_addr = htonl(INADDR_ANY);
        SetPort(&v4, want);
        sa = v4;
        len = sizeof(sockaddr_in);
        fd = ListenTcp(&sa, len, false);
      }
      if (fd < 0) {
        absl::StrAppend(&failures, failures.empty() ? "" : "; ", std::strerror(errno));
        continue;
      }
      fds.push_back(fd);
      want = PortOf(sa);
    }
    if (fds.empty()) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (--address): ",
                                                 failures.empty() ? "no address" : failures));
    }
    if (!failures.empty()) LogWarning("listening on ", address, ": some of its addresses failed: ", failures);
    port = want;
  }
  const int stop_fd = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) {
    const int e = errno;
    close_all();
    if (!path.empty()) ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(e)));
  }
  return std::unique_ptr<PlaintextListener>(
      new PlaintextListener(std::move(fds), stop_fd, std::move(path), kind != ListenKind::kTcp, port));
}

void PlaintextListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

bool PlaintextListener::AcceptOne(int fd, grpc::Server* server) {
  // Non-blocking, as gRPC's endpoints expect of their sockets.
  const int conn = ::accept4(fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (conn < 0) {
    const int e = errno;
    if (e == EINTR || e == EAGAIN || e == ECONNABORTED) return true;
    // Out of descriptors or memory: the connection stays in the backlog, and the next try comes
    // after a pause (the socket stays readable: no spinning on it). Said once, then at most every
    // 10 s with the count, not 10 times a second.
    ++refused_since_log_;
    const int64_t now = NowNanos();
    if (last_refusal_log_ns_ == 0 || now - last_refusal_log_ns_ > 10'000'000'000) {
      LogWarning("listener: accept: ", std::strerror(e), " (", refused_since_log_,
                 refused_since_log_ == 1 ? " try" : " tries",
                 "); the connection waits in the backlog, accepting again every 100 ms");
      last_refusal_log_ns_ = now;
      refused_since_log_ = 0;
    }
    return false;
  }
  if (refused_since_log_ > 0 || last_refusal_log_ns_ != 0) {
    if (last_refusal_log_ns_ != 0) LogInfo("listener: accepting again");
    refused_since_log_ = 0;
    last_refusal_log_ns_ = 0;
  }
  // Recorded before gRPC can see a call of it; a connection without credentials is not served.
  if (unix_socket_ && !peers_.Add(conn)) {
    LogWarning("unix socket listener: no peer credentials for a connection (SO_PEERCRED): closed");
    ::close(conn);
    return true;
  }
  grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns and closes it from here
  return true;
}

void PlaintextListener::AcceptLoop(grpc::Server* server) {
  std::vector<pollfd> fds;
  for (int fd : fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({stop_fd_, POLLIN, 0});
  bool pause = false;
  for (;;) {
    // After a refused accept: wait 100 ms for descriptors to come free (or Stop), then try again.
    if (::poll(pause ? &fds.back() : fds.data(), pause ? 1 : fds.size(), pause ? 100 : -1) < 0) {
      if (errno == EINTR) continue;
      LogError("listener: poll: ", std::strerror(errno), "; no longer accepting connections");
      return;
    }
    if (fds.back().revents != 0) return;  // Stop
    const bool retry = pause;
    pause = false;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (!retry && (fds[i].revents & POLLIN) == 0) continue;
      if (!AcceptOne(fds[i].fd, server)) pause = true;
    }
  }
}

void PlaintextListener::Stop() {
  if (stop_fd_ < 0) return;
  const uint64_t one = 1;
  if (thread_.joinable()) {
    (void)!::write(stop_fd_, &one, sizeof(one));
    thread_.join();
  }
  for (int fd : fds_) ::close(fd);
  fds_.clear();
  ::close(stop_fd_);
  stop_fd_ = -1;
  if (!path_.empty()) ::unlink(path_.c_str());
}

PlaintextListener::~PlaintextListener() { Stop(); }

}  // namespace fusedlayer::server
