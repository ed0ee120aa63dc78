#include "rpc/undecodable_requests.h"

#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/interceptor.h"
#include "grpcpp/support/status.h"

namespace fusedlayer::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

// The request type of `method` ("/package.Service/Method"), or "" when the generated descriptors
// do not know it.
std::string RequestTypeOf(std::string_view method) {
  if (method.size() < 2 || method[0] != '/') return "";
  std::string full(method.substr(1));
  const size_t slash = full.find('/');
  if (slash == std::string::npos) return "";
  full[slash] = '.';
  const google::protobuf::MethodDescriptor* m =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full);
  return m != nullptr ? m->input_type()->full_name() : "";
}

class UndecodableRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit UndecodableRequestInterceptor(const char* method) : method_(method) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A unary method's request is parsed before the handler runs; a null message here is bytes
    // that did not parse (a missing message would be the same to the handler).
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      undecodable_ = true;
    }
    if (undecodable_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status sent = methods->GetSendStatus();
      // Only gRPC's own refusal of the unparsed request is rewritten; any other status stands.
      if (sent.error_code() == grpc::StatusCode::UNIMPLEMENTED && sent.error_message().empty()) {
        const std::string type = RequestTypeOf(method_);
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("the request is not a valid ", type.empty() ? std::string("message") : type,
                         " (malformed or truncated protobuf, or a string field that is not UTF-8)")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string_view method_;  // gRPC's registered method name: lives as long as the server
  bool undecodable_ = false;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY || info->method() == nullptr) return nullptr;
    const std::string_view method = info->method();
    // Raw methods: the service parses the bytes itself (INVALID_ARGUMENT already).
    if (method == "/fusedlayer.v1.FusedLayer/MhcSeam" || method == "/fusedlayer.v1.FusedLayer/SwaNormQuant") {
      return nullptr;
    }
    return new UndecodableRequestInterceptor(info->method());
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> UndecodableRequestInterceptorFactory() {
  return std::make_unique<Factory>();
}

}  // namespace fusedlayer::server
