// Status propagation for absl::StatusOr, as Abseil-based projects (and Triton's RETURN_IF_ERROR) do.
#pragma once

#include <utility>

#include "absl/status/statusor.h"

// Assigns `lhs = *expr` when `expr` (an absl::StatusOr) is OK, else returns its status from the
// enclosing function. `lhs` may be any assignable expression (a view, a struct member).
#define FL_ASSIGN_OR_RETURN(lhs, expr)            \
  do {                                            \
    auto fl_assign_or_return_value_ = (expr);     \
    if (!fl_assign_or_return_value_.ok()) {       \
      return fl_assign_or_return_value_.status(); \
    }                                             \
    (lhs) = *std::move(fl_assign_or_return_value_);  \
  } while (0)
