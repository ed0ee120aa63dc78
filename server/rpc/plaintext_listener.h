// A plaintext listener the server runs itself: for unix sockets, so that it knows who connected;
// for TCP, so that running out of descriptors does not end accepting for good.
//
// gRPC's own unix listener gives a call no way to learn the connecting process's credentials
// (auth/unix_peers.h says why they matter). And gRPC 1.51's own listener stops accepting for the
// rest of the process's life after one accept4() fails with EMFILE or ENFILE (grpc/grpc#20418,
// fixed in later releases), even once descriptors are free again. This listener binds and listens
// (for a unix path the checks of PrepareUnixSocketPath in server.cc run first), accepts on its own
// thread, and hands each connected socket to gRPC with grpc::AddInsecureChannelFromFd, where it is
// served like any other connection: the same service, channel arguments (message sizes, memory
// quota, streams per connection, connection age) and drain. When accept4() finds no descriptor
// free, the connection waits in the kernel's backlog and the listener tries again every 100 ms.
// A unix connection's SO_PEERCRED goes into the peer table first.
//
// gRPC accepts only insecure credentials that way, so the server uses this listener for plaintext
// addresses without tokens; with TLS or tokens gRPC's own listener stays (the identity is then the
// token's or the certificate's), and the descriptor budget keeps regions from taking the
// descriptors its accepts need (docs/operations.md, "Descriptor budget").
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "auth/unix_peers.h"
#include "config.h"
#include "grpcpp/server.h"

namespace fusedlayer::server {

// The socket address of a unix: or unix-abstract: --address (its length bounded by Validate()),
// in `*sa`; returns the address length to pass to bind or connect. An abstract name is a leading
// NUL and the name, with no terminator: the length says where it ends (as gRPC does).
socklen_t UnixSocketAddress(std::string_view address, sockaddr_un* sa);

class PlaintextListener {
 public:
  // Binds `address` and listens: unix:PATH, unix-abstract:NAME, or HOST:PORT / [V6]:PORT / :PORT
  // for TCP (a wildcard host, "", 0.0.0.0 or [::], listens on IPv6 and IPv4 as gRPC does; a name
  // on each of its addresses; port 0 picks one port for all). UNAVAILABLE naming --address when it
  // cannot; UNIMPLEMENTED for a TCP address of another form (a URI scheme: gRPC's listener serves it).
  static absl::StatusOr<std::unique_ptr<PlaintextListener>> Listen(const std::string& address);
  ~PlaintextListener();

  // Starts accepting; every connection goes to `server` (built and started, outliving Stop).
  void Start(grpc::Server* server);
  // Stops accepting and closes the sockets (a path is unlinked); connections already handed to gRPC
  // stay its own. Idempotent.
  void Stop();

  // The TCP port listened on (the one picked for port 0); 0 for a unix socket.
  int port() const { return port_; }
  // The peers of a unix socket's connections (empty for TCP).
  const auth::UnixPeerTable& peers() const { return peers_; }

 private:
  PlaintextListener(std::vector<int> fds, int stop_fd, std::string path, bool unix_socket, int port)
      : fds_(std::move(fds)), stop_fd_(stop_fd), path_(std::move(path)), unix_socket_(unix_socket), port_(port) {}
  void AcceptLoop(grpc::Server* server);
  // One connection waiting on listening socket `fd`; false when none could be taken now.
  bool AcceptOne(int fd, grpc::Server* server);

  std::vector<int> fds_;  // the listening sockets (a TCP name may resolve to several addresses)
  int stop_fd_ = -1;      // an eventfd that wakes the accept loop to stop
  const std::string path_;  // the socket file to unlink at Stop; empty for an abstract name or TCP
  const bool unix_socket_;
  const int port_;
  auth::UnixPeerTable peers_;
  std::thread thread_;
  uint64_t refused_since_log_ = 0;  // accepts that found no descriptor since the last warning
  int64_t last_refusal_log_ns_ = 0;
};

}  // namespace fusedlayer::server
