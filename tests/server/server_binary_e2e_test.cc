// The fusedlayer_server executable: fail-fast startup errors (exit 1 with one clear line), and a
// normal run with the demo weights that serves, then drains on SIGTERM and exits 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif

namespace fusedlayer::testing {
namespace {

TEST(ServerBinary, BadManifestFailsFast) {
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=",
                   "--weights_manifest=/nonexistent/manifest.json"});
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 1) << log;
  EXPECT_NE(log.find("--weights_manifest=/nonexistent/manifest.json"), std::string::npos) << log;
}

TEST(ServerBinary, BadFlagsFailFast) {
  {
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--disable_fused=mhc,attention"});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("attention"), std::string::npos) << log;
  }
  {
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=tpu"});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("tpu"), std::string::npos) << log;
  }
  {
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--queue_capacity=0"});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("queue_capacity"), std::string::npos) << log;
  }
}

TEST(ServerBinary, ServesDemoWeightsAndDrainsOnSigterm) {
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=2", "--demo_weights", "--address=127.0.0.1:0",
                   "--metrics_address=127.0.0.1:0", "--drain_seconds=10"});
  const std::string serving = p.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port ([0-9]+)\\)"));
  ASSERT_FALSE(serving.empty()) << p.log();
  std::smatch match;
  ASSERT_TRUE(std::regex_search(serving, match, std::regex("\\(port ([0-9]+)\\)")));
  const int port = std::stoi(match[1]);

  auto channel = MakeChannel(port);
  auto stub = v1::FusedLayer::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(stub->ListWeightSets(&ctx, {}, &list).ok());
  ASSERT_EQ(list.weight_sets_size(), 2);
  EXPECT_EQ(list.weight_sets(0).name(), "v4-pro/demo");
  EXPECT_EQ(list.weight_sets(1).name(), "v41-flash/demo");
  int status = 0;
  ASSERT_TRUE(HealthCheck(channel, "fusedlayer.mhc", &status).ok());
  EXPECT_EQ(status, 1);

  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 0) << log;
  EXPECT_NE(log.find("SIGTERM"), std::string::npos) << log;
  EXPECT_NE(log.find("shut down cleanly"), std::string::npos) << log;
}

}  // namespace
}  // namespace fusedlayer::testing
