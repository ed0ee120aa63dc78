// Who is at the other end of a unix-socket connection, from the kernel (SO_PEERCRED), for the
// calls that arrive on it.
//
// Why: a plaintext server without tokens has no other way to tell its callers apart: every call is
// the one `anonymous` identity (auth/caller_identity.h), so same-host clients share one namespace of
// shared-memory regions and sessions, and the server opens shared-memory objects with its own
// permissions whoever asks (a confused deputy: a client could name another user's object and have
// the server read and write it). On a unix socket the kernel knows the connecting process's user;
// gRPC 1.51 does not expose it (grpc/grpc#15511, #28755), so the server accepts such connections
// itself (rpc/plaintext_listener.h), reads SO_PEERCRED once per connection and hands the connected socket
// to gRPC (grpc::AddInsecureChannelFromFd). gRPC names the calls of such a connection's peer
// "fd:N"; this table maps that name back to the credentials, and checks that descriptor N is still
// the socket that was accepted (its inode), so a number reused by a later connection can never lend
// its credentials to a call of an earlier one.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "common/annotated_mutex.h"

namespace fusedlayer::server::auth {

// The credentials the kernel recorded when the peer connected.
struct UnixPeer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

class UnixPeerTable {
 public:
  // Reads SO_PEERCRED of the connected socket `fd` and records it; false when the kernel gives none
  // (the connection is then not handed to gRPC).
  bool Add(int fd);
  // The peer of a call whose ServerContext::peer() is `grpc_peer`: the recorded credentials when it
  // names a connection this table holds ("fd:N", N still the accepted socket), nullopt otherwise.
  std::optional<UnixPeer> Find(std::string_view grpc_peer) const;
  // True when `grpc_peer` names a connection handed over by fd ("fd:N"), known or not: such a
  // call's identity comes from this table and nowhere else.
  static bool IsFdPeer(std::string_view grpc_peer);

 private:
  struct Entry {
    UnixPeer peer;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  mutable Mutex mu_;
  std::map<int, Entry> by_fd_ ABSL_GUARDED_BY(mu_);
};

// The identity of a caller known by its credentials: "uid:" + its user id.
std::string UnixPeerIdentity(const UnixPeer& peer);

// Whether `peer` could open the object described by `st` for reading and writing itself, by its
// mode bits: root may; its owner needs rw for the owner, its group (the peer's primary group; the
// kernel does not report supplementary groups) rw for the group, anyone else rw for others. The
// server acts on a caller's shared-memory object only when the caller could.
bool UnixPeerMayReadWrite(const UnixPeer& peer, const struct stat& st);

}  // namespace fusedlayer::server::auth
