#include "transport/shared_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <span>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "prometheus/family.h"

namespace fusedlayer::server::transport {
namespace {

constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxKeyLength = 200;  // without the leading '/'

bool NameChar(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'; }

}  // namespace

absl::Status CheckRegionName(const std::string& name) {
  bool ok = !name.empty() && name.size() <= kMaxNameLength;
  for (char c : name) ok = ok && NameChar(c);
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("region name '", ClientString(name), "' is not 1 to 128 characters of [A-Za-z0-9._-]"));
  }
  return absl::OkStatus();
}

absl::Status CheckRefInRegion(const v1::SharedMemoryRef& ref, uint64_t region_offset, uint64_t region_bytes,
                              const char* tensor, const char* kind) {
  // Overflow-free: offset <= size, then byte_size <= size - offset.
  if (ref.offset() > region_bytes || ref.byte_size() > region_bytes - ref.offset()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': bytes [", ref.offset(), ", +", ref.byte_size(),
                                                   ") lie outside ", kind, " region '", ref.region(), "' of ",
                                                   region_bytes, " bytes"));
  }
  if ((region_offset + ref.offset()) % kSharedMemoryAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': offset ", ref.offset(), " in ", kind,
                                                   " region '", ref.region(),
                                                   "' is not aligned: the object offset must be a multiple of ",
                                                   kSharedMemoryAlignment));
  }
  return absl::OkStatus();
}

namespace {

// One path component under /dev/shm: a leading '/', no other '/', and no leading '.' (which
// rules out "/." and "/..", the directory itself and its parent).
absl::Status CheckKey(const std::string& key) {
  bool ok = key.size() >= 2 && key.size() <= kMaxKeyLength + 1 && key[0] == '/' && key[1] != '.';
  for (size_t i = 1; ok && i < key.size(); ++i) ok = NameChar(key[i]);
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key '", ClientString(key), "' is not a POSIX shared-memory name: '/' then 1 to 200 characters of "
        "[A-Za-z0-9._-], not starting with '.'"));
  }
  return absl::OkStatus();
}

std::string Errno(int e) { return std::strerror(e); }

// stat() of the object a key names now. glibc's shm_open opens /dev/shm/NAME.
int StatKey(const std::string& key, struct stat* st) { return ::stat(absl::StrCat("/dev/shm", key).c_str(), st); }

absl::Status Vanished(const SharedMemoryRegion& r) {
  return absl::FailedPreconditionError(absl::StrCat(
      "shared-memory region '", r.name(), "': its object ", r.key(),
      " was removed or replaced after registration; the region is unregistered, register it again"));
}

}  // namespace

// ---- SharedMemoryRegion -------------------------------------------------------------------------------

SharedMemoryRegion::SharedMemoryRegion(int fd, std::string name, std::string key, uint64_t offset, uint64_t byte_size,
                                       dev_t dev, ino_t ino)
    : fd_(fd), name_(std::move(name)), key_(std::move(key)), offset_(offset), byte_size_(byte_size), dev_(dev),
      ino_(ino) {}

SharedMemoryRegion::~SharedMemoryRegion() {
  Unlock();  // in-flight requests held this region until their device work was done
  if (pinned_budget_ != nullptr) pinned_budget_->GiveBack(byte_size_);  // unpinned now
  ::close(fd_);
}

void SharedMemoryRegion::Unlock() {
  locked_data_ = nullptr;
  lock_ = DeviceBuffer();  // unlock before unmapping
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

bool SharedMemoryRegion::LockForDevice(Backend& locker) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset_ / page * page;
  const uint64_t bytes = offset_ + byte_size_ - begin;
  // The mapping never faults anything in here: the driver pins its pages from the kernel, and a
  // page beyond a (concurrently) shrunk object fails the lock instead of raising SIGBUS.
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(begin));
  if (map == MAP_FAILED) return false;
  absl::StatusOr<DeviceBuffer> lock = locker.PageLockHostMemory(map, bytes);
  if (!lock.ok()) {
    LogInfo("shared-memory region '", name_, "' (", key_, ") is read with pread: ", lock.status().message());
    ::munmap(map, bytes);
    return false;
  }
  map_ = map;
  map_bytes_ = bytes;
  lock_ = std::move(*lock);
  locked_data_ = static_cast<const char*>(map) + (offset_ - begin);
  return true;
}

