// A fusedlayer server executable (the production one or the fault-injection one) started as a child
// process on loopback with the demo weights on the CPU backend, for end-to-end tests that need a
// real process: it waits until the server logs its metrics and gRPC ports (and, with `armed`, that
// fault injection is armed) and connects a stub. port == 0 means the server never came up.
#pragma once

#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "server_process.h"
#include "server_test_env.h"

namespace fusedlayer::testing {

// The port in a startup line such as "serving fusedlayer.v1.FusedLayer on ... (port 41234)"; 0 if none.
inline int PortFromLine(const std::string& line) {
  std::smatch m;
  if (!std::regex_search(line, m, std::regex("\\(port ([0-9]+)\\)"))) return 0;
  return std::stoi(m[1]);
}

struct DemoServerProcess {
  DemoServerProcess(const std::string& binary, std::vector<std::string> extra, bool armed)
      : process(binary, [&] {
          std::vector<std::string> a = {"--backend=cpu", "--cpu_threads=2", "--demo_weights",
                                        "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0"};
          a.insert(a.end(), extra.begin(), extra.end());
          return a;
        }()) {
    metrics_port = PortFromLine(process.ReadUntil(std::regex("metrics on .*\\(port [0-9]+\\)")));
    port = PortFromLine(process.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port [0-9]+\\)")));
    if (armed && port != 0 && process.ReadUntil(std::regex("fault injection armed")).empty()) port = 0;
    if (port != 0) {
      channel = MakeChannel(port);
      stub = ::fusedlayer::v1::FusedLayer::NewStub(channel);
    }
  }
  std::string Metrics() { return HttpGet(metrics_port, "/metrics"); }

  ServerProcess process;
  int port = 0;
  int metrics_port = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<::fusedlayer::v1::FusedLayer::Stub> stub;
};

}  // namespace fusedlayer::testing
