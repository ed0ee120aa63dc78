// Hardening of the server's edges: its --help, requests whose bytes do not parse, the memory limit
// its defaults are derived from, and the descriptors that shared-memory regions hold open.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/byte_budget.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif

namespace fusedlayer::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---- --help ------------------------------------------------------------------------------------

TEST(ServerHelp, ListsTheServersFlagsByPurposeAndExitsZero) {
  std::string out;
  ASSERT_EQ(RunToEnd(FUSEDLAYER_SERVER_BINARY, {"--help"}, &out), 0) << out;
  EXPECT_THAT(out, Not(HasSubstr("No flags matched"))) << out;
  // Each flag with its help text, under its group's heading.
  EXPECT_THAT(out, HasSubstr("--address")) << out;
  EXPECT_THAT(out, HasSubstr("gRPC listen address")) << out;
  EXPECT_THAT(out, HasSubstr("--allow_shared_memory")) << out;
  EXPECT_THAT(out, HasSubstr("accept RegisterSystemSharedMemory")) << out;
  const size_t serving = out.find("\nServing:\n");
  const size_t shared_memory = out.find("\nSystem shared memory:\n");
  ASSERT_NE(serving, std::string::npos) << out;
  ASSERT_NE(shared_memory, std::string::npos) << out;
  EXPECT_LT(serving, out.find("--address")) << out;
  EXPECT_LT(shared_memory, out.find("--allow_shared_memory")) << out;
  EXPECT_LT(out.find("--address"), shared_memory) << out;
}

}  // namespace
}  // namespace fusedlayer::testing
