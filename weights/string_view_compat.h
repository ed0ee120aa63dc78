// Debian 12's Abseil is built with ABSL_OPTION_USE_STD_STRING_VIEW = 0: absl::string_view is its own
// class and does not convert from std::string_view. The weights code speaks std::string_view in its
// API and converts at the Abseil call sites with this.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace fusedlayer::server {

inline absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace fusedlayer::server
