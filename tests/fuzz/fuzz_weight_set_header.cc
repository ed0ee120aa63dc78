// libFuzzer target: a WeightSetHeader, as a LoadWeights client sends it, given to the weight-set
// builder (BuildWeightSet on the CPU backend) with a real payload: the fuzzer mutates names,
// hyper-parameters, tensor names, dtypes, shapes, offsets and lengths, payload_bytes and sha256
// against the bytes of the fixture's small weight set, the way a hostile admin client could.
//
// Input: byte 0 selects the payload (bit 0: SmallPackedSet variant 0 or 1) and bit 1 clears the
// header's sha256 (so mutations of the tensor table are not all stopped by the integrity check, as
// for a manifest, where sha256 is optional); the rest is the serialized header.
// The builder must return a status for every header; an error must say what is wrong, and a set
// it accepts must be self-consistent (its name, a part present, resident bytes counted).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "fusedlayer/backend.h"
#include "fuzz_weights_fixture.h"
#include "weights/weight_set.h"

namespace {

struct Fixture {
  std::unique_ptr<fusedlayer::Backend> cpu;
  fusedlayer::server::PackedWeightSet sets[2];
};

Fixture* MakeFixture() {
  auto* f = new Fixture;
  f->cpu = fusedlayer::CreateCpuBackend({.num_threads = 1});
  f->sets[0] = fusedlayer::fuzz::SmallPackedSet(0);
  f->sets[1] = fusedlayer::fuzz::SmallPackedSet(1);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* const fx = MakeFixture();  // lives for the process
  if (size < 1) return -1;
  const uint8_t selector = data[0];
  fusedlayer::v1::WeightSetHeader header;
  if (!header.ParseFromArray(data + 1, static_cast<int>(size - 1))) return -1;  // not a header: not kept
  if (selector & 2) header.clear_sha256();
  const std::string& payload = fx->sets[selector & 1].second;
  absl::StatusOr<std::shared_ptr<const fusedlayer::server::WeightSet>> set =
      fusedlayer::server::BuildWeightSet(*fx->cpu, header, payload, "rpc");
  if (!set.ok()) {
    if (set.status().message().empty()) std::abort();  // every error must say what is wrong
    return 0;
  }
  const fusedlayer::server::WeightSet& s = **set;
  if (s.name != header.name() || (!s.has_mhc() && !s.has_swa()) || s.resident_bytes == 0) {
    std::fprintf(stderr, "fuzz_weight_set_header: accepted set '%s' is inconsistent (mhc %d swa %d, %llu bytes)\n",
                 s.name.c_str(), s.has_mhc(), s.has_swa(), static_cast<unsigned long long>(s.resident_bytes));
    std::abort();
  }
  return 0;
}
