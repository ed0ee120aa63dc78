// Requests whose bytes are not a valid message of the method's request type. The compute RPCs
// parse their requests themselves (rpc/wire_messages.h) and answer INVALID_ARGUMENT naming the
// message; gRPC's generated handlers, which parse every other unary request, answer such bytes
// with UNIMPLEMENTED and no message (the method exists: the request is what is wrong). This
// interceptor gives those calls the same answer as the compute RPCs: INVALID_ARGUMENT naming the
// request type.
#pragma once

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace fusedlayer::server {

// For grpc::ServerBuilder::experimental().SetInterceptorCreators. Interposes only on unary methods
// that gRPC parses: streaming and raw (ByteBuffer) methods get no interceptor and pay nothing.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> UndecodableRequestInterceptorFactory();

}  // namespace fusedlayer::server
