// fusedctl info | health | list | unload | load | sessions | close-session.
#include <ostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/commands.h"
#include "client/fusedctl/weights_source.h"

namespace fusedlayer::client {

namespace {

std::string CapabilityText(const v1::OpCapability& cap) {
  if (cap.fused_available()) return "fused available";
  std::string s = absl::StrCat("fused UNAVAILABLE (", ReasonName(cap.reason()));
  if (!cap.detail().empty()) absl::StrAppend(&s, ": ", OneLine(cap.detail()));
  return s + ")";
}

std::string OptFloat(bool has, float v, const char* fallback) {
  return has ? absl::StrFormat("%g", v) : absl::StrCat(fallback, " (default)");
}

void PrintWeightSet(const v1::WeightSetInfo& ws, std::ostream& out) {
  out << ws.name() << "\n";
  out << "  source      " << ws.source() << "\n";
  out << "  resident    " << FormatBytes(double(ws.resident_bytes())) << " (" << ws.resident_bytes() << " bytes)\n";
  if (!ws.sha256().empty()) out << "  sha256      " << ws.sha256() << "\n";
  auto capability = [&](const char* op) -> std::string {
    for (const v1::OpCapability& c : ws.capabilities()) {
      if (c.op() == op) return CapabilityText(c);
    }
    return "fused availability not reported";
  };
  if (ws.has_mhc()) {
    const v1::MhcConfig& m = ws.mhc();
    out << "  mhc         n=" << m.hc_mult() << " C=" << m.hidden()
        << " norm_weight=" << (ws.has_norm_weight() ? "yes" : "no") << "; " << capability("mhc") << "\n";
    out << "              hc_norm_eps=" << OptFloat(m.has_hc_norm_eps(), m.hc_norm_eps(), "1e-06")
        << " norm_eps=" << OptFloat(m.has_norm_eps(), m.norm_eps(), "1e-06")
        << " hc_pre_eps=" << OptFloat(m.has_hc_pre_eps(), m.hc_pre_eps(), "1e-06")
        << " sinkhorn_eps=" << OptFloat(m.has_sinkhorn_eps(), m.sinkhorn_eps(), "1e-06")
        << " post_scale=" << OptFloat(m.has_post_scale(), m.post_scale(), "2")
        << " sinkhorn_iters=" << (m.has_sinkhorn_iters() ? absl::StrCat(m.sinkhorn_iters()) : "20 (default)") << "\n";
  }
  if (ws.has_swa()) {
    const v1::SwaConfig& s = ws.swa();
    out << "  swa         Q=" << s.q_rank() << " D=" << s.head_dim() << " " << Fp8FormatName(s.fp8_format())
        << " scale=" << ScaleFormatName(s.scale_format()) << " layout=" << ScaleLayoutName(s.scale_layout())
        << " eps=" << OptFloat(s.has_eps(), s.eps(), "1e-06")
        << " wq_b=" << (ws.wq_b_rows() > 0 ? absl::StrCat("N=", ws.wq_b_rows()) : std::string("none")) << "; "
        << capability("swa") << "\n";
    if (!ws.wq_b_implementation().empty()) out << "  wq_b        " << ws.wq_b_implementation() << "\n";
  }
}

}  // namespace

absl::Status RunInfo(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  out << "server      " << cl.target << "\n";
  out << "version     " << info->version() << "\n";
  out << "backend     " << info->backend() << "\n";
  out << "device      " << info->device() << "\n";
  out << "arch        " << info->arch() << "\n";
  out << "ops\n";
  for (const v1::OpCapability& cap : info->ops()) {
    out << absl::StrFormat("  %-9s %s\n", cap.op(), CapabilityText(cap));
  }
  out << "devices\n";
  for (const v1::DeviceInfo& d : info->devices()) {
    if (!d.serving()) {
      out << absl::StrFormat("  %-8s device_id %d  NOT SERVING: %s\n", d.label(), d.device_id(), d.error());
      continue;
    }
    out << absl::StrFormat("  %-8s device_id %d  %s (%s), %d lane(s), %s weights resident, %d call(s) in flight\n",
                           d.label(), d.device_id(), d.name(), d.arch(), d.lanes(),
                           FormatBytes(double(d.resident_bytes())), d.calls_in_flight());
  }
  out << "limits\n";
  out << "  max_receive_message_bytes  " << info->max_receive_message_bytes() << " ("
      << FormatBytes(double(info->max_receive_message_bytes())) << ")\n";
  out << "  max_send_message_bytes     " << info->max_send_message_bytes() << " ("
      << FormatBytes(double(info->max_send_message_bytes())) << ")\n";
  out << "  max_tokens                 " << info->max_tokens() << "\n";
  out << "  fused_max_tokens           " << info->fused_max_tokens() << "\n";
  out << "  queue_capacity             " << info->queue_capacity() << "\n";
  return absl::OkStatus();
}

absl::Status RunHealth(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out, bool* serving) {
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> st = client.CheckHealth(cl.service);
  if (!st.ok()) return st.status();
  *serving = *st == grpc::health::v1::HealthCheckResponse::SERVING;
  out << (cl.service.empty() ? std::string("(server)") : cl.service) << ": "
      << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*st) << "\n";
  return absl::OkStatus();
}

