#include "fusedlayer/wire/call_ring.h"

#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace fusedlayer::wire {

const char* RingRoleName(RingRole role) {
  switch (role) {
    case RingRole::kX: return "x";
    case RingRole::kResidual: return "residual";
    case RingRole::kPostMix: return "post_mix";
    case RingRole::kCombMix: return "comb_mix";
    case RingRole::kPreMix: return "pre_mix";
    case RingRole::kQrKv: return "qr_kv";
    case RingRole::kNewResidual: return "new_residual";
    case RingRole::kNewPreMix: return "new_pre_mix";
    case RingRole::kNewPostMix: return "new_post_mix";
    case RingRole::kNewCombMix: return "new_comb_mix";
    case RingRole::kY: return "y";
    case RingRole::kAux: return "aux";
    case RingRole::kQFp8: return "q_fp8";
    case RingRole::kQScale: return "q_scale";
    case RingRole::kKv: return "kv";
    case RingRole::kQProj: return "q_proj";
    case RingRole::kNone: break;
  }
  return "";
}

bool RingRoleIsInput(RingOp op, RingRole role) {
  const auto r = static_cast<uint32_t>(role);
  if (op == RingOp::kMhcSeam) return r >= 1 && r <= 5;
  if (op == RingOp::kSwaNormQuant) return role == RingRole::kQrKv;
  return false;
}

bool RingRoleIsOutput(RingOp op, RingRole role) {
  const auto r = static_cast<uint32_t>(role);
  if (op == RingOp::kMhcSeam) return r >= 16 && r <= 21;
  if (op == RingOp::kSwaNormQuant) return r >= 24 && r <= 27;
  return false;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1'000'000'000);
    tsp = &ts;
  }
  // EAGAIN (the word changed first), EINTR and ETIMEDOUT all mean "look again": the caller loops.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, tsp, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

int64_t MonotonicNanos() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

bool SendWithDescriptors(int socket, std::string_view bytes, const int* fds, int num_fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * static_cast<size_t>(num_fds)), 0);
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (num_fds > 0) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * static_cast<size_t>(num_fds));
    std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * static_cast<size_t>(num_fds));
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(bytes.size());
}

int ReceiveWithDescriptors(int socket, std::string* bytes, size_t max_bytes, int* fds, int max_fds) {
  bytes->assign(max_bytes, '\0');
  iovec iov{bytes->data(), max_bytes};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * static_cast<size_t>(max_fds)), 0);
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  bytes->resize(static_cast<size_t>(n));
  int received = 0;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const int count = static_cast<int>((cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    for (int i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cmsg) + sizeof(int) * static_cast<size_t>(i), sizeof(int));
      if (received < max_fds) {
        fds[received++] = fd;
      } else {
        ::close(fd);  // more than asked for: not ours to keep
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    for (int i = 0; i < received; ++i) ::close(fds[i]);
    errno = EMSGSIZE;
    return -1;
  }
  return received;
}

}  // namespace fusedlayer::wire
