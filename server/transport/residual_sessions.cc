#include "transport/residual_sessions.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace fusedlayer::server::transport {
namespace {

constexpr size_t kMaxNameLength = 128;
// Each tensor of a copy starts on this boundary (the kernels' vector loads; cudaMalloc gives 256).
constexpr size_t kTensorAlign = 256;

size_t AlignUp(size_t n) { return (n + kTensorAlign - 1) / kTensorAlign * kTensorAlign; }

absl::Status CheckName(const std::string& name) {
  bool ok = !name.empty() && name.size() <= kMaxNameLength;
  for (char c : name) {
    ok = ok && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("session name '", ClientString(name), "' is not 1 to 128 characters of [A-Za-z0-9._-]"));
  }
  return absl::OkStatus();
}

// Bytes of one copy of the state: R, then pre, post and comb, each on its own aligned offset.
struct CopyLayout {
  size_t residual = 0, pre = 0, post = 0, comb = 0, total = 0;
};
CopyLayout LayOut(const ResidualSessionShape& s) {
  const size_t T = static_cast<size_t>(s.tokens), n = static_cast<size_t>(s.hc_mult),
               C = static_cast<size_t>(s.hidden);
  CopyLayout l;
  l.residual = 0;
  l.pre = AlignUp(T * n * C * 2);
  l.post = l.pre + AlignUp(T * n * 4);
  l.comb = l.post + AlignUp(T * n * 4);
  l.total = l.comb + AlignUp(T * n * n * 4);
  return l;
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// ---- ResidualSession ----------------------------------------------------------------------------------

ResidualSession::ResidualSession(std::string identity, std::string name, ResidualSessionShape shape,
                                 DeviceBuffer block, size_t copy_bytes, size_t device)
    : identity_(std::move(identity)),
      name_(std::move(name)),
      shape_(shape),
      block_(std::move(block)),
      copy_bytes_(copy_bytes),
      device_(device),
      last_used_(std::chrono::steady_clock::now()) {}

ResidualState ResidualSession::State(int which) const {
  const CopyLayout l = LayOut(shape_);
  char* base = static_cast<char*>(block_.data()) + static_cast<size_t>(which) * copy_bytes_;
  const int64_t T = shape_.tokens, n = shape_.hc_mult, C = shape_.hidden;
  ResidualState s;
  s.residual = TensorView::Contiguous(base + l.residual, DType::kBF16, {T, n, C});
  s.pre_mix = TensorView::Contiguous(base + l.pre, DType::kFP32, {T, n});
  s.post_mix = TensorView::Contiguous(base + l.post, DType::kFP32, {T, n});
  s.comb_mix = TensorView::Contiguous(base + l.comb, DType::kFP32, {T, n, n});
  return s;
}

DeviceRange ResidualSession::memory() const {
  const char* b = static_cast<const char*>(block_.data());
  return DeviceRange{b, b + block_.bytes()};
}

// ---- ResidualSessionStore -----------------------------------------------------------------------------

ResidualSessionStore::ResidualSessionStore(ResidualSessionLimits limits, std::vector<Backend*> backends,
                                           prometheus::Registry& metrics)
    : limits_(limits), backends_(std::move(backends)), metrics_(ResidualSessionMetrics::Register(metrics)) {
  // Last: the reaper may run as soon as it exists.
  if (enabled()) {
    reaper_.emplace(ReaperPeriod(limits_.idle_seconds), [this] { CloseIdle(std::chrono::steady_clock::now()); });
  }
}

ResidualSessionStore::~ResidualSessionStore() = default;  // reaper_, declared last, stops first

absl::Status ResidualSessionStore::CheckEnabled() const {
  if (enabled()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "residual sessions are off on this server (--residual_session_max_sessions=0); send the residual and mixes "
      "inline");
}

void ResidualSessionStore::UpdateGaugesLocked() {
  metrics_.sessions->Set(static_cast<double>(total_sessions_));
  metrics_.bytes->Set(static_cast<double>(total_bytes_));
}

void ResidualSessionStore::EraseLocked(std::map<Key, std::shared_ptr<ResidualSession>>::iterator it) {
  ResidualSession& s = *it->second;
  s.closed_ = true;
  // A call holding the session still uses its block: the bytes (and the session) stay counted
  // against the identity and the server until that call releases it (Lease::Release).
  if (s.busy_) {
    s.uncount_on_release_ = true;
  } else {
    CountLocked(it->first.first, /*add=*/false, s.bytes());
  }
  sessions_.erase(it);
}

absl::Status ResidualSessionStore::TotalExhausted(const std::string& name, uint64_t bytes) const {
  return absl::ResourceExhaustedError(absl::StrCat("residual session '", name, "' needs ", bytes,
                                                   " bytes; the server's sessions (all identities) are at their limit (",
                                                   limits_.total_bytes, " bytes, --residual_session_total_bytes); "
                                                   "retry later"));
}

absl::StatusOr<uint64_t> ResidualSessionStore::Open(const std::string& identity, const std::string& name,
                                                    ResidualSessionShape shape, size_t device) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (device >= backends_.size()) return absl::InvalidArgumentError("no such device for a residual session");
  Backend& backend = *backends_[device];
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (shape.tokens < 1 || shape.tokens > limits_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens must be in [1, ", limits_.max_tokens,
                                                   "] (--max_tokens), got ", shape.tokens));
  }
  if (shape.hc_mult < 1 || shape.hc_mult > 8) {
    return absl::InvalidArgumentError(absl::StrCat("hc_mult must be in [1, 8], got ", shape.hc_mult));
  }
  if (shape.hidden < 1 || shape.hidden > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("hidden must be in [1, 1048576], got ", shape.hidden));
  }
  // T <= 2^20 (max_tokens), n <= 8, C <= 2^20: the sizes below cannot overflow 64 bits.
  const CopyLayout layout = LayOut(shape);
  const uint64_t bytes = 2 * static_cast<uint64_t>(layout.total);
  const Key key{identity, name};
  {
    MutexLock lock(&mu_);
    if (sessions_.count(key) != 0 || opening_.count(key) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("residual session '", name,
                                                   "' is already open; close it first or use another name"));
    }
    const Usage u = usage_.count(identity) != 0 ? usage_[identity] : Usage{};
    if (u.sessions + 1 > limits_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat("this identity already has ", u.sessions,
                                                       " residual sessions open, the limit "
                                                       "(--residual_session_max_sessions); close one first"));
    }
    if (bytes > limits_.max_bytes || u.bytes > limits_.max_bytes - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "residual session '", name, "' needs ", bytes, " bytes; this identity holds ", u.bytes, " of its ",
          limits_.max_bytes, " (--residual_session_max_bytes)"));
    }
    if (!FitsTotalLocked(bytes)) return TotalExhausted(name, bytes);
    // The name, a session and the bytes are taken before the allocation (outside the mutex: it may
    // take a while), so that opens racing for the same budget never allocate beyond it.
    opening_.insert(key);
    CountLocked(identity, /*add=*/true, bytes);
  }
  absl::Status failed;
  absl::StatusOr<DeviceBuffer> block = backend.Allocate(bytes);
  if (!block.ok()) {
    failed = absl::ResourceExhaustedError(
        absl::StrCat("residual session '", name, "': ", bytes, " bytes of backend memory: ", block.status().message()));
  } else {
    // A synchronous copy on the backend's default context: on a GPU it returns after the
    // stream-ordered allocation above is complete, so a lane may use the block from now on.
    const uint64_t zero[8] = {};
    failed = backend.CopyToDevice(block->data(), zero, sizeof(zero));
  }
  std::shared_ptr<ResidualSession> session;
  if (failed.ok()) session = std::make_shared<ResidualSession>(identity, name, shape, std::move(*block), layout.total, device);
  MutexLock lock(&mu_);
  opening_.erase(key);
  if (!failed.ok()) {
    CountLocked(identity, /*add=*/false, bytes);  // given back (the block, if any, is freed after the lock)
    return failed;
  }
  sessions_.emplace(key, std::move(session));
  UpdateGaugesLocked();
  return bytes;
}

