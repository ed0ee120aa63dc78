// fusedctl seam | swa: one request (random or from a safetensors file), then the execution report
// and a summary of every output.
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/lib/call_ring.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/commands.h"
#include "client/lib/random_inputs.h"
#include "client/lib/safetensors_io.h"
#include "client/lib/shared_memory.h"
#include "client/lib/tensor_messages.h"
#include "client/lib/tensor_summary.h"

namespace fusedlayer::client {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One output line; an output the server did not send is skipped (absent tensors are not outputs of
// this stage).
void PrintSummary(std::ostream& out, const char* name, bool present, const v1::Tensor& t) {
  if (!present) return;
  absl::StatusOr<TensorSummary> s = SummarizeTensor(t);
  if (!s.ok()) {
    out << "  " << name << "  malformed: " << OneLine(s.status().message()) << "\n";
    return;
  }
  out << FormatSummary(name, *s) << "\n";
}

// Moves the file's tensors into the request fields of the same name; any other name is an error
// (a misspelt tensor would otherwise be silently replaced by nothing).
template <typename Request>
absl::Status FillFromFile(const std::string& path, const std::map<std::string, v1::Tensor* (*)(Request&)>& fields,
                          Request& req) {
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  std::vector<std::string> names;
  for (const auto& [name, _] : fields) names.push_back(name);
  for (auto& [name, tensor] : file->tensors) {
    auto it = fields.find(name);
    if (it == fields.end()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor \"", name, "\" is not a request field (expected ",
                                                     absl::StrJoin(names, ", "), ")"));
    }
    *it->second(req) = std::move(tensor);
  }
  if (file->tensors.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no tensors"));
  return absl::OkStatus();
}

absl::Status WriteOutputs(const std::string& path, std::vector<std::pair<std::string, v1::Tensor>> tensors,
                          const v1::ExecutionReport& report, std::ostream& out) {
  std::map<std::string, std::string> meta = {{"fusedlayer.path", PathName(report.path())},
                                             {"fusedlayer.fallback_reason", ReasonName(report.fallback_reason())},
                                             {"fusedlayer.backend", report.backend()},
                                             {"fusedlayer.weight_set", report.weight_set()}};
  if (absl::Status s = WriteSafetensors(path, tensors, meta); !s.ok()) return s;
  out << "wrote " << tensors.size() << " output tensor(s) to " << path << "\n";
  return absl::OkStatus();
}

absl::StatusOr<v1::PathPreference> PathOf(const CommandLine& cl) {
  return ParsePathPreference(cl.path.empty() ? "auto" : cl.path);
}

}  // namespace

absl::StatusOr<bool> ParseRegionTransport(const std::string& transport) {
  if (transport == "tcp" || transport.empty()) return false;
  if (transport == "shm" || transport == "cuda_ipc") return true;
  return absl::InvalidArgumentError(absl::StrCat("--transport=", transport, ": want tcp, shm, cuda_ipc, ring or ring_cuda_ipc"));
}

bool IsRingTransport(const std::string& transport) { return transport == "ring" || transport == "ring_cuda_ipc"; }

absl::StatusOr<std::unique_ptr<ClientRegion>> MakeRegion(const FusedLayerClient& client, const CommandLine& cl,
                                                         uint64_t bytes) {
  if (cl.transport == "cuda_ipc" || cl.transport == "ring_cuda_ipc") {
    if (!cl.cuda_regions) {
      return absl::FailedPreconditionError(
          absl::StrCat("--transport=", cl.transport, " needs a fusedctl built with a GPU backend"));
    }
    return cl.cuda_regions(client, bytes);
  }
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm = ClientSharedMemory::Create(client, bytes);
  if (!shm.ok()) return shm.status();
  return std::unique_ptr<ClientRegion>(std::move(*shm));
}

