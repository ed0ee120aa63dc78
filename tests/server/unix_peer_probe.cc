// A second client process for the unix-socket peer-credential test (unix_socket_e2e_test.cc,
// PeersAreIdentifiedByTheirUserAndActOnlyOnObjectsTheyCouldOpen), started there under another
// user id when the test runs as root. Over the server's unix socket it:
//   - registers `other_key` (an object the test process made) as "theirs";
//   - makes an object of its own (mode 0600) and registers it as "own";
//   - lists its identity's regions;
// and prints one line per step ("theirs: CODE message", "own: CODE message", "listed: a,b", "uid: N"),
// then unregisters and removes what it made.
//
// Usage: fusedlayer_unix_peer_probe TARGET OTHER_KEY
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "client/lib/fusedlayer_client.h"

namespace {

void Print(const char* step, const absl::Status& s) {
  std::printf("%s: %s %s\n", step, absl::StatusCodeToString(s.code()).c_str(), std::string(s.message()).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TARGET OTHER_KEY\n", argv[0]);
    return 2;
  }
  auto client = fusedlayer::client::FusedLayerClient::Connect(argv[1]);
  if (!client.ok()) {
    Print("connect", client.status());
    return 1;
  }
  Print("theirs", (*client)->RegisterSystemSharedMemory("theirs", argv[2], 0, 4096));

  std::random_device rd;
  const std::string key = "/fl-probe-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ::ftruncate(fd, 4096) != 0) {
    std::printf("own: could not make %s\n", key.c_str());
    return 1;
  }
  Print("own", (*client)->RegisterSystemSharedMemory("own", key, 0, 4096));

  std::string names;
  absl::StatusOr<fusedlayer::v1::SystemSharedMemoryStatusResponse> listed = (*client)->SystemSharedMemoryStatus();
  if (listed.ok()) {
    for (const auto& r : listed->regions()) names += (names.empty() ? "" : ",") + r.name();
  }
  std::printf("listed: %s\n", listed.ok() ? names.c_str() : std::string(listed.status().message()).c_str());
  std::printf("uid: %u\n", static_cast<unsigned>(::getuid()));

  (void)(*client)->UnregisterSystemSharedMemory("own");
  ::close(fd);
  ::shm_unlink(key.c_str());
  return 0;
}