absl::Status SharedMemoryRegion::CheckStillNamed() const {
  struct stat st;
  if (StatKey(key_, &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_) return Vanished(*this);
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::CheckSize() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return absl::FailedPreconditionError(absl::StrCat("fstat of ", key_, ": ", Errno(errno)));
  const uint64_t end = offset_ + byte_size_;  // no overflow: checked at registration
  if (static_cast<uint64_t>(st.st_size) < end) {
    return absl::FailedPreconditionError(absl::StrCat("shared-memory region '", name_, "': its object ", key_,
                                                      " shrank to ", st.st_size, " bytes after registration; the "
                                                      "region needs ", end, " (unregister it, or restore the size)"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::Read(uint64_t at, char* dst, uint64_t n, const char* tensor) const {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, dst + done, n - done, static_cast<off_t>(offset_ + at + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", tensor, "': reading ", n, " bytes at offset ", at, " of shared-memory region '", name_,
          "' failed: ", got < 0 ? Errno(errno) : "its object shrank after registration"));
    }
    done += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::Write(uint64_t at, const char* src, uint64_t n, const char* tensor) const {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t put = ::pwrite(fd_, src + done, n - done, static_cast<off_t>(offset_ + at + done));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return absl::FailedPreconditionError(absl::StrCat("output '", tensor, "': writing ", n, " bytes at offset ", at,
                                                        " of shared-memory region '", name_,
                                                        "' failed: ", put < 0 ? Errno(errno) : "nothing written"));
    }
    done += static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

// ---- PinnedBytes ---------------------------------------------------------------------------------------

bool PinnedBytes::TryReserve(uint64_t bytes, uint64_t limit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes_ > limit || bytes > limit - bytes_) return false;
  bytes_ += bytes;
  if (gauge_ != nullptr) gauge_->Set(static_cast<double>(bytes_));
  return true;
}

void PinnedBytes::GiveBack(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ -= bytes;
  if (gauge_ != nullptr) gauge_->Set(static_cast<double>(bytes_));
}

void PinnedBytes::DetachGauge() {
  std::lock_guard<std::mutex> lock(mu_);
  gauge_ = nullptr;
}

// ---- SharedMemoryRegistry -----------------------------------------------------------------------------

SharedMemoryRegistry::SharedMemoryRegistry(SharedMemoryLimits limits, prometheus::Registry& metrics, Backend* locker)
    : limits_(limits),
      locker_(locker),
      metrics_(SharedMemoryMetrics::Register(metrics)),
      regions_(RegionTableSpec{"shared-memory", "--shared_memory_max_regions", "--shared_memory_idle_seconds",
                               limits.max_regions, limits.idle_seconds},
               RegionTableMetrics{metrics_.regions, metrics_.registered_bytes, metrics_.expired}),
      pinned_(std::make_shared<PinnedBytes>(metrics_.locked_bytes)) {
  metrics_.region_budget->Set(static_cast<double>(limits_.max_total_regions));
  // Last: the reaper may run as soon as it exists.
  if (limits_.enabled && limits_.idle_seconds > 0) {
    reaper_.emplace(ReaperPeriod(limits_.idle_seconds), [this] { ExpireIdle(std::chrono::steady_clock::now()); });
  }
}

SharedMemoryRegistry::~SharedMemoryRegistry() {
  reaper_.reset();  // before anything it uses goes
  pinned_->DetachGauge();
}

absl::Status SharedMemoryRegistry::CheckEnabled() const {
  if (limits_.enabled) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "shared memory is off on this server: start it with --allow_shared_memory (same host only), or send the "
      "tensors inline");
}

void SharedMemoryRegistry::EraseLocked(Regions::iterator it) {
  const SharedMemoryRegion& r = *it->second.region;
  auto owner = object_owners_.find(r.object());
  if (owner != object_owners_.end() && --owner->second.second == 0) object_owners_.erase(owner);
  // The descriptor closes, and a locked region is unlocked and its pinned bytes given back, when
  // the last in-flight request lets go (~SharedMemoryRegion).
  regions_.Erase(it, r.byte_size());
}

void SharedMemoryRegistry::PruneVanishedLocked(const std::string& identity) {
  regions_.ForEachOf(identity, [this](Regions::iterator it) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!it->second.region->CheckStillNamed().ok()) {
      LogInfo("shared-memory region '", it->second.region->name(), "' (", it->second.region->key(),
              ") unregistered: its object was removed");
      EraseLocked(it);
    }
  });
}

