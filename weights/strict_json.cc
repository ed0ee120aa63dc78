#include "weights/strict_json.h"

#include <limits>
#include <set>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server::json_internal {

using nlohmann::json;

absl::StatusOr<json> ParseStrictJson(std::string_view text, std::string_view what) {
  // One key set per open object; arrays need none since keys only occur directly inside objects.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  // Thrown from the callback to stop at the limit: returning false would only drop the element
  // and the parser would go on reading (and building) the rest of a hostile, deep document.
  struct TooDeep {};
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (depth > kMaxJsonDepth) throw TooDeep{};
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() && duplicate.empty() &&
            !open_objects.back().insert(parsed.get_ref<const std::string&>()).second) {
          duplicate = parsed.get_ref<const std::string&>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json doc;
  try {
    doc = json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                      /*ignore_comments=*/false);
  } catch (const TooDeep&) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(what), ": JSON nested deeper than ", kMaxJsonDepth));
  } catch (const json::exception& e) {
    // nlohmann's parse_error messages carry the byte position ("syntax error while parsing ...
    // at line 1, column 17"); they never echo more than a token of the input.
    return absl::InvalidArgumentError(absl::StrCat(AbslView(what), ": malformed JSON: ", e.what()));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(what), ": duplicate JSON key ", Quote(duplicate)));
  }
  return doc;
}

absl::Status CheckAllowedKeys(const json& obj, std::initializer_list<std::string_view> allowed,
                              std::string_view where) {
  for (const auto& [key, value] : obj.items()) {
    bool known = false;
    for (std::string_view a : allowed) known = known || key == a;
    if (!known) {
      std::string list;
      for (std::string_view a : allowed) absl::StrAppend(&list, list.empty() ? "" : ", ", AbslView(a));
      return absl::InvalidArgumentError(
          absl::StrCat(AbslView(where), ": unknown key ", Quote(key), " (allowed: ", list, ")"));
    }
  }
  return absl::OkStatus();
}

std::optional<int64_t> AsInt64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

std::string Quote(std::string_view s) {
  constexpr size_t kMax = 200;
  std::string out = absl::StrCat("\"", absl::CHexEscape(AbslView(s.substr(0, kMax))), "\"");
  if (s.size() > kMax) absl::StrAppend(&out, "...");
  return out;
}

}  // namespace fusedlayer::server::json_internal
