// Every conversion between the wire (proto) and the library's types, in one place:
//   - tensors: proto Tensor <-> TensorView. Decoding validates dtype, rank, every dimension and the
//     byte length against what the op expects and returns INVALID_ARGUMENT naming the tensor; a
//     decoded view points into the request's bytes (no copy). Output tensors are sized in the
//     response message and viewed in place, or kept outside it (runtime/output_buffers.h, sent after
//     it: rpc/wire_messages.h), so a host-accessible backend writes the response bytes directly;
//   - requests: MhcSeamRequest / SwaNormQuantRequest -> the op's call (runtime/op_calls.h), validated
//     against the weight set and --max_tokens, with the response tensors sized (reactor thread,
//     cheap);
//   - enums (dtype, stage, mode, path, fallback reason).
// Nothing here knows the transport: gRPC (server/rpc), the shadow verifier's re-run and any other
// caller decode the same messages the same way. absl::Status -> grpc::Status is rpc/proto_convert.h.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/op_calls.h"
#include "runtime/output_buffers.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/fallback.h"
#include "fusedlayer/tensor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "transport/residual_sessions.h"
#include "transport/shared_memory.h"
#include "codec/wire_tensor_data.h"

namespace fusedlayer::server {

// ---- enums -------------------------------------------------------------------------------------------
v1::DataType ToProto(DType dtype);
// InvalidArgument for DATA_TYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProto(v1::DataType dtype);
DType Fp8DType(Fp8Format format);
MhcStage FromProto(v1::MhcStage stage);
MhcMode FromProto(v1::MhcMode mode);
v1::FallbackReason ToProto(FallbackReason reason);
v1::ExecutionPath ToProto(Path path);

// ---- requests ----------------------------------------------------------------------------------------
// The bytes of a call's output tensors, by where they go.
struct ResponseSize {
  uint64_t sent = 0;  // in the response message: the outputs not placed in shared memory
  uint64_t held = 0;  // in server memory during the call: all but those placed in CUDA shared memory
  // The most input bytes a valid request of this size has: a shared-memory input whose shape or
  // byte_size claims more is refused by decode (INVALID_ARGUMENT) before it is read, so its staging
  // is admitted up to this, not up to the claim. UINT64_MAX where the inputs' size is not fixed by
  // the token count (SWA's qr_kv may be strided).
  uint64_t inputs_at_most = UINT64_MAX;
};

// The response's tensor bytes for this request, from its token count, the weight set's shapes and
// its output placements, before anything is allocated (memory admission, exec/compute_engine.h).
// Checks what the size depends on (stage, mode, the token tensor's rank and --max_tokens) with the
// same errors Decode*Request gives; the rest of the request is validated by Decode*Request.
absl::StatusOr<ResponseSize> MhcResponseBytes(const v1::MhcSeamRequest& request, const PreparedMhcWeights& weights,
                                              int64_t max_tokens);
absl::StatusOr<ResponseSize> SwaResponseBytes(const v1::SwaNormQuantRequest& request,
                                              const PreparedSwaWeights& weights, int64_t max_tokens);

// Validates the request, sizes the response tensors (zero-filled) and returns the call. An
// allocation failure (std::bad_alloc) is RESOURCE_EXHAUSTED with the response cleared.
// Shared-memory tensors (server/transport/shared_memory.h): inputs are read into `transfer`'s
// staging buffers and the call views those; outputs named in output_placements are still computed
// into the response's tensors and recorded in `transfer`, whose WriteOutputs() moves them to their
// regions after the run. Without a transfer (null) any shared-memory tensor is FAILED_PRECONDITION;
// verify with shared-memory tensors is INVALID_ARGUMENT (the comparison reads the inline messages).
// With `wire`, tensors whose data ReadWireRequest put outside the message are read from there.
// With `session` (an MhcSeam call of a residual session, held by the caller): the residual and
// mixes are the session's current state and the new ones go to its other copy, as views of backend
// memory (transport/residual_sessions.h); with return_state the response also gets them, copied
// after the run (MhcCall::copies_after_run).
// With `external`, the output tensors' data is not in the response message but in uninitialised
// buffers of `external` (runtime/output_buffers.h; the message gets their dtype and shape), except for
// a verify request or one with output placements, whose outputs are read back from the message.
absl::StatusOr<MhcCall> DecodeMhcRequest(const v1::MhcSeamRequest& request, const PreparedMhcWeights& weights,
                                         int64_t max_tokens, v1::MhcSeamResponse* response,
                                         transport::TensorTransfer* transfer = nullptr,
                                         OutputBuffers* external = nullptr, const WireTensorData* wire = nullptr,
                                         const transport::ResidualSessionStore::Lease* session = nullptr);
absl::StatusOr<SwaCall> DecodeSwaRequest(const v1::SwaNormQuantRequest& request, const PreparedSwaWeights& weights,
                                         int64_t max_tokens, v1::SwaNormQuantResponse* response,
                                         transport::TensorTransfer* transfer = nullptr,
                                         OutputBuffers* external = nullptr, const WireTensorData* wire = nullptr);

// ---- tensors -----------------------------------------------------------------------------------------
// Checks `t` is dtype[dims...] with exactly the right number of bytes and returns a contiguous
// view over its data. `name` is the proto field name, used in error messages. A tensor in shared
// memory is read through `transfer` (its byte_size checked against dtype x shape); one whose data
// ReadWireRequest put outside the message, from `wire` (rpc/wire_messages.h).
absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& t, const char* name, DType dtype,
                                        std::initializer_list<int64_t> dims,
                                        transport::TensorTransfer* transfer = nullptr,
                                        const WireTensorData* wire = nullptr);

// A 2-D dtype tensor [rows, row_stride] with row_stride >= min_cols, viewed as [rows, cols] with
// row stride `row_stride` (the SWA qr_kv input: only the first cols columns are read).
absl::StatusOr<TensorView> DecodeStrided2D(const v1::Tensor& t, const char* name, DType dtype,
                                           int64_t cols, transport::TensorTransfer* transfer = nullptr,
                                           const WireTensorData* wire = nullptr);

// The leading dimension of a tensor of rank `rank` (the token count), after checking the rank and
// that it is non-negative. The rest is checked by DecodeTensor.
absl::StatusOr<int64_t> LeadingDim(const v1::Tensor& t, const char* name, int rank);

// Sizes `out` as dtype[dims...] and returns a contiguous view over its bytes: its data in the
// message (zero-filled), or with `external` an uninitialised buffer there for response field
// `field` (the message gets the dtype and shape only), or no data at all (a null view) for a field
// `external` has as written elsewhere (OutputBuffers::WrittenElsewhere).
TensorView AllocateOutput(v1::Tensor* out, DType dtype, std::initializer_list<int64_t> dims,
                          OutputBuffers* external = nullptr, int field = 0);

// Bytes of a dense tensor, or InvalidArgument when a dimension is negative or the size overflows.
absl::StatusOr<uint64_t> DenseBytes(DType dtype, const int64_t* dims, int rank, const char* name);

}  // namespace fusedlayer::server
