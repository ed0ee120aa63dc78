// Command-line flags of fusedlayer_server (Abseil flags) and their translation into ServerConfig.
#pragma once

#include "absl/status/statusor.h"
#include "config.h"

namespace fusedlayer::server {

// Reads the parsed flags (call after absl::ParseCommandLine); InvalidArgument on bad values.
absl::StatusOr<ServerConfig> ConfigFromFlags();

}  // namespace fusedlayer::server
