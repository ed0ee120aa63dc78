#include "auth/unix_peers.h"

#include <sys/socket.h>

#include <charconv>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server::auth {

namespace {

constexpr std::string_view kFdPeerPrefix = "fd:";  // gRPC: grpc_server_add_channel_from_fd's endpoint name

}  // namespace

bool UnixPeerTable::Add(int fd) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  struct stat st {};
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred) ||
      ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return false;
  }
  MutexLock lock(&mu_);
  // Replaces what a closed connection with the same descriptor number left: that connection is gone.
  by_fd_[fd] = Entry{UnixPeer{cred.uid, cred.gid, cred.pid}, st.st_dev, st.st_ino};
  return true;
}

bool UnixPeerTable::IsFdPeer(std::string_view grpc_peer) {
  return grpc_peer.substr(0, kFdPeerPrefix.size()) == kFdPeerPrefix;
}

std::optional<UnixPeer> UnixPeerTable::Find(std::string_view grpc_peer) const {
  if (!IsFdPeer(grpc_peer)) return std::nullopt;
  const std::string_view digits = grpc_peer.substr(kFdPeerPrefix.size());
  int fd = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), fd);
  if (ec != std::errc() || end != digits.data() + digits.size() || fd < 0) return std::nullopt;
  MutexLock lock(&mu_);
  const auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  // The descriptor must still be the socket that was accepted (under the lock, so a new connection
  // cannot be recorded between the check and the answer).
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_dev != it->second.dev || st.st_ino != it->second.ino) return std::nullopt;
  return it->second.peer;
}

std::string UnixPeerIdentity(const UnixPeer& peer) { return absl::StrCat("uid:", peer.uid); }

bool UnixPeerMayReadWrite(const UnixPeer& peer, const struct stat& st) {
  if (peer.uid == 0) return true;
  if (peer.uid == st.st_uid) return (st.st_mode & S_IRUSR) && (st.st_mode & S_IWUSR);
  if (peer.gid == st.st_gid) return (st.st_mode & S_IRGRP) && (st.st_mode & S_IWGRP);
  return (st.st_mode & S_IROTH) && (st.st_mode & S_IWOTH);
}

}  // namespace fusedlayer::server::auth
