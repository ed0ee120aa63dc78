// A fusedlayer::client::FusedLayerClient for an in-process TestServer over TCP loopback (60 s
// deadline, optional bearer token): for suites that link fusedlayer_client.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "client/lib/fusedlayer_client.h"
#include "gtest/gtest.h"
#include "server_test_env.h"

namespace fusedlayer::testing {

inline std::unique_ptr<client::FusedLayerClient> ClientFor(TestServer& ts, const std::string& token = "") {
  client::ClientOptions o;
  o.deadline = absl::Seconds(60);
  o.bearer_token = token;
  absl::StatusOr<std::unique_ptr<client::FusedLayerClient>> c =
      client::FusedLayerClient::Connect("127.0.0.1:" + std::to_string(ts.server().port()), std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

}  // namespace fusedlayer::testing
