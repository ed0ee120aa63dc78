// A fusedlayer_server (or fusedlayer_server_faults) child process with its stdout and stderr captured
// through a pipe, for the tests that drive the real binary: startup failures, signals, drain.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fusedlayer::testing {

// A child process running the server with stderr captured through a pipe.
class ServerProcess {
 public:
  ServerProcess(const std::string& binary, std::vector<std::string> args) : args_(std::move(args)) {
    // Everything the child needs is built before fork: the test process has threads (gRPC's), so
    // the child may only make async-signal-safe calls (no allocation) before execv.
    args_.insert(args_.begin(), binary);
    std::vector<char*> argv;
    for (auto& a : args_) argv.push_back(a.data());
    argv.push_back(nullptr);
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }
  ~ServerProcess() {
    if (pid_ > 0 && !waited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
    if (out_) fclose(out_);
  }
  // Reads log lines until one matches `re` (returns it) or the process closes its output ("").
  std::string ReadUntil(const std::regex& re) {
    char line[4096];
    while (fgets(line, sizeof(line), out_) != nullptr) {
      log_ += line;
      if (std::regex_search(line, re)) return line;
    }
    return "";
  }
  std::string ReadAll() {
    char line[4096];
    while (fgets(line, sizeof(line), out_) != nullptr) log_ += line;
    return log_;
  }
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    waited_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  pid_t pid() const { return pid_; }
  const std::string& log() const { return log_; }

 private:
  std::vector<std::string> args_;
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  bool waited_ = false;
  std::string log_;
};

// Runs `binary` with `args` to its end (a command-line tool such as fusedctl): its exit status, and
// *out its stdout and stderr.
inline int RunToEnd(const std::string& binary, const std::vector<std::string>& args, std::string* out) {
  ServerProcess p(binary, args);
  *out = p.ReadAll();
  return p.Wait();
}

}  // namespace fusedlayer::testing