namespace {
std::string RegionLine(const CommandLine& cl, const ClientRegion& region) {
  const auto* shm = dynamic_cast<const ClientSharedMemory*>(&region);
  return absl::StrCat("transport ", cl.transport, ":", shm != nullptr ? absl::StrCat(" object ", shm->key(), ",") : "",
                      " region ", region.region_name(), ", ", FormatBytes(double(region.byte_size())), "\n");
}

// The call of `req` (its tensors in `region`) through a call ring opened for it: the response
// holds the completion's report and the outputs read from the region.
template <typename Response, typename Request>
absl::StatusOr<Response> CallThroughRing(const FusedLayerClient& client, const CommandLine& cl, const Request& req,
                                         const ClientRegion& region, double* round_trip_seconds) {
  const CallRing::Options options =
      CallRing::Options::ForRegions(req.weight_set(), {region.region_name()}, cl.transport == "ring_cuda_ipc");
  absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(client, options);
  if (!ring.ok()) return ring.status();
  absl::StatusOr<wire::RingCallDescriptor> call = RingCallOf(req, options.weight_sets, options.regions);
  if (!call.ok()) return call.status();
  const Clock::time_point t0 = Clock::now();
  const RingCallResult r = (*ring)->Call(0, *call);
  *round_trip_seconds = Since(t0);
  if (!r.status.ok()) return r.status;
  Response resp;
  *resp.mutable_report() = ReportOf(r);
  resp.mutable_report()->set_weight_set(req.weight_set());
  if (absl::Status s = region.FetchPlaced(resp); !s.ok()) return s;
  return resp;
}

// Sends `req` with `send` and prints its request and response sizes and its report. With
// --transport=shm|cuda_ipc the tensors go in a region of the caller's first (`region_bytes` of it,
// filled by `prepare`), and the outputs are fetched from there into the response; with
// --transport=ring|ring_cuda_ipc the same region's call goes through a call ring instead of `send`.
template <typename Request, typename Send>
auto SendAndReport(const FusedLayerClient& client, const CommandLine& cl, Request& req,
                   const std::function<absl::StatusOr<uint64_t>()>& region_bytes,
                   const std::function<absl::Status(ClientRegion&)>& prepare, Send send, std::ostream& out)
    -> decltype(send(req)) {
  using Response = typename decltype(send(req))::value_type;
  const bool ring = IsRingTransport(cl.transport);
  if (ring && req.verify()) {
    return absl::InvalidArgumentError(
        "--verify: a call ring's completion carries no verification; verify over --transport=tcp|shm|cuda_ipc");
  }
  absl::StatusOr<bool> region_transport = ring ? true : ParseRegionTransport(cl.transport);
  if (!region_transport.ok()) return region_transport.status();
  std::unique_ptr<ClientRegion> region;
  if (*region_transport) {
    absl::StatusOr<uint64_t> bytes = region_bytes();
    if (!bytes.ok()) return bytes.status();
    absl::StatusOr<std::unique_ptr<ClientRegion>> created = MakeRegion(client, cl, *bytes);
    if (!created.ok()) return created.status();
    region = *std::move(created);
    if (absl::Status s = prepare(*region); !s.ok()) return s;
    out << RegionLine(cl, *region);
  }
  if (ring) {
    double rtt = 0;
    absl::StatusOr<Response> resp = CallThroughRing<Response>(client, cl, req, *region, &rtt);
    if (!resp.ok()) return resp.status();
    out << "call ring: a " << FormatBytes(double(sizeof(wire::RingCallDescriptor)))
        << " descriptor and its completion in shared memory, no RPC\n";
    out << FormatReport(resp->report(), rtt);
    return resp;
  }
  const Clock::time_point t0 = Clock::now();
  auto resp = send(req);
  const double rtt = Since(t0);
  if (!resp.ok()) return resp.status();
  const uint64_t response_wire_bytes = resp->ByteSizeLong();  // before the outputs are fetched from the region
  if (region != nullptr) {
    if (absl::Status s = region->Fetch(*resp); !s.ok()) return s;
  }
  out << "request " << FormatBytes(double(req.ByteSizeLong())) << ", response "
      << FormatBytes(double(response_wire_bytes)) << ", request_id " << resp->request_id() << "\n";
  out << FormatReport(resp->report(), rtt);
  return resp;
}
}  // namespace

