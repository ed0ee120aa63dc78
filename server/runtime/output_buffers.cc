#include "runtime/output_buffers.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace fusedlayer::server {

char* OutputBuffers::Add(int field, size_t bytes) {
  if (std::find(elsewhere_.begin(), elsewhere_.end(), field) != elsewhere_.end()) return nullptr;
  // new char[] leaves the bytes uninitialised (make_shared<char[]> would zero them: the work
  // this class exists to avoid). One byte at least, so an empty output still has a distinct,
  // valid address like an empty std::string's.
  std::shared_ptr<char[]> block(new char[bytes == 0 ? 1 : bytes]);
  char* data = block.get();
  buffers_.push_back(Buffer{field, bytes, data, std::shared_ptr<const void>(std::move(block), data)});
  return data;
}

bool OutputBuffers::Move(const void* was, size_t bytes, char* now, std::shared_ptr<const void> owner) {
  for (Buffer& b : buffers_) {
    if (b.data == was && b.bytes == bytes) {
      b.data = now;
      b.owner = std::move(owner);  // the heap block is freed here
      return true;
    }
  }
  return false;
}

const OutputBuffers::Buffer* OutputBuffers::Find(int field) const {
  for (const Buffer& b : buffers_) {
    if (b.field == field) return &b;
  }
  return nullptr;
}

void OutputBuffers::Remove(int field) {
  std::erase_if(buffers_, [field](const Buffer& b) { return b.field == field; });
}

uint64_t OutputBuffers::bytes() const {
  uint64_t total = 0;
  for (const Buffer& b : buffers_) total += b.bytes;
  return total;
}

}  // namespace fusedlayer::server