absl::Status SharedMemoryRegistry::Register(const std::string& identity,
                                            const v1::RegisterSystemSharedMemoryRequest& req,
                                            const auth::UnixPeer* caller) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = CheckRegionName(req.name()); !s.ok()) return s;
  if (absl::Status s = CheckKey(req.key()); !s.ok()) return s;
  uint64_t end = 0;
  if (req.byte_size() == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (__builtin_add_overflow(req.offset(), req.byte_size(), &end) ||
      end > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", req.offset(), " + byte_size ", req.byte_size(), " overflows"));
  }
  if (req.offset() % kSharedMemoryAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", req.offset(), " is not a multiple of ", kSharedMemoryAlignment));
  }

  {
    // Refused before a descriptor is opened for it.
    MutexLock lock(&mu_);
    if (absl::Status s = CheckDescriptorBudgetLocked(); !s.ok()) return s;
  }
  // O_RDWR: outputs are written. glibc's shm_open adds O_NOFOLLOW and O_CLOEXEC, and the key is one
  // path component (CheckKey), so nothing outside /dev/shm can be named.
  // O_NONBLOCK: a FIFO placed under /dev/shm must not block the gRPC thread in open().
  const int fd = ::shm_open(req.key().c_str(), O_RDWR | O_NONBLOCK, 0);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return absl::NotFoundError(absl::StrCat("no shared-memory object ", req.key()));
    if (e == EACCES || e == EPERM) {
      return absl::PermissionDeniedError(
          absl::StrCat("the server may not open shared-memory object ", req.key(), " read-write: ", Errno(e)));
    }
    if (e == EMFILE || e == ENFILE) {
      // The process (or the system) is out of descriptors: a load to retry later, not a bad request.
      return absl::ResourceExhaustedError(absl::StrCat(
          "shm_open ", req.key(), ": ", Errno(e), ": the server has no descriptor left for another region (",
          e == EMFILE ? "this process's RLIMIT_NOFILE" : "the system's file table",
          "); unregister regions or retry later"));
    }
    return absl::FailedPreconditionError(absl::StrCat("shm_open ", req.key(), ": ", Errno(e)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(req.key(), " is not a shared-memory object"));
  }
  if (caller != nullptr && !auth::UnixPeerMayReadWrite(*caller, st)) {
    ::close(fd);
    // The server could open it; the caller could not: acting for it would make the server a
    // confused deputy (docs/security.md).
    return absl::PermissionDeniedError(absl::StrCat(
        "shared-memory object ", req.key(), " is not readable and writable by the calling process's user (uid ",
        caller->uid, "); the server registers only objects its caller could open read-write itself"));
  }
  if (static_cast<uint64_t>(st.st_size) < end) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("the region [", req.offset(), ", ", end, ") lies outside ",
                                                   req.key(), ", which is ", st.st_size, " bytes"));
  }
  auto region = std::make_shared<SharedMemoryRegion>(fd, req.name(), req.key(), req.offset(), req.byte_size(),
                                                     st.st_dev, st.st_ino);
  // Every check that can refuse the registration comes before the pages are pinned, and the
  // locked budget is taken (reserved) before they are: pinning faults in and locks every page of
  // the region, so a refused registration, or many at once, must never lock more than the budget.
  bool reserved = false;
  {
    MutexLock lock(&mu_);
    PruneVanishedLocked(identity);
    if (absl::Status s = CheckRegistrableLocked(identity, req, *region); !s.ok()) return s;
    reserved = locker_ != nullptr && pinned_->TryReserve(req.byte_size(), limits_.max_locked_bytes);
  }
  // Outside the registry's lock: pinning takes time (compute requests look regions up meanwhile).
  const bool locked = reserved && region->LockForDevice(*locker_);

  MutexLock lock(&mu_);
  // Another registration of this identity may have taken the name or the limits meanwhile.
  if (absl::Status s = CheckRegistrableLocked(identity, req, *region); !s.ok()) {
    region->Unlock();  // before its reservation goes back: the pinned bytes never exceed the budget
    if (reserved) pinned_->GiveBack(req.byte_size());
    return s;
  }
  if (reserved && !locked) pinned_->GiveBack(req.byte_size());  // not lockable: read with pread
  if (locked) region->GiveBackWhenFreed(pinned_);
  auto& held = object_owners_[region->object()];
  held.first = identity;
  held.second += 1;
  regions_.Add(identity, req.name(), std::move(region), req.byte_size());
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::CheckRegistrableLocked(const std::string& identity,
                                                          const v1::RegisterSystemSharedMemoryRequest& req,
                                                          const SharedMemoryRegion& region) const {
  if (absl::Status s = regions_.CheckNameFree(identity, req.name()); !s.ok()) return s;
  auto owner = object_owners_.find(region.object());
  if (owner != object_owners_.end() && owner->second.first != identity) {
    // Says nothing about who: only that the object is taken.
    return absl::PermissionDeniedError(
        absl::StrCat("shared-memory object ", req.key(), " is registered by another identity"));
  }
  if (absl::Status s = regions_.CheckRoomForOneMore(identity); !s.ok()) return s;
  const Regions::Usage u = regions_.usage(identity);
  if (req.byte_size() > limits_.max_bytes - u.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "registering ", req.byte_size(), " bytes would bring this identity to more than ", limits_.max_bytes,
        " registered bytes (--shared_memory_max_bytes; it has ", u.bytes, ")"));
  }
  return CheckDescriptorBudgetLocked();
}