std::string FormatReport(const v1::ExecutionReport& r, double round_trip_seconds) {
  std::string s = "report\n";
  absl::StrAppend(&s, "  path        ", PathName(r.path()), "\n");
  if (r.path() != v1::EXECUTION_PATH_FUSED || r.fallback_reason() != v1::FALLBACK_REASON_NONE) {
    absl::StrAppend(&s, "  fallback    ", ReasonName(r.fallback_reason()));
    if (!r.fallback_detail().empty()) absl::StrAppend(&s, ": ", OneLine(r.fallback_detail()));
    absl::StrAppend(&s, "\n");
  }
  absl::StrAppend(&s, "  weight_set  ", r.weight_set(), "\n");
  // A call ring's completion names neither (the server's info does).
  if (!r.backend().empty()) absl::StrAppend(&s, "  backend     ", r.backend(), "\n");
  if (!r.device().empty()) absl::StrAppend(&s, "  device      ", r.device(), " (device_id ", r.device_id(), ")\n");
  absl::StrAppend(&s, "  kernel      ", FormatSeconds(r.kernel_seconds()), "\n");
  absl::StrAppend(&s, "  queue       ", FormatSeconds(r.queue_seconds()), "\n");
  absl::StrAppend(&s, "  server      ", FormatSeconds(r.server_seconds()), "\n");
  if (r.has_stages()) {
    // Where the server time went (queue is above); docs/operations.md lists what each covers.
    const v1::StageSeconds& st = r.stages();
    absl::StrAppend(&s, "  stages      decode ", FormatSeconds(st.decode()), "  copy_in ", FormatSeconds(st.copy_in()),
                    "  device ", FormatSeconds(st.device()), "  copy_out ", FormatSeconds(st.copy_out()),
                    "  response ", FormatSeconds(st.response()), "\n");
  }
  absl::StrAppend(&s, "  round trip  ", FormatSeconds(round_trip_seconds), "  (transfer + serialisation: ",
                  FormatSeconds(round_trip_seconds - r.server_seconds()), ")\n");
  return s;
}

namespace {

// --session: the caller's session of that name, if open (tokens 0 when it is not).
struct SeamSession {
  int64_t tokens = 0;
  bool open = false;
};

absl::StatusOr<SeamSession> FindSeamSession(const FusedLayerClient& client, const CommandLine& cl, v1::MhcStage stage) {
  SeamSession found;
  if (cl.session.empty()) {
    if (cl.return_state) return absl::InvalidArgumentError("--return_state applies to --session calls only");
    return found;
  }
  if (cl.transport != "tcp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--session sends x in the message and keeps the rest on the server: not with --transport=", cl.transport));
  }
  if (cl.verify) return absl::InvalidArgumentError("--session calls cannot be verified (--verify)");
  if (cl.no_pre_mix) return absl::InvalidArgumentError("--no_pre_mix: a session's calls take pre_mix from the session");
  absl::StatusOr<v1::ListResidualSessionsResponse> list = client.ListResidualSessions();
  if (!list.ok()) return list.status();
  for (const v1::ResidualSessionInfo& s : list->sessions()) {
    if (s.name() != cl.session) continue;
    found = {.tokens = s.tokens(), .open = true};
    if (cl.tokens_set && cl.tokens != s.tokens()) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens=", cl.tokens, ": residual session ", cl.session,
                                                     " has T = ", s.tokens(), " (every call of a session has its T)"));
    }
  }
  if (!found.open && stage != v1::MHC_STAGE_FIRST) {
    return absl::NotFoundError(absl::StrCat("no residual session ", cl.session,
                                            " of this identity: start one with --stage=first (which opens it)"));
  }
  return found;
}