absl::Status RunList(const FusedLayerClient& client, const CommandLine& /*cl*/, std::ostream& out) {
  absl::StatusOr<v1::ListWeightSetsResponse> list = client.ListWeightSets();
  if (!list.ok()) return list.status();
  if (list->weight_sets().empty()) {
    out << "no weight sets loaded\n";
    return absl::OkStatus();
  }
  uint64_t total = 0;
  for (const v1::WeightSetInfo& ws : list->weight_sets()) {
    PrintWeightSet(ws, out);
    total += ws.resident_bytes();
  }
  out << list->weight_sets_size() << " weight set(s), " << FormatBytes(double(total)) << " resident\n";
  return absl::OkStatus();
}

absl::Status RunUnload(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  absl::StatusOr<v1::UnloadWeightSetResponse> r = client.UnloadWeightSet(cl.args.at(0));
  if (!r.ok()) return r.status();
  out << "unloaded " << cl.args.at(0) << ", freed " << FormatBytes(double(r->freed_bytes())) << " ("
      << r->freed_bytes() << " bytes)\n";
  return absl::OkStatus();
}

absl::Status RunSessions(const FusedLayerClient& client, const CommandLine& /*cl*/, std::ostream& out) {
  absl::StatusOr<v1::ListResidualSessionsResponse> list = client.ListResidualSessions();
  if (!list.ok()) return list.status();
  if (list->sessions().empty()) {
    out << "no residual sessions open for this identity\n";
    return absl::OkStatus();
  }
  uint64_t total = 0;
  for (const v1::ResidualSessionInfo& s : list->sessions()) {
    out << absl::StrFormat("%s  T=%d n=%d C=%d  %s  %s  %d call(s), idle %.1f s%s\n", s.name(), s.tokens(), s.hc_mult(),
                           s.hidden(), FormatBytes(double(s.bytes())),
                           !s.has_residual() ? "empty (no FIRST call yet)"
                           : s.has_mixes()   ? "residual + mixes"
                                             : "residual only (after HEAD)",
                           s.calls(), s.idle_seconds(),
                           s.last_weight_set().empty() ? "" : absl::StrCat(", last '", s.last_weight_set(), "'"));
    total += s.bytes();
  }
  out << list->sessions_size() << " session(s), " << FormatBytes(double(total)) << " held\n";
  return absl::OkStatus();
}

absl::Status RunCloseSession(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  absl::StatusOr<v1::CloseResidualSessionResponse> r = client.CloseResidualSession(cl.args.at(0));
  if (!r.ok()) return r.status();
  out << "closed " << cl.args.at(0) << ", freed " << FormatBytes(double(r->freed_bytes())) << " (" << r->freed_bytes()
      << " bytes)\n";
  return absl::OkStatus();
}

// A manifest loads all or nothing: every set is uploaded under one stage id (WeightSetHeader.stage),
// where the server builds and warms it up without publishing it, and CommitWeightSets then publishes
// them all in one step. A set that cannot be read (missing tensor, truncated shard) or that the
// server refuses ends the load before the commit: the stage is discarded and the loaded sets are
// the ones before the command.
absl::Status RunLoad(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out) {
  const size_t chunk = cl.chunk_bytes > 0 ? size_t(cl.chunk_bytes) : kDefaultChunkBytes;
  size_t count = 0;
  std::random_device random;
  const std::string stage = absl::StrFormat("fusedctl-load-%08x%08x%08x%08x", random(), random(), random(), random());
  bool staged_any = false;
  // One set's payload at a time: a whole checkpoint (fusedctl import-checkpoint) can be GiBs.
  absl::Status status = ForEachManifestSet(
      cl.args.at(0),
      [&](PackedWeights set) -> absl::Status {
        set.header.set_replace(cl.replace);
        set.header.set_stage(stage);
        const std::string name = set.header.name();
        staged_any = true;
        absl::StatusOr<v1::WeightSetInfo> info = client.LoadWeights(set.header, set.payload, chunk);
        if (!info.ok()) {
          return absl::Status(info.status().code(), absl::StrCat("loading \"", name, "\": ", info.status().message()));
        }
        out << "staged " << name << " (" << FormatBytes(double(set.payload.size())) << " payload)\n";
        return absl::OkStatus();
      },
      &count);
  if (status.ok() && count == 0) {
    status = absl::InvalidArgumentError(absl::StrCat(cl.args.at(0), " lists no weight sets"));
  }
  if (!status.ok()) {
    // Best effort: the server also drops a stage nobody commits. NOT_FOUND means nothing was staged.
    if (staged_any) {
      if (absl::StatusOr<v1::CommitWeightSetsResponse> d = client.CommitWeightSets(stage, /*discard=*/true);
          !d.ok() && d.status().code() != absl::StatusCode::kNotFound) {
        out << "note: discarding the staged sets failed (" << d.status() << "); the server drops them later\n";
      }
    }
    return absl::Status(status.code(), absl::StrCat(status.message(), " (nothing was loaded: the manifest loads all ",
                                                    "its sets or none)"));
  }
  absl::StatusOr<v1::CommitWeightSetsResponse> committed = client.CommitWeightSets(stage);
  if (!committed.ok()) {
    return absl::Status(committed.status().code(), absl::StrCat("publishing the ", count, " set(s) of ", cl.args.at(0),
                                                                ": ", committed.status().message(),
                                                                " (nothing was loaded)"));
  }
  for (const v1::WeightSetInfo& info : committed->weight_sets()) {
    out << "loaded " << info.name() << "\n";
    PrintWeightSet(info, out);
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
