// memcpy for destinations the CPU does not read again: the pinned blocks that the device copies
// from by DMA (a request's data gathered from gRPC's slices, rpc/wire_messages.h; inputs staged by
// runtime/device_staging.h). On x86-64 with AVX2, StreamingCopy writes its destination with
// non-temporal (streaming) stores; elsewhere it is a plain memcpy. Why: an ordinary store first
// reads each destination line into the cache (a read for ownership) and leaves it dirty there, so
// the copy moves its bytes three times and the device's DMA then has to take the lines from the
// cache; a streaming store writes whole lines to memory and reads nothing. Measured on the H200's
// host (bench/experiments/host_copy_bandwidth, 4.5 MiB): 1.2-1.6x memcpy's rate into pinned memory,
// but 0.5-0.9x into pageable memory, which is why only pinned destinations are streamed.
// ParallelCopy decides by the call's size, not each piece's (gRPC's slices can be small).
//
// Streaming stores are weakly ordered: a thread that copied with StreamingCopy must call
// StreamingCopyFence() before it tells another thread (or the device) that the bytes are there.
// ParallelCopy does this at the end of each share.
#pragma once

#include <cstddef>

namespace fusedlayer::server {

// A call below this is a plain memcpy. On the H200 host an SWA M = 64 call's 256 KiB streamed into
// its pinned block took 6-13 us off the device stage (the DMA reads memory instead of snooping
// the lines a memcpy left dirty in the cache), but an mHC T = 1 call's 70 KiB got 2-5 us slower
// in both the read and the device stage.
inline constexpr size_t kMinStreamingBytes = size_t{128} << 10;

void StreamingCopy(void* dst, const void* src, size_t n);
// Orders this thread's earlier streaming stores before its later stores (an sfence on x86-64).
void StreamingCopyFence();
// Whether StreamingCopy uses streaming stores on this machine (AVX2 present): for logs and tests.
bool StreamingCopySupported();

}  // namespace fusedlayer::server
