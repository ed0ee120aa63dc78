// fusedctl replay --dump=FILE: re-sends a shadow-verification mismatch dump (the server's
// --shadow_dump_dir, format in docs/shadow.md) to a server with REQUIRE_FUSED and verify = true, then
// reports (1) whether the new fused outputs equal the dumped fused outputs bitwise (is the fused
// kernel deterministic, is this the same build/device behaviour) and (2) whether the fused-vs-unfused
// mismatch reproduces (the server's Verification). The weight set named in the dump must be loaded
// on the target server.
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/commands.h"
#include "client/lib/safetensors_io.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"

namespace fusedlayer::client {

namespace {

constexpr char kDumpFormat[] = "fusedlayer-shadow-dump/1";

// Moves the dump's "request.<field>" tensors into the request's Tensor fields of that name.
absl::Status FillRequest(const std::string& path, SafetensorsFile& file, google::protobuf::Message* request) {
  const google::protobuf::Descriptor* d = request->GetDescriptor();
  const google::protobuf::Reflection* r = request->GetReflection();
  int filled = 0;
  for (auto& [name, tensor] : file.tensors) {
    absl::string_view field_name = name;
    if (!absl::ConsumePrefix(&field_name, "request.")) continue;
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(std::string(field_name));
    if (f == nullptr || f->message_type() != v1::Tensor::descriptor()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", name, "\" is not an input of ", d->name()));
    }
    r->MutableMessage(request, f)->CopyFrom(tensor);
    ++filled;
  }
  if (filled == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": no request.* tensors"));
  return absl::OkStatus();
}

bool SameTensor(const v1::Tensor& a, const v1::Tensor& b) {
  return a.dtype() == b.dtype() && a.data() == b.data() && a.shape_size() == b.shape_size() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin());
}

// Compares the response's outputs with the dump's "fused.<output>" tensors; prints one line each.
bool FusedOutputsEqual(const SafetensorsFile& file, const google::protobuf::Message& response, std::ostream& out) {
  const google::protobuf::Descriptor* d = response.GetDescriptor();
  const google::protobuf::Reflection* r = response.GetReflection();
  bool all_equal = true;
  for (const auto& [name, tensor] : file.tensors) {
    absl::string_view field_name = name;
    if (!absl::ConsumePrefix(&field_name, "fused.")) continue;
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(std::string(field_name));
    const bool equal = f != nullptr && f->message_type() == v1::Tensor::descriptor() && r->HasField(response, f) &&
                       SameTensor(static_cast<const v1::Tensor&>(r->GetMessage(response, f)), tensor);
    all_equal = all_equal && equal;
    out << absl::StrFormat("  %-14s %s\n", std::string(field_name),
                           equal ? "bitwise equal to the dump" : "DIFFERS from the dump");
  }
  return all_equal;
}

}  // namespace

std::string FormatVerification(const v1::Verification& v) {
  if (!v.compared()) return absl::StrCat("verification: not compared (", v.reason(), ")\n");
  std::string out = absl::StrCat("verification (fused vs unfused, this server): ",
                                 v.mismatch() ? "MISMATCH" : "within tolerance", "\n");
  for (const v1::OutputComparison& o : v.outputs()) {
    absl::StrAppend(&out, absl::StrFormat("  %-14s %-8s max_abs_diff=%g max_ulp=%d differing=%d/%d  [%s]%s\n",
                                          o.output(), o.mismatch() ? "MISMATCH" : "ok", o.max_abs_diff(),
                                          o.max_ulp_distance(), o.differing_elements(), o.total_elements(), o.rule(),
                                          o.detail().empty() ? "" : absl::StrCat(" ", o.detail())));
  }
  return out;
}

absl::Status RunReplay(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out, bool* reproduced) {
  *reproduced = false;
  if (cl.dump.empty()) return absl::InvalidArgumentError("replay needs --dump=FILE");
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(cl.dump);
  if (!file.ok()) return file.status();
  auto meta = [&](const std::string& key) -> std::string {
    auto it = file->metadata.find(key);
    return it == file->metadata.end() ? std::string() : it->second;
  };
  if (meta("format") != kDumpFormat) {
    return absl::InvalidArgumentError(absl::StrCat(cl.dump, ": not a shadow-verification dump (metadata format = \"",
                                                   meta("format"), "\", expected \"", kDumpFormat, "\")"));
  }
  const std::string op = meta("op");
  out << "dump        " << cl.dump << "\n"
      << "case        op " << op << ", weight set '" << meta("weight_set") << "', request " << meta("request_id")
      << ", recorded on " << meta("backend") << " " << meta("device") << "\n"
      << "recorded    mismatched outputs: " << meta("mismatched_outputs") << "\n";

  v1::Verification verification;
  bool fused_equal = false;
  if (op == "mhc") {
    v1::MhcSeamRequest req;
    req.set_weight_set(meta("weight_set"));
    v1::MhcStage stage;
    v1::MhcMode mode;
    if (!v1::MhcStage_Parse(meta("stage"), &stage) || !v1::MhcMode_Parse(meta("mode"), &mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(cl.dump, ": bad stage/mode metadata '", meta("stage"), "' / '", meta("mode"), "'"));
    }
    req.set_stage(stage);
    req.set_mode(mode);
    req.set_capture_aux(meta("capture_aux") == "true");
    if (absl::Status s = FillRequest(cl.dump, *file, &req); !s.ok()) return s;
    req.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
    req.set_verify(true);
    req.set_request_id(absl::StrCat("replay-", meta("request_id")));
    absl::StatusOr<v1::MhcSeamResponse> resp = client.MhcSeam(req);
    if (!resp.ok()) return resp.status();
    out << "fused outputs of this run:\n";
    fused_equal = FusedOutputsEqual(*file, *resp, out);
    verification = resp->verification();
  } else if (op == "swa") {
    v1::SwaNormQuantRequest req;
    req.set_weight_set(meta("weight_set"));
    if (absl::Status s = FillRequest(cl.dump, *file, &req); !s.ok()) return s;
    req.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
    req.set_verify(true);
    req.set_request_id(absl::StrCat("replay-", meta("request_id")));
    absl::StatusOr<v1::SwaNormQuantResponse> resp = client.SwaNormQuant(req);
    if (!resp.ok()) return resp.status();
    out << "fused outputs of this run:\n";
    fused_equal = FusedOutputsEqual(*file, *resp, out);
    verification = resp->verification();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(cl.dump, ": unknown op '", op, "' in the dump's metadata"));
  }
  out << FormatVerification(verification);
  *reproduced = verification.compared() && verification.mismatch();
  out << "result      fused output " << (fused_equal ? "identical to" : "different from") << " the dump; mismatch "
      << (*reproduced ? "REPRODUCED (exit 3)" : "not reproduced") << "\n";
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