// Opens the session for a FIRST call when it is not open yet (T = the request's, n and C the weight
// set's) and turns `req` into a call of it: x only, the state from and to the session.
// `mhc` fetches the weight set's mHC config (RunSeam's, fetched once).
absl::Status StartSeamSession(const FusedLayerClient& client, const CommandLine& cl, int64_t tokens,
                              const SeamSession& session,
                              const std::function<absl::StatusOr<v1::MhcConfig>()>& mhc, v1::MhcSeamRequest& req,
                              std::ostream& out) {
  if (!session.open) {
    absl::StatusOr<v1::MhcConfig> config = mhc();
    if (!config.ok()) return config.status();
    absl::StatusOr<uint64_t> bytes = client.OpenResidualSession(cl.session, tokens, config->hc_mult(), config->hidden());
    if (!bytes.ok()) return bytes.status();
    out << "opened residual session " << cl.session << " (T=" << tokens << ", " << FormatBytes(double(*bytes))
        << " on the server; close-session " << cl.session << " frees it)\n";
  }
  req.clear_residual();
  req.clear_post_mix();
  req.clear_comb_mix();
  req.clear_pre_mix();
  req.set_session(cl.session);
  req.set_return_state(cl.return_state);
  out << "session " << cl.session << ": x sent, the residual and mixes "
      << (req.stage() == v1::MHC_STAGE_FIRST ? "start" : "continue") << " on the server"
      << (cl.return_state ? " (and are returned)" : "") << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSeam(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  if (cl.weight_set.empty()) return absl::InvalidArgumentError("seam needs --weight_set=NAME");
  if (!cl.input.empty() && cl.tokens_set) {
    return absl::InvalidArgumentError("--tokens and --input exclude each other (the file sets the token count)");
  }
  absl::StatusOr<v1::MhcMode> mode = ParseMhcMode(cl.mode.empty() ? "shifted" : cl.mode);
  if (!mode.ok()) return mode.status();
  absl::StatusOr<v1::MhcStage> stage = ParseMhcStage(cl.stage.empty() ? "seam" : cl.stage);
  if (!stage.ok()) return stage.status();
  absl::StatusOr<v1::PathPreference> path = PathOf(cl);
  if (!path.ok()) return path.status();
  absl::StatusOr<SeamSession> session = FindSeamSession(client, cl, *stage);
  if (!session.ok()) return session.status();
  // The weight set's mHC config, fetched at its first use (random inputs, a session to open, a
  // region to size) and kept for the others.
  std::optional<absl::StatusOr<v1::MhcConfig>> mhc_config;
  auto mhc = [&]() -> absl::StatusOr<v1::MhcConfig> {
    if (!mhc_config) {
      absl::StatusOr<v1::WeightSetInfo> ws = client.FindWeightSet(cl.weight_set);
      if (!ws.ok()) mhc_config = ws.status();
      else if (!ws->has_mhc()) mhc_config = absl::InvalidArgumentError(absl::StrCat("weight set \"", cl.weight_set, "\" has no mHC part"));
      else mhc_config = ws->mhc();
    }
    return *mhc_config;
  };

  v1::MhcSeamRequest req;
  std::string origin;
  if (cl.input.empty()) {
    absl::StatusOr<v1::MhcConfig> config = mhc();
    if (!config.ok()) return config.status();
    MhcRequestSpec spec{.weight_set = cl.weight_set,
                        .stage = *stage,
                        .mode = *mode,
                        .tokens = session->tokens > 0 ? session->tokens : cl.tokens_set ? cl.tokens : 16,
                        .include_pre_mix = !cl.no_pre_mix,
                        .capture_aux = cl.capture_aux,
                        .path = *path};
    const uint64_t seed = cl.seed ? cl.seed : FreshSeed();
    std::mt19937_64 rng(seed);
    absl::StatusOr<v1::MhcSeamRequest> r = RandomMhcRequest(*config, spec, rng);
    if (!r.ok()) return r.status();
    req = *std::move(r);
    origin = absl::StrCat("random inputs, seed ", seed);
  } else {
    using Getter = v1::Tensor* (*)(v1::MhcSeamRequest&);
    std::map<std::string, Getter> fields = {{"x", [](v1::MhcSeamRequest& r) { return r.mutable_x(); }}};
    if (cl.session.empty()) {  // in a session the state comes from the server: the file holds x alone
      fields.insert({{"residual", [](v1::MhcSeamRequest& r) { return r.mutable_residual(); }},
                     {"post_mix", [](v1::MhcSeamRequest& r) { return r.mutable_post_mix(); }},
                     {"comb_mix", [](v1::MhcSeamRequest& r) { return r.mutable_comb_mix(); }},
                     {"pre_mix", [](v1::MhcSeamRequest& r) { return r.mutable_pre_mix(); }}});
    }
    if (absl::Status s = FillFromFile(cl.input, fields, req); !s.ok()) return s;
    if (cl.no_pre_mix) req.clear_pre_mix();
    req.set_weight_set(cl.weight_set);
    req.set_stage(*stage);
    req.set_mode(*mode);
    req.set_capture_aux(cl.capture_aux);
    req.set_path_preference(*path);
    origin = absl::StrCat("inputs from ", cl.input);
  }
  const int64_t tokens = req.x().shape_size() > 0 ? req.x().shape(0) : 0;
  if (!cl.session.empty()) {
    if (absl::Status s = StartSeamSession(client, cl, tokens, *session, mhc, req, out); !s.ok()) return s;
  }
  out << "MhcSeam weight_set=" << cl.weight_set << " stage=" << MhcStageName(req.stage())
      << " mode=" << MhcModeName(req.mode()) << " tokens=" << tokens << " pre_mix="
      << (!req.session().empty() ? "session" : req.has_pre_mix() ? "yes" : "no")
      << " capture_aux=" << (req.capture_aux() ? "yes" : "no") << " path=" << PathPreferenceName(*path) << " ("
      << origin << ")\n";

  req.set_verify(cl.verify);
  if (cl.device_id >= 0) req.set_device_id(cl.device_id);
  absl::StatusOr<v1::MhcSeamResponse> resp = SendAndReport(
      client, cl, req,
      [&]() -> absl::StatusOr<uint64_t> {
        absl::StatusOr<v1::MhcConfig> config = mhc();
        if (!config.ok()) return config.status();
        return MhcRequestSharedBytes(req, *config);
      },
      [&](ClientRegion& region) { return region.Prepare(req, *mhc()); },  // mhc() is known by now
      [&](const v1::MhcSeamRequest& r) { return client.MhcSeam(r); }, out);
  if (!resp.ok()) return resp.status();
  out << "outputs\n";
  PrintSummary(out, "new_residual", resp->has_new_residual(), resp->new_residual());
  PrintSummary(out, "new_pre_mix", resp->has_new_pre_mix(), resp->new_pre_mix());
  PrintSummary(out, "new_post_mix", resp->has_new_post_mix(), resp->new_post_mix());
  PrintSummary(out, "new_comb_mix", resp->has_new_comb_mix(), resp->new_comb_mix());
  PrintSummary(out, "y", resp->has_y(), resp->y());
  PrintSummary(out, "aux", resp->has_aux(), resp->aux());
  if (resp->has_verification()) out << FormatVerification(resp->verification());
  if (!cl.output.empty()) {
    std::vector<std::pair<std::string, v1::Tensor>> tensors;
    auto add = [&](const char* n, bool has, const v1::Tensor& t) {
      if (has) tensors.emplace_back(n, t);
    };
    add("new_residual", resp->has_new_residual(), resp->new_residual());
    add("new_pre_mix", resp->has_new_pre_mix(), resp->new_pre_mix());
    add("new_post_mix", resp->has_new_post_mix(), resp->new_post_mix());
    add("new_comb_mix", resp->has_new_comb_mix(), resp->new_comb_mix());
    add("y", resp->has_y(), resp->y());
    add("aux", resp->has_aux(), resp->aux());
    if (absl::Status s = WriteOutputs(cl.output, std::move(tensors), resp->report(), out); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status RunSwa(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  if (cl.weight_set.empty()) return absl::InvalidArgumentError("swa needs --weight_set=NAME");
  if (!cl.input.empty() && (cl.tokens_set || cl.row_stride != 0)) {
    return absl::InvalidArgumentError("--tokens/--row_stride and --input exclude each other (the file sets them)");
  }
  absl::StatusOr<v1::PathPreference> path = PathOf(cl);
  if (!path.ok()) return path.status();
  // The weight set's config is needed either way: for random inputs, and to dequantize q_fp8 with
  // the right scale layout for the summary.
  absl::StatusOr<v1::WeightSetInfo> ws = client.FindWeightSet(cl.weight_set);
  if (!ws.ok()) return ws.status();
  if (!ws->has_swa()) return absl::InvalidArgumentError(absl::StrCat("weight set \"", cl.weight_set, "\" has no SWA part"));

  v1::SwaNormQuantRequest req;
  std::string origin;
  if (cl.input.empty()) {
    SwaRequestSpec spec{.weight_set = cl.weight_set,
                        .tokens = cl.tokens_set ? cl.tokens : 16,
                        .row_stride = cl.row_stride,
                        .path = *path};
    const uint64_t seed = cl.seed ? cl.seed : FreshSeed();
    std::mt19937_64 rng(seed);
    absl::StatusOr<v1::SwaNormQuantRequest> r = RandomSwaRequest(ws->swa(), spec, rng);
    if (!r.ok()) return r.status();
    req = *std::move(r);
    origin = absl::StrCat("random inputs, seed ", seed);
  } else {
    using Getter = v1::Tensor* (*)(v1::SwaNormQuantRequest&);
    const std::map<std::string, Getter> fields = {
        {"qr_kv", [](v1::SwaNormQuantRequest& r) { return r.mutable_qr_kv(); }}};
    if (absl::Status s = FillFromFile(cl.input, fields, req); !s.ok()) return s;
    req.set_weight_set(cl.weight_set);
    req.set_path_preference(*path);
    origin = absl::StrCat("inputs from ", cl.input);
  }
  const std::vector<int64_t> in_shape = ShapeOf(req.qr_kv());
  out << "SwaNormQuant weight_set=" << cl.weight_set << " qr_kv=" << DataTypeName(req.qr_kv().dtype())
      << ShapeString(in_shape) << " path=" << PathPreferenceName(*path) << " (" << origin << ")\n";

  req.set_verify(cl.verify);
  if (cl.device_id >= 0) req.set_device_id(cl.device_id);
  absl::StatusOr<v1::SwaNormQuantResponse> resp = SendAndReport(
      client, cl, req,
      [&]() -> absl::StatusOr<uint64_t> { return SwaRequestSharedBytes(req, ws->swa(), ws->wq_b_rows()); },
      [&](ClientRegion& region) { return region.Prepare(req, ws->swa(), ws->wq_b_rows()); },
      [&](const v1::SwaNormQuantRequest& r) { return client.SwaNormQuant(r); }, out);
  if (!resp.ok()) return resp.status();
  out << "outputs\n";
  PrintSummary(out, "q_fp8", resp->has_q_fp8(), resp->q_fp8());
  if (resp->has_q_fp8() && resp->has_q_scale()) {
    absl::StatusOr<TensorSummary> dq = SummarizeDequantized(resp->q_fp8(), resp->q_scale(), ws->swa().scale_layout());
    if (dq.ok()) {
      out << FormatSummary("q (q_fp8*s)", *dq) << "\n";
    } else {
      out << "  q (q_fp8*s)   cannot dequantize: " << OneLine(dq.status().message()) << "\n";
    }
  }
  PrintSummary(out, "q_scale", resp->has_q_scale(), resp->q_scale());
  PrintSummary(out, "kv", resp->has_kv(), resp->kv());
  PrintSummary(out, "q_proj", resp->has_q_proj(), resp->q_proj());
  if (resp->has_verification()) out << FormatVerification(resp->verification());
  if (!cl.output.empty()) {
    std::vector<std::pair<std::string, v1::Tensor>> tensors;
    if (resp->has_q_fp8()) tensors.emplace_back("q_fp8", resp->q_fp8());
    if (resp->has_q_scale()) tensors.emplace_back("q_scale", resp->q_scale());
    if (resp->has_kv()) tensors.emplace_back("kv", resp->kv());
    if (resp->has_q_proj()) tensors.emplace_back("q_proj", resp->q_proj());
    if (absl::Status s = WriteOutputs(cl.output, std::move(tensors), resp->report(), out); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