void ResidualSessionStore::CountLocked(const std::string& identity, bool add, uint64_t bytes) {
  Usage& u = usage_[identity];
  if (add) {
    u.sessions += 1;
    u.bytes += bytes;
    total_sessions_ += 1;
    total_bytes_ += bytes;
  } else {
    u.sessions -= 1;
    u.bytes -= bytes;
    total_sessions_ -= 1;
    total_bytes_ -= bytes;
  }
  if (u.sessions == 0) usage_.erase(identity);
  UpdateGaugesLocked();
}

std::vector<ResidualSessionInfo> ResidualSessionStore::List(const std::string& identity) {
  const auto now = std::chrono::steady_clock::now();
  std::vector<ResidualSessionInfo> out;
  MutexLock lock(&mu_);
  for (auto it = sessions_.lower_bound({identity, std::string()}); it != sessions_.end() && it->first.first == identity;
       ++it) {
    const ResidualSession& s = *it->second;
    out.push_back(ResidualSessionInfo{s.name(), s.shape(), s.bytes(), s.has_residual_, s.has_mixes_, s.calls_,
                                      Seconds(now - s.last_used_), s.last_weight_set_, s.device()});
  }
  return out;
}

absl::StatusOr<std::pair<uint32_t, uint64_t>> ResidualSessionStore::Close(const std::string& identity,
                                                                          const std::string& name) {
  if (!name.empty()) {
    if (absl::Status s = CheckName(name); !s.ok()) return s;
  }
  std::vector<std::shared_ptr<ResidualSession>> freed;  // released after the mutex
  uint32_t closed = 0;
  uint64_t bytes = 0;
  {
    MutexLock lock(&mu_);
    for (auto it = sessions_.lower_bound({identity, name.empty() ? std::string() : name});
         it != sessions_.end() && it->first.first == identity && (name.empty() || it->first.second == name);) {
      closed += 1;
      bytes += it->second->bytes();
      freed.push_back(it->second);
      EraseLocked(it++);
    }
  }
  if (!name.empty() && closed == 0) {
    return absl::NotFoundError(absl::StrCat("no residual session '", name, "' is open for this identity"));
  }
  return std::pair{closed, bytes};
}