absl::Status SharedMemoryRegistry::CheckDescriptorBudgetLocked() const {
  if (limits_.max_total_regions <= 0 || regions_.regions() < limits_.max_total_regions) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server holds ", regions_.regions(), " shared-memory regions (all identities), its descriptor budget of ",
      limits_.max_total_regions, " (", limits_.total_regions_origin,
      "): each region keeps a descriptor open; unregister regions first (or the operator raises RLIMIT_NOFILE or "
      "lowers --descriptor_reserve)"));
}

void SharedMemoryRegistry::ExpireIdle(std::chrono::steady_clock::time_point now) {
  MutexLock lock(&mu_);
  regions_.ExpireIdle(now, [this](Regions::iterator it) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    LogInfo("shared-memory region '", it->second.region->name(), "' (", it->second.region->key(),
            ") unregistered: no request used it for ", limits_.idle_seconds, " s (--shared_memory_idle_seconds)");
    EraseLocked(it);  // a request still holding it keeps its descriptor (and mapping) until done
  });
}

absl::StatusOr<v1::SystemSharedMemoryStatusResponse> SharedMemoryRegistry::Status(const std::string& identity,
                                                                                 const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (!name.empty()) {
    if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
  }
  MutexLock lock(&mu_);
  PruneVanishedLocked(identity);
  return regions_.List<v1::SystemSharedMemoryStatusResponse>(
      identity, name, [](const SharedMemoryRegion& r, v1::SystemSharedMemoryRegion* info) {
        info->set_name(r.name());
        info->set_key(r.key());
        info->set_offset(r.offset());
        info->set_byte_size(r.byte_size());
      });
}

absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> SharedMemoryRegistry::Unregister(const std::string& identity,
                                                                                         const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  MutexLock lock(&mu_);
  return regions_.Unregister<v1::UnregisterSystemSharedMemoryResponse>(
      identity, name, [this](Regions::iterator it) ABSL_NO_THREAD_SAFETY_ANALYSIS { EraseLocked(it); });
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> SharedMemoryRegistry::Lookup(const std::string& identity,
                                                                                      const std::string& name,
                                                                                      const char* tensor) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = CheckRegionName(name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': ", s.message()));
  }
  std::shared_ptr<const SharedMemoryRegion> region;
  {
    MutexLock lock(&mu_);
    absl::StatusOr<Regions::iterator> it = regions_.FindForRequest(identity, name, tensor);
    if (!it.ok()) return it.status();
    if (absl::Status s = (*it)->second.region->CheckStillNamed(); !s.ok()) {
      EraseLocked(*it);
      return absl::FailedPreconditionError(absl::StrCat("tensor '", tensor, "': ", s.message()));
    }
    region = (*it)->second.region;
  }
  if (absl::Status s = region->CheckSize(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", tensor, "': ", s.message()));
  }
  return region;
}

absl::StatusOr<ResolvedRef> CheckRange(std::shared_ptr<const SharedMemoryRegion> region, const v1::SharedMemoryRef& ref,
                                       const char* tensor) {
  if (absl::Status s = CheckRefInRegion(ref, region->offset(), region->byte_size(), tensor, "shared-memory"); !s.ok()) {
    return s;
  }
  return ResolvedRef{std::move(region), ref.offset(), ref.byte_size()};
}

absl::StatusOr<ResolvedRef> SharedMemoryRegistry::Resolve(const std::string& identity, const v1::SharedMemoryRef& ref,
                                                          const char* tensor) {
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> region = Lookup(identity, ref.region(), tensor);
  if (!region.ok()) return region.status();
  return CheckRange(*std::move(region), ref, tensor);
}

// ---- TensorTransfer ----------------------------------------------------------------------------------

void TensorTransfer::AlignedDelete::operator()(char* p) const {
  ::operator delete[](p, std::align_val_t{kSharedMemoryAlignment});
}

TensorTransfer::TensorTransfer(SharedMemoryRegistry* registry, CudaSharedMemoryRegistry* cuda, std::string identity)
    : registry_(registry), cuda_(cuda), identity_(std::move(identity)) {}

absl::StatusOr<TensorTransfer::DeviceTensor> TensorTransfer::ResolveDevice(const v1::SharedMemoryRef& ref,
                                                                           uint64_t bytes, const char* tensor,
                                                                           const char* role) {
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(role, " '", tensor, "': cuda_shared_memory.byte_size ",
                                                   ref.byte_size(), ", but its dtype and shape need ", bytes, " bytes"));
  }
  if (cuda_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(role, " '", tensor, "': CUDA shared-memory tensors are not accepted here"));
  }
  std::shared_ptr<const CudaSharedMemoryRegion> region;
  for (const auto& r : device_regions_) {
    if (r->name() == ref.region()) region = r;
  }
  if (region == nullptr) {
    absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> found = cuda_->Lookup(identity_, ref.region(), tensor);
    if (!found.ok()) return found.status();
    // A call runs on one device: its CUDA tensors must all be in memory of that GPU.
    if (!device_regions_.empty() && (*found)->device_id() != device_regions_.front()->device_id()) {
      return absl::InvalidArgumentError(absl::StrCat(
          role, " '", tensor, "': its region '", ref.region(), "' is on GPU ", (*found)->device_id(),
          ", another of this call's regions on GPU ", device_regions_.front()->device_id(),
          "; a call runs on one device"));
    }
    // One range per region: a request has at most DeviceRanges::kMax tensors.
    if (!device_ranges_.Add(DeviceRange{(*found)->device_data(), (*found)->device_data() + (*found)->byte_size()})) {
      return absl::InvalidArgumentError("a request may reference at most 16 CUDA shared-memory regions");
    }
    region = *std::move(found);
    device_regions_.push_back(region);
  }
  if (absl::Status s = CheckRefInRegion(ref, region->offset(), region->byte_size(), tensor, "CUDA shared-memory");
      !s.ok()) {
    return s;
  }
  const char* begin = region->device_data() + ref.offset();
  return DeviceTensor{region->allocation(), begin, begin + bytes, tensor, ref, nullptr};
}

namespace {
bool Overlap(const char* b1, const char* e1, const char* b2, const char* e2) { return b1 < e2 && b2 < e1; }
}  // namespace

absl::StatusOr<char*> TensorTransfer::DeviceInput(const v1::SharedMemoryRef& ref, uint64_t bytes, const char* tensor) {
  absl::StatusOr<DeviceTensor> t = ResolveDevice(ref, bytes, tensor, "tensor");
  if (!t.ok()) return t.status();
  for (const DeviceTensor& o : device_outputs_) {
    if (o.allocation == t->allocation && Overlap(o.begin, o.end, t->begin, t->end)) {
      return absl::InvalidArgumentError(absl::StrCat("input '", tensor, "' overlaps output '", o.name,
                                                     "' in CUDA shared memory; the kernels write outputs while they "
                                                     "read inputs, so they must be disjoint"));
    }
  }
  device_inputs_.push_back(*t);
  return const_cast<char*>(t->begin);
}

