#include "exec/weight_store.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server {

absl::Status WeightStore::NotFound(std::string_view name) const {
  std::string loaded;
  for (const auto& [n, s] : sets_) absl::StrAppend(&loaded, loaded.empty() ? "" : ", ", n);
  // The name is the client's, not validated: bounded and escaped (no forged lines in logs or messages).
  return absl::NotFoundError(absl::StrCat("weight set \"", absl::CHexEscape(AbslView(name.substr(0, 160))),
                                          name.size() > 160 ? "...\"" : "\"", " is not loaded (loaded: ",
                                          loaded.empty() ? "none" : loaded, ")"));
}

absl::StatusOr<std::shared_ptr<const WeightSet>> WeightStore::Get(std::string_view name) const {
  ReaderMutexLock lock(&mu_);
  auto it = sets_.find(name);
  if (it == sets_.end()) return NotFound(name);
  return it->second;
}

absl::StatusOr<std::shared_ptr<const WeightSet>> WeightStore::Publish(std::shared_ptr<const WeightSet> set,
                                                                      bool replace) {
  if (set == nullptr) return absl::InvalidArgumentError("cannot publish a null weight set");
  std::shared_ptr<const WeightSet> previous;
  {
    MutexLock lock(&mu_);
    auto it = sets_.find(set->name);
    if (it != sets_.end()) {
      if (!replace) {
        return absl::AlreadyExistsError(absl::StrCat("weight set \"", set->name,
                                                     "\" is already loaded (set replace to swap it)"));
      }
      resident_bytes_ -= it->second->resident_bytes;
      resident_bytes_ += set->resident_bytes;
      previous = std::exchange(it->second, std::move(set));
    } else {
      resident_bytes_ += set->resident_bytes;
      const std::string name = set->name;
      sets_.emplace(name, std::move(set));
    }
  }
  // `previous` is returned, so if the caller drops it the old set is freed outside the lock.
  return previous;
}

absl::StatusOr<std::vector<std::shared_ptr<const WeightSet>>> WeightStore::PublishGroup(std::vector<Staged> sets) {
  std::vector<std::shared_ptr<const WeightSet>> previous;
  MutexLock lock(&mu_);
  // Every check before the first change: a refusal leaves the store as it was.
  for (size_t i = 0; i < sets.size(); ++i) {
    if (sets[i].set == nullptr) return absl::InvalidArgumentError("cannot publish a null weight set");
    for (size_t j = 0; j < i; ++j) {
      if (sets[j].set->name == sets[i].set->name) {
        return absl::InvalidArgumentError(
            absl::StrCat("weight set \"", sets[i].set->name, "\" appears twice in one group"));
      }
    }
    if (!sets[i].replace && sets_.find(sets[i].set->name) != sets_.end()) {
      return absl::AlreadyExistsError(absl::StrCat("weight set \"", sets[i].set->name,
                                                   "\" is already loaded (set replace to swap it)"));
    }
  }
  for (Staged& staged : sets) {
    std::shared_ptr<const WeightSet>& slot = sets_[staged.set->name];
    if (slot != nullptr) {
      resident_bytes_ -= slot->resident_bytes;
      previous.push_back(std::exchange(slot, nullptr));
    }
    resident_bytes_ += staged.set->resident_bytes;
    slot = std::move(staged.set);
  }
  return previous;
}

absl::StatusOr<uint64_t> WeightStore::Unload(std::string_view name) {
  std::shared_ptr<const WeightSet> removed;  // destroyed after the lock is released
  MutexLock lock(&mu_);
  auto it = sets_.find(name);
  if (it == sets_.end()) return NotFound(name);
  removed = std::move(it->second);
  sets_.erase(it);
  resident_bytes_ -= removed->resident_bytes;
  return removed->resident_bytes;
}

std::vector<std::shared_ptr<const WeightSet>> WeightStore::List() const {
  ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<const WeightSet>> out;
  out.reserve(sets_.size());
  for (const auto& [n, s] : sets_) out.push_back(s);
  return out;
}

uint64_t WeightStore::resident_bytes() const {
  ReaderMutexLock lock(&mu_);
  return resident_bytes_;
}

size_t WeightStore::size() const {
  ReaderMutexLock lock(&mu_);
  return sets_.size();
}

}  // namespace fusedlayer::server