void ResidualSessionStore::CloseUsing(const std::string& weight_set) {
  std::vector<std::shared_ptr<ResidualSession>> freed;
  MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->weight_sets_.count(weight_set) != 0) {
      LogInfo("residual session '", it->first.second, "' closed: weight set '", weight_set, "' was unloaded");
      freed.push_back(it->second);
      EraseLocked(it++);
    } else {
      ++it;
    }
  }
}

void ResidualSessionStore::CloseIdle(std::chrono::steady_clock::time_point now) {
  std::vector<std::shared_ptr<ResidualSession>> freed;
  MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const ResidualSession& s = *it->second;
    if (!s.busy_ && Seconds(now - s.last_used_) >= limits_.idle_seconds) {
      LogInfo("residual session '", it->first.second, "' closed after ", limits_.idle_seconds,
              " s without a call (--residual_session_idle_seconds)");
      freed.push_back(it->second);
      EraseLocked(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<ResidualSessionStore::Lease> ResidualSessionStore::Acquire(const std::string& identity,
                                                                          const std::string& name,
                                                                          const std::string& weight_set) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  MutexLock lock(&mu_);
  auto it = sessions_.find({identity, name});
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no residual session '", name,
                                            "' is open for this identity (OpenResidualSession; sessions idle for "
                                            "--residual_session_idle_seconds are closed)"));
  }
  ResidualSession& s = *it->second;
  if (s.busy_) {
    return absl::AbortedError(absl::StrCat("residual session '", name,
                                           "' is in use by another call; calls of one session must be serial"));
  }
  s.busy_ = true;
  s.last_used_ = std::chrono::steady_clock::now();
  Lease lease;
  lease.store_ = this;
  lease.session_ = it->second;
  // Recorded now, not at commit: an unload of the set while this call runs must find the session.
  lease.weight_set_ = weight_set;
  lease.weight_set_added_ = s.weight_sets_.insert(weight_set).second;
  lease.has_residual_ = s.has_residual_;
  lease.has_mixes_ = s.has_mixes_;
  lease.current_state_ = s.State(s.current_);
  lease.next_state_ = s.State(1 - s.current_);
  return lease;
}

// ---- Lease ----------------------------------------------------------------------------------------------

ResidualSessionStore::Lease& ResidualSessionStore::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = std::exchange(o.store_, nullptr);
    session_ = std::move(o.session_);
    weight_set_ = std::move(o.weight_set_);
    weight_set_added_ = o.weight_set_added_;
    committed_ = o.committed_;
    has_residual_ = o.has_residual_;
    has_mixes_ = o.has_mixes_;
    current_state_ = o.current_state_;
    next_state_ = o.next_state_;
  }
  return *this;
}

void ResidualSessionStore::Lease::Commit(bool has_mixes) {
  if (session_ == nullptr) return;
  MutexLock lock(&store_->mu_);
  ResidualSession& s = *session_;
  if (s.closed_) return;  // closed meanwhile: nobody will read the state
  s.current_ = 1 - s.current_;
  s.has_residual_ = true;
  s.has_mixes_ = has_mixes;
  s.calls_ += 1;
  s.last_weight_set_ = weight_set_;
  committed_ = true;
}

void ResidualSessionStore::Lease::Release() {
  if (session_ == nullptr) return;
  bool uncount = false;
  {
    MutexLock lock(&store_->mu_);
    session_->busy_ = false;
    session_->last_used_ = std::chrono::steady_clock::now();
    // A failed call's set was not used by the session's state.
    if (weight_set_added_ && !committed_) session_->weight_sets_.erase(weight_set_);
    uncount = std::exchange(session_->uncount_on_release_, false);
  }
  // Copied only for the rare closed-while-held case: every session call releases here.
  const std::string identity = uncount ? session_->identity() : std::string();
  const uint64_t bytes = uncount ? session_->bytes() : 0;
  // The last reference of a session closed meanwhile frees its block here, after the call's work
  // is done (the lane waited before the call's response); its bytes are given back after that.
  session_.reset();
  if (uncount) {
    MutexLock lock(&store_->mu_);
    store_->CountLocked(identity, /*add=*/false, bytes);
  }
  store_ = nullptr;
}

}  // namespace fusedlayer::server::transport
