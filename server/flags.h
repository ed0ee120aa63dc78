// Command-line flags of fusedlayer_server (Abseil flags) and their translation into ServerConfig.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "config.h"

namespace fusedlayer::server {

// Reads the parsed flags (call after absl::ParseCommandLine); InvalidArgument on bad values.
absl::StatusOr<ServerConfig> ConfigFromFlags();

// What `fusedlayer_server --help` prints: the server's flags grouped by purpose, each with its type,
// default and help text. A flag of the server's own files that no group names is listed under
// "Other", so a new flag is never missing from the help. `program` names the binary in the usage line.
std::string FlagsUsage(const std::string& program);

}  // namespace fusedlayer::server