absl::StatusOr<char*> TensorTransfer::PlaceDeviceOutput(const v1::SharedMemoryRef& ref, v1::Tensor* tensor,
                                                        const char* name, int /*field*/, uint64_t bytes) {
  absl::StatusOr<DeviceTensor> t = ResolveDevice(ref, bytes, name, "output");
  if (!t.ok()) return t.status();
  for (const std::vector<DeviceTensor>* others : {&device_inputs_, &device_outputs_}) {
    for (const DeviceTensor& o : *others) {
      if (o.allocation == t->allocation && Overlap(o.begin, o.end, t->begin, t->end)) {
        return absl::InvalidArgumentError(
            absl::StrCat("output '", name, "' overlaps ", others == &device_inputs_ ? "input" : "output", " '",
                         o.name, "' in CUDA shared memory; the kernels write outputs while they read inputs, so "
                         "they must be disjoint"));
      }
    }
  }
  t->tensor = tensor;
  device_outputs_.push_back(*t);
  return const_cast<char*>(t->begin);
}

namespace {
// Each input starts on this boundary in the pinned block, as the lanes lay out their staging
// (LaneStaging copies a span of inputs only when every one keeps its alignment relative to the first).
constexpr uint64_t kPinnedAlign = 256;
constexpr uint64_t kMaxInputs = 8;  // the compute requests have at most 5
uint64_t AlignUp(uint64_t n) { return (n + kPinnedAlign - 1) / kPinnedAlign * kPinnedAlign; }
}  // namespace

void TensorTransfer::ReadInputsIntoPinned(HostStagingPool* pool, uint64_t input_bytes) {
  if (pool == nullptr || input_bytes == 0 || input_bytes > pool->limit_bytes()) return;
  absl::StatusOr<HostStagingPool::Lease> block = pool->TryAcquire(input_bytes + kPinnedAlign * kMaxInputs);
  if (block.ok()) pinned_ = std::move(*block);
}

// Clients' offsets are multiples of kSharedMemoryAlignment, so their inputs are always laid out
// as a lane copies them in one piece (relative offsets multiples of kOneCopyAlignment).
static_assert(kSharedMemoryAlignment % kOneCopyAlignment == 0);

bool TensorTransfer::UseInputsInPlace(const std::vector<std::pair<const char*, const v1::Tensor*>>& inputs) {
  if (registry_ == nullptr || !registry_->locks_regions() || inputs.size() > kMaxInputs) return false;
  const SharedMemoryRegion* region = nullptr;
  HostPiece pieces[kMaxInputs];
  size_t n = 0;
  uint64_t bytes = 0;
  for (const auto& [name, t] : inputs) {
    if (!t->has_shared_memory()) {
      if (t->data().empty() && t->shape_size() == 0) continue;  // absent
      return false;                                             // inline
    }
    if (!t->data().empty()) return false;  // both: decode gives the error
    absl::StatusOr<ResolvedRef> r = Resolve(t->shared_memory(), name);
    if (!r.ok()) {
      // A lookup may have dropped a vanished region: the decode's first read reports this status.
      deferred_error_ = r.status();
      return false;
    }
    if (r->region->device_visible() == nullptr || (region != nullptr && r->region.get() != region)) return false;
    region = r->region.get();
    pieces[n++] = HostPiece{region->device_visible() + r->offset, static_cast<size_t>(r->byte_size)};
    bytes += r->byte_size;
  }
  if (region == nullptr || bytes == 0) return false;
  // As the lane lays out inputs it copies in one piece (runtime/device_staging.h), and no span
  // that is mostly gaps between the inputs (the device block is the span's size).
  const HostRange span = OneCopySpan(std::span<const HostPiece>(pieces, n));
  if (span.begin == nullptr || static_cast<uint64_t>(span.end - span.begin) > 2 * bytes + 4096) return false;
  in_place_ = HostRange{span.begin, span.end, /*device_only=*/true};
  region_in_place_ = HostRange{region->device_visible(), region->device_visible() + region->byte_size(), true};
  return true;
}

HostRange TensorTransfer::pinned_inputs() const {
  if (in_place_.begin != nullptr) return in_place_;
  if (pinned_.data() == nullptr) return {};
  return HostRange{pinned_.data(), pinned_.data() + pinned_used_};
}

