#include "runtime/parallel_copy.h"

#include <algorithm>
#include <cstring>

#include "runtime/streaming_copy.h"

namespace fusedlayer::server {

struct ParallelCopy::Call {
  int pending = 0;  // shares handed to the queue and not finished (mu_)
  bool streaming = false;  // into pinned staging, and large enough for streaming stores
};

ParallelCopy::ParallelCopy(int helper_threads) {
  for (int i = 0; i < helper_threads; ++i) threads_.emplace_back([this] { Work(); });
}

ParallelCopy::~ParallelCopy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int ParallelCopy::AutoHelperThreads(unsigned cores) { return cores < 4 ? 0 : static_cast<int>(std::min(7u, cores / 2)); }

size_t ParallelCopy::helper_shares() const {
  std::lock_guard<std::mutex> lock(mu_);
  return helper_shares_;
}

void ParallelCopy::Run(const Share& s) {
  if (!s.call->streaming) {
    for (const Piece* p = s.begin; p != s.end; ++p) std::memcpy(p->dst, p->src, p->n);
    return;
  }
  for (const Piece* p = s.begin; p != s.end; ++p) StreamingCopy(p->dst, p->src, p->n);
  // Before the share is reported done (a helper's unlock, or the caller's return): the streaming
  // stores are not ordered by a lock's release.
  StreamingCopyFence();
}

void ParallelCopy::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const Share s = queue_.front();
    queue_.pop_front();
    lock.unlock();
    Run(s);
    lock.lock();
    ++helper_shares_;
    --s.call->pending;
    done_.notify_all();
  }
}

void ParallelCopy::Copy(void* dst, const void* src, size_t n, Destination to) {
  CopyPieces({Piece{static_cast<char*>(dst), static_cast<const char*>(src), n}}, to);
}

void ParallelCopy::CopyPieces(const std::vector<Piece>& pieces, Destination to) {
  size_t total = 0;
  for (const Piece& p : pieces) total += p.n;
  Call call;
  call.streaming = to == Destination::kPinnedStaging && total >= kMinStreamingBytes;
  // One split call at a time (see the header).
  bool split = !threads_.empty() && total >= kMinSplitBytes;
  if (split) {
    std::lock_guard<std::mutex> lock(mu_);
    split = splitting_ == 0;
    if (split) {
      ++splitting_;
      ++split_calls_;
    }
  }
  if (!split) {
    Run(Share{pieces.data(), pieces.data() + pieces.size(), &call});
    return;
  }
  const size_t parts = threads_.size() + 1;
  // Shares of about total / parts bytes; a piece that is larger is cut on 4 KiB boundaries (whole
  // pages and cache lines) so that it spreads over several shares.
  constexpr size_t kAlign = 4096;
  const size_t share = (total / parts + kAlign - 1) / kAlign * kAlign;
  std::vector<Piece> cut;
  cut.reserve(pieces.size() + parts);
  for (const Piece& p : pieces) {
    for (size_t off = 0; off < p.n; off += share) cut.push_back(Piece{p.dst + off, p.src + off, std::min(share, p.n - off)});
  }
  // Consecutive pieces grouped into shares; the caller's is the first.
  std::vector<Share> shares;
  size_t in_share = 0;
  const Piece* first = cut.data();
  for (const Piece* p = cut.data(); p != cut.data() + cut.size(); ++p) {
    in_share += p->n;
    if (in_share >= share) {
      shares.push_back(Share{first, p + 1, &call});
      first = p + 1;
      in_share = 0;
    }
  }
  if (first != cut.data() + cut.size()) shares.push_back(Share{first, cut.data() + cut.size(), &call});
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 1; i < shares.size(); ++i) {
      queue_.push_back(shares[i]);
      ++call.pending;
    }
  }
  work_.notify_all();
  Run(shares.front());
  std::unique_lock<std::mutex> lock(mu_);
  // Shares of this call that no helper has taken yet: copy them here rather than wait.
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->call != &call) {
      ++it;
      continue;
    }
    const Share mine = *it;
    it = queue_.erase(it);
    lock.unlock();
    Run(mine);
    lock.lock();
    --call.pending;
    it = queue_.begin();  // the queue may have changed while unlocked
  }
  done_.wait(lock, [&call] { return call.pending == 0; });
  --splitting_;
}

size_t ParallelCopy::split_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return split_calls_;
}

ParallelCopy::SplitInProgressForTest::SplitInProgressForTest(ParallelCopy& copier) : copier_(copier) {
  std::lock_guard<std::mutex> lock(copier_.mu_);
  ++copier_.splitting_;
}

ParallelCopy::SplitInProgressForTest::~SplitInProgressForTest() {
  std::lock_guard<std::mutex> lock(copier_.mu_);
  --copier_.splitting_;
}

}  // namespace fusedlayer::server
