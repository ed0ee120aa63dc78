// Precompiled into the server and client test suites (cmake/precompiled_headers.cmake says why).
#include "libraries.h"

#include <filesystem>
#include <random>

#include "gtest/gtest.h"
