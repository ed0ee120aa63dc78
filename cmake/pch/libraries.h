// Precompiled into the server and client libraries (cmake/precompiled_headers.cmake says why).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "grpcpp/grpcpp.h"