absl::StatusOr<ResolvedRef> TensorTransfer::Resolve(const v1::SharedMemoryRef& ref, const char* tensor) {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", tensor, "': shared-memory tensors are not accepted here"));
  }
  // One lookup (key and size checks: a stat and an fstat) per region per request, however many
  // of the request's tensors lie in it.
  for (const auto& [name, region] : regions_) {
    if (name == ref.region()) return CheckRange(region, ref, tensor);
  }
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> region = registry_->Lookup(identity_, ref.region(), tensor);
  if (!region.ok()) return region.status();
  regions_.emplace_back(ref.region(), *region);
  return CheckRange(*std::move(region), ref, tensor);
}

absl::StatusOr<char*> TensorTransfer::ReadInput(const v1::SharedMemoryRef& ref, uint64_t bytes, const char* tensor) {
  if (!deferred_error_.ok()) return deferred_error_;
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': shared_memory.byte_size ", ref.byte_size(),
                                                   ", but its dtype and shape need ", bytes, " bytes"));
  }
  absl::StatusOr<ResolvedRef> r = Resolve(ref, tensor);
  if (!r.ok()) return r.status();
  if (in_place_.begin != nullptr) {
    // Where it lies, for the device's copy only (UseInputsInPlace): nothing is read here.
    const char* p = r->region->device_visible() == nullptr ? nullptr : r->region->device_visible() + r->offset;
    if (p == nullptr || !in_place_.Contains(p, bytes)) {
      return absl::InternalError(absl::StrCat("tensor '", tensor, "': not in the inputs' page-locked span"));
    }
    return const_cast<char*>(p);
  }
  if (const uint64_t at = AlignUp(pinned_used_); pinned_.data() != nullptr && at + bytes <= pinned_.bytes()) {
    char* const data = pinned_.data() + at;
    if (absl::Status s = r->region->Read(r->offset, data, bytes, tensor); !s.ok()) return s;
    pinned_used_ = at + bytes;
    staged_bytes_ += bytes;
    return data;
  }
  // At least one byte, so an empty tensor still has a valid, aligned address.
  std::unique_ptr<char[], AlignedDelete> buf(
      static_cast<char*>(::operator new[](bytes == 0 ? 1 : bytes, std::align_val_t{kSharedMemoryAlignment})));
  if (absl::Status s = r->region->Read(r->offset, buf.get(), bytes, tensor); !s.ok()) return s;
  staged_bytes_ += bytes;
  char* data = buf.get();
  staging_.push_back(std::move(buf));
  return data;
}

absl::StatusOr<char*> TensorTransfer::PlaceOutput(const v1::SharedMemoryRef& ref, v1::Tensor* tensor, const char* name,
                                                  int field, uint64_t bytes) {
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("output '", name, "': shared_memory.byte_size ", ref.byte_size(),
                                                   ", but the output is ", bytes, " bytes"));
  }
  absl::StatusOr<ResolvedRef> r = Resolve(ref, name);
  if (!r.ok()) return r.status();
  // Two outputs over the same bytes of one object: the result would depend on the write order.
  const uint64_t begin = r->region->offset() + r->offset, end = begin + r->byte_size;
  for (const Output& o : outputs_) {
    if (o.ref.region->object() != r->region->object()) continue;
    const uint64_t ob = o.ref.region->offset() + o.ref.offset, oe = ob + o.ref.byte_size;
    if (begin < oe && ob < end) {
      return absl::InvalidArgumentError(absl::StrCat("outputs '", o.name, "' and '", name,
                                                     "' overlap in shared memory; outputs must be disjoint"));
    }
  }
  // In the region the inputs are used in place from: the device writes it there (after it read the
  // inputs: one lane, in order, so an output may overlap an input as with pwrite).
  char* in_place = nullptr;
  if (region_in_place_.begin != nullptr && r->region->device_visible() == region_in_place_.begin) {
    in_place = const_cast<char*>(r->region->device_visible() + r->offset);
    outputs_in_place_ = true;
  }
  outputs_.push_back(Output{*std::move(r), ref, tensor, name, field, in_place});
  return in_place;
}

