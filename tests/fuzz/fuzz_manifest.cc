// libFuzzer target: LoadManifestFromString on arbitrary text, resolved against a temp directory
// holding small valid safetensors files (mhc.safetensors, swa.safetensors, swa_fnuz.safetensors,
// empty.safetensors with no tensors; names absent from the directory exercise the "no file" paths).
// The loader must return a status for every input; what it accepts is then built on the CPU backend
// (BuildWeightSet validates shapes, dtypes and hyper-parameters), which must also never crash.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "fusedlayer/backend.h"
#include "fuzz_weights_fixture.h"
#include "weights/manifest.h"
#include "weights/safetensors_writer.h"
#include "weights/weight_set.h"

namespace {

using fusedlayer::server::SafetensorsEntry;

struct Fixture {
  std::string dir;
  std::unique_ptr<fusedlayer::Backend> cpu;
};

void Write(const std::string& path, const std::vector<SafetensorsEntry>& entries) {
  absl::Status s = fusedlayer::server::WriteSafetensors(path, entries, {{"format", "pt"}});
  if (!s.ok()) {
    std::fprintf(stderr, "fuzz_manifest: writing %s failed: %s\n", path.c_str(), s.ToString().c_str());
    std::abort();
  }
}

const std::string* g_fixture_dir = nullptr;

// The fixture directory is removed when the fuzzer exits normally (-max_total_time, -runs); after a
// crash it stays, next to the reproducer, for inspection.
void RemoveFixtureDir() {
  if (g_fixture_dir == nullptr) return;
  for (const char* f : {"mhc.safetensors", "swa.safetensors", "swa_fnuz.safetensors", "empty.safetensors"}) {
    std::remove((*g_fixture_dir + "/" + f).c_str());
  }
  std::remove(g_fixture_dir->c_str());
}

Fixture* MakeFixture() {
  auto* f = new Fixture;
  f->dir = fusedlayer::fuzz::MakeTempDir("fuzz_manifest.");
  std::vector<SafetensorsEntry> mhc, swa, swa_fnuz;
  for (SafetensorsEntry& e : fusedlayer::fuzz::SmallSetEntries(false)) {
    (e.name.rfind("mhc.", 0) == 0 ? mhc : swa).push_back(std::move(e));
  }
  for (SafetensorsEntry& e : fusedlayer::fuzz::SmallSetEntries(true)) {
    if (e.name.rfind("swa.", 0) == 0) swa_fnuz.push_back(std::move(e));
  }
  Write(f->dir + "/mhc.safetensors", mhc);
  Write(f->dir + "/swa.safetensors", swa);
  Write(f->dir + "/swa_fnuz.safetensors", swa_fnuz);
  Write(f->dir + "/empty.safetensors", {});
  f->cpu = fusedlayer::CreateCpuBackend({.num_threads = 1});
  g_fixture_dir = &f->dir;
  std::atexit(RemoveFixtureDir);
  return f;
}

// The fuzzer must not steer the loader at device files, procfs or directories outside the fixture
// (a read of /dev/stdin blocks, /proc files change between runs and break reproducibility).
// Relative names resolve inside the fixture; absolute ones and escapes that could spell them are
// skipped. Manifest parsing itself (JSON, keys, types, names) is unaffected by this filter.
bool SafeToLoad(std::string_view text) {
  for (std::string_view bad : {"/dev", "/proc", "/sys", "/run", "..", "\\u", "\\/"}) {
    if (text.find(bad) != std::string_view::npos) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* const fx = MakeFixture();  // lives for the process; the temp dir is tiny
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (!SafeToLoad(text)) return -1;  // -1: not added to the corpus
  absl::StatusOr<std::vector<fusedlayer::server::PackedWeightSet>> sets =
      fusedlayer::server::LoadManifestFromString(text, fx->dir, "fuzz.json");
  if (!sets.ok()) {
    if (sets.status().message().empty()) std::abort();  // every error must say what is wrong
    return 0;
  }
  for (const fusedlayer::server::PackedWeightSet& set : *sets) {
    if (set.first.payload_bytes() != set.second.size()) {
      std::fprintf(stderr, "fuzz_manifest: payload_bytes %llu != payload size %zu\n",
                   static_cast<unsigned long long>(set.first.payload_bytes()), set.second.size());
      std::abort();
    }
    // Accepted or not, building must only ever return a status.
    (void)fusedlayer::server::BuildWeightSet(*fx->cpu, set.first, set.second, "manifest:fuzz.json");
  }
  return 0;
}
