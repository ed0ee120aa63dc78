// libFuzzer target: ParseSafetensors on arbitrary bytes. The parser must return a status for every
// input (never crash, read out of bounds or leak), and what it accepts must satisfy the invariants
// the weight loader relies on: the data section is the rest of the file and every tensor's byte
// range lies inside it with the size its dtype and shape give.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "weights/safetensors.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors: accepted input violates: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<fusedlayer::server::SafetensorsIndex> index = fusedlayer::server::ParseSafetensors(bytes, "fuzz");
  if (!index.ok()) {
    if (index.status().message().empty()) Fail("an error without a message");
    return 0;
  }
  if (index->data_offset < 8 || index->data_offset > size) Fail("data_offset inside the file");
  if (index->data_offset + index->data_bytes != size) Fail("data section = rest of the file");
  uint64_t covered = 0;
  for (const auto& [name, t] : index->tensors) {
    if (name != t.name) Fail("map key = tensor name");
    if (t.begin > t.end || t.end > index->data_bytes) Fail("tensor range inside the data section");
    if (t.numel() < 0) Fail("non-negative element count");
    for (int64_t d : t.shape) {
      if (d < 0) Fail("non-negative dimensions");
    }
    covered += t.bytes();
    // Lookups go through the same index the loader uses.
    if (!index->Find(name).ok()) Fail("Find() finds every tensor");
  }
  // The format requires the data section to be fully indexed, without overlaps.
  if (covered != index->data_bytes) Fail("tensors cover the data section exactly");
  return 0;
}
