// One open call ring (ring/call_rings.h): its memory, mapped here for as long as a call of it is in
// flight (the calls hold the ring), its descriptors, what it binds, and the poller's per-slot state.
#pragma once

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "fusedlayer/wire/call_ring.h"

namespace fusedlayer::server::ring {

using wire::RingHeader;
using wire::RingSlot;

class Ring {
 public:
  Ring(uint64_t id, std::string identity, std::vector<std::string> weight_sets,
       std::vector<v1::CallRingRegion> regions, uint32_t slots, std::optional<int> device_id = std::nullopt)
      : id_(id),
        identity_(std::move(identity)),
        weight_sets_(std::move(weight_sets)),
        regions_(std::move(regions)),
        slots_(slots),
        device_id_(device_id),
        taken_(slots, 0),
        busy_(new std::atomic<bool>[slots]) {
    for (uint32_t i = 0; i < slots; ++i) busy_[i].store(false, std::memory_order_relaxed);
  }
  ~Ring() {
    locked_ = DeviceBuffer();  // unlocked before it is unmapped
    if (base_ != nullptr) ::munmap(base_, bytes_);
    for (int fd : {memfd_, doorbell_, connection_}) {
      if (fd >= 0) ::close(fd);
    }
  }

  // The memory: a memfd of RingBytes(slots), sealed so that nobody can shrink (or grow) it, mapped,
  // and page-locked for `device` when there is one (a GPU backend): its streams can then store a
  // call's completion seq (ring_call.cc). A device that refuses (locked-memory limits) leaves the
  // ring as it is on a CPU server: its completions are written by server threads.
  absl::Status Create(Backend* device = nullptr) {
    bytes_ = wire::RingBytes(slots_);
    memfd_ = ::memfd_create("fusedlayer-call-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd_ < 0) return absl::ResourceExhaustedError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    if (::ftruncate(memfd_, static_cast<off_t>(bytes_)) != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("sizing the ring's memory: ", std::strerror(errno)));
    }
    // Sealed before anyone else holds the descriptor: a client's ftruncate could otherwise turn
    // the server's next read of the mapping into SIGBUS.
    if (::fcntl(memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      return absl::InternalError(absl::StrCat("sealing the ring's memory: ", std::strerror(errno)));
    }
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (base_ == MAP_FAILED) {
      base_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("mapping the ring's memory: ", std::strerror(errno)));
    }
    doorbell_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (doorbell_ < 0) return absl::ResourceExhaustedError(absl::StrCat("eventfd: ", std::strerror(errno)));
    RingHeader* h = wire::RingHeaderAt(base_);
    h->magic = wire::kCallRingMagic;
    h->layout_version = wire::kCallRingLayoutVersion;
    h->slots = slots_;
    h->slot_bytes = static_cast<uint32_t>(sizeof(RingSlot));
    h->ring_id = id_;
    h->slot_offset = wire::kRingSlotOffset;
    h->poller_sleeping.store(0, std::memory_order_release);
    if (device != nullptr) {
      absl::StatusOr<DeviceBuffer> locked = device->PageLockHostMemory(base_, bytes_);
      if (locked.ok()) locked_ = std::move(*locked);
    }
    return absl::OkStatus();
  }
  // Whether the device can store into the ring's memory (Create).
  bool device_visible() const { return locked_.data() != nullptr; }

  uint64_t id() const { return id_; }
  const std::string& identity() const { return identity_; }
  const std::vector<std::string>& weight_sets() const { return weight_sets_; }
  const std::vector<v1::CallRingRegion>& regions() const { return regions_; }
  // The device every call of the ring names (OpenCallRingRequest.device_id), or none.
  const std::optional<int>& device_id() const { return device_id_; }
  uint32_t slots() const { return slots_; }
  uint64_t bytes() const { return bytes_; }
  int memfd() const { return memfd_; }
  int doorbell() const { return doorbell_; }
  int connection() const { return connection_; }
  void set_connection(int fd) { connection_ = fd; }
  RingHeader* header() const { return wire::RingHeaderAt(base_); }
  RingSlot* slot(uint32_t i) const { return wire::RingSlotAt(base_, i); }
  std::chrono::steady_clock::time_point opened() const { return opened_; }

  bool closed() const { return closed_.load(std::memory_order_acquire); }
  void Close() { closed_.store(true, std::memory_order_release); }

  // The poller's: the seq it last took from slot i, and whether that call is in flight (set by the
  // poller, cleared by whoever completes the call).
  uint32_t& taken(uint32_t i) { return taken_[i]; }
  std::atomic<bool>& busy(uint32_t i) { return busy_[i]; }

 private:
  const uint64_t id_;
  const std::string identity_;
  const std::vector<std::string> weight_sets_;
  const std::vector<v1::CallRingRegion> regions_;
  const uint32_t slots_;
  const std::optional<int> device_id_;
  const std::chrono::steady_clock::time_point opened_ = std::chrono::steady_clock::now();
  uint64_t bytes_ = 0;
  int memfd_ = -1;
  int doorbell_ = -1;
  int connection_ = -1;
  void* base_ = nullptr;
  DeviceBuffer locked_;  // the page lock of the mapping for the device, or none
  std::atomic<bool> closed_{false};
  std::vector<uint32_t> taken_;
  std::unique_ptr<std::atomic<bool>[]> busy_;
};

}  // namespace fusedlayer::server::ring
