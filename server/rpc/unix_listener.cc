#include "rpc/unix_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

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

absl::StatusOr<std::unique_ptr<UnixPeerListener>> UnixPeerListener::Listen(const std::string& address) {
  sockaddr_un sa;
  const socklen_t len = UnixSocketAddress(address, &sa);
  std::string path = UnixSocketPath(address);  // unlinked at Stop; empty for an abstract name
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (--address): ", std::strerror(e)));
  }
  const int stop_fd = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) {
    const int e = errno;
    ::close(fd);
    if (!path.empty()) ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(e)));
  }
  return std::unique_ptr<UnixPeerListener>(new UnixPeerListener(fd, stop_fd, std::move(path)));
}

void UnixPeerListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixPeerListener::AcceptLoop(grpc::Server* server) {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  for (;;) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      LogError("unix socket listener: poll: ", std::strerror(errno), "; no longer accepting connections");
      return;
    }
    if (fds[1].revents != 0) return;  // Stop
    if ((fds[0].revents & POLLIN) == 0) continue;
    // Non-blocking, as gRPC's endpoints expect of their sockets.
    const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn < 0) {
      const int e = errno;
      if (e == EINTR || e == EAGAIN || e == ECONNABORTED) continue;
      // Out of descriptors or memory: say so, and do not spin on a socket that stays readable.
      LogWarning("unix socket listener: accept: ", std::strerror(e));
      ::poll(nullptr, 0, 100);
      continue;
    }
    // Recorded before gRPC can see a call of it; a connection without credentials is not served.
    if (!peers_.Add(conn)) {
      LogWarning("unix socket listener: no peer credentials for a connection (SO_PEERCRED): closed");
      ::close(conn);
      continue;
    }
    grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns and closes it from here
  }
}

void UnixPeerListener::Stop() {
  if (stop_fd_ < 0) return;
  const uint64_t one = 1;
  if (thread_.joinable()) {
    (void)!::write(stop_fd_, &one, sizeof(one));
    thread_.join();
  }
  ::close(fd_);
  ::close(stop_fd_);
  fd_ = stop_fd_ = -1;
  if (!path_.empty()) ::unlink(path_.c_str());
}

UnixPeerListener::~UnixPeerListener() { Stop(); }

}  // namespace fusedlayer::server
