// A bearer-token file with two random compute tokens (mode 0600, in a private temporary
// directory, removed after each test): the fixture of the per-identity ownership tests (shared-
// memory regions, residual sessions). Set ServerConfig::auth_tokens_file to file_.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace fusedlayer::testing {

class TwoTokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fl-tokens-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    token_a_ = RandomToken();
    token_b_ = RandomToken();
    file_ = dir_ + "/tokens";
    std::ofstream(file_) << token_a_ << " compute\n" << token_b_ << " compute\n";
    ::chmod(file_.c_str(), 0600);
  }
  void TearDown() override {
    ::unlink(file_.c_str());
    ::rmdir(dir_.c_str());
  }
  static std::string RandomToken() {
    std::random_device rd;
    static constexpr char kHex[] = "0123456789abcdef";
    std::string t;
    for (int i = 0; i < 40; ++i) t.push_back(kHex[rd() % 16]);
    return t;
  }
  std::string dir_, file_, token_a_, token_b_;
};

}  // namespace fusedlayer::testing