absl::Status TensorTransfer::WriteOutputs(OutputBuffers* external) {
  // Every region an output goes to, once: still named by its key, still whole.
  for (size_t i = 0; i < outputs_.size(); ++i) {
    bool seen = false;
    for (size_t j = 0; j < i; ++j) seen = seen || outputs_[j].ref.region == outputs_[i].ref.region;
    if (seen) continue;
    if (absl::Status s = outputs_[i].ref.region->CheckStillNamed(); !s.ok()) return s;
    if (absl::Status s = outputs_[i].ref.region->CheckSize(); !s.ok()) return s;
  }
  for (const Output& o : outputs_) {
    if (o.in_place != nullptr) continue;  // the device wrote it there (its region checked above)
    // On a GPU lane the call's buffer is the lane's lent page-locked block (runtime/output_buffers.h):
    // the output goes from there to the object with no copy in between.
    const OutputBuffers::Buffer* buffer = external != nullptr ? external->Find(o.field) : nullptr;
    const char* data = buffer != nullptr ? buffer->data : o.tensor->data().data();
    const uint64_t have = buffer != nullptr ? buffer->bytes : o.tensor->data().size();
    if (have != o.ref.byte_size) {
      return absl::InternalError(absl::StrCat("output '", o.name, "' has ", have, " bytes, placed as ", o.ref.byte_size));
    }
    // A shrink between the check and the write makes pwrite extend the object again, by at most the
    // registered region, which the identity's byte limit already bounds; the server never faults.
    if (absl::Status s = o.ref.region->Write(o.ref.offset, data, o.ref.byte_size, o.name); !s.ok()) return s;
  }
  for (Output& o : outputs_) {
    if (external != nullptr) external->Remove(o.field);
    o.tensor->clear_data();
    *o.tensor->mutable_shared_memory() = o.proto;
  }
  // The kernels wrote them where they lie (the lane's Wait() returned before this).
  for (DeviceTensor& o : device_outputs_) *o.tensor->mutable_cuda_shared_memory() = o.proto;
  return absl::OkStatus();
}

// ---- request helpers ----------------------------------------------------------------------------------

namespace {
uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
// What will be staged is at most min(byte_size, what the shape needs): a tensor is read only when
// the two agree (else INVALID_ARGUMENT before any read), so neither number alone, whichever a client
// inflates, turns a wrong reference into RESOURCE_EXHAUSTED.
uint64_t InputBytes(std::initializer_list<const v1::Tensor*> ts) {
  uint64_t sum = 0;
  for (const v1::Tensor* t : ts) {
    if (!t->has_shared_memory()) continue;
    uint64_t shape_bytes = 4;  // the widest dtype; the real one is checked at decode
    for (int64_t d : t->shape()) {
      if (d < 0 || __builtin_mul_overflow(shape_bytes, static_cast<uint64_t>(d), &shape_bytes)) {
        shape_bytes = UINT64_MAX;
        break;
      }
    }
    sum = SaturatingAdd(sum, std::min(shape_bytes, t->shared_memory().byte_size()));
  }
  return sum;
}
}  // namespace

namespace {
bool OutsideMessage(const v1::Tensor& t) { return t.has_shared_memory() || t.has_cuda_shared_memory(); }
}  // namespace

bool UsesSharedMemory(const v1::MhcSeamRequest& r) {
  return r.output_placements_size() > 0 || OutsideMessage(r.x()) || OutsideMessage(r.residual()) ||
         OutsideMessage(r.post_mix()) || OutsideMessage(r.comb_mix()) || OutsideMessage(r.pre_mix());
}
bool UsesSharedMemory(const v1::SwaNormQuantRequest& r) {
  return r.output_placements_size() > 0 || OutsideMessage(r.qr_kv());
}
uint64_t SharedMemoryInputBytes(const v1::MhcSeamRequest& r) {
  return InputBytes({&r.x(), &r.residual(), &r.post_mix(), &r.comb_mix(), &r.pre_mix()});
}
uint64_t SharedMemoryInputBytes(const v1::SwaNormQuantRequest& r) { return InputBytes({&r.qr_kv()}); }

std::vector<std::pair<const char*, const v1::Tensor*>> InputTensors(const v1::MhcSeamRequest& r) {
  return {{"x", &r.x()}, {"residual", &r.residual()}, {"post_mix", &r.post_mix()}, {"comb_mix", &r.comb_mix()},
          {"pre_mix", &r.pre_mix()}};
}
std::vector<std::pair<const char*, const v1::Tensor*>> InputTensors(const v1::SwaNormQuantRequest& r) {
  return {{"qr_kv", &r.qr_kv()}};
}

}  // namespace fusedlayer::server::transport
