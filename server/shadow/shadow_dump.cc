#include "shadow/shadow_dump.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rpc/proto_convert.h"
#include "weights/safetensors.h"
#include "weights/safetensors_writer.h"

namespace fusedlayer::server::shadow {
namespace {

namespace fs = std::filesystem;

// Request ids come from clients: keep [A-Za-z0-9._-], replace the rest, and cap the length.
std::string FileSafe(const std::string& s) {
  std::string out;
  for (char ch : s.substr(0, 64)) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                    ch == '_' || ch == '-';
    out.push_back(ok ? ch : '_');
  }
  return out.empty() ? "noid" : out;
}

bool IsDump(const fs::path& p) {
  const std::string name = p.filename().string();
  return absl::StartsWith(name, kDumpPrefix) && absl::EndsWith(name, kDumpSuffix);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShadowDumpWriter>> ShadowDumpWriter::Open(const std::string& dir, int64_t max_files,
                                                                          uint64_t max_bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shadow_dump_dir=", dir, ": cannot create the directory: ", ec ? ec.message() : "not a directory"));
  }
  // Prove it is writable now rather than at the first mismatch.
  const fs::path probe = fs::path(dir) / ".fusedlayer-write-probe";
  {
    std::ofstream f(probe);
    if (!f || !(f << "probe")) {
      return absl::InvalidArgumentError(absl::StrCat("--shadow_dump_dir=", dir, ": the directory is not writable"));
    }
  }
  fs::remove(probe, ec);
  std::unique_ptr<ShadowDumpWriter> w(new ShadowDumpWriter(dir, max_files, max_bytes));
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file() || !IsDump(e.path())) continue;
    ++w->files_;
    w->bytes_ += e.file_size();
  }
  return w;
}

absl::StatusOr<std::string> ShadowDumpWriter::Write(const DumpCase& c) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : c.tensors) {
    absl::StatusOr<DType> dtype = FromProto(t->dtype());
    if (!dtype.ok()) return dtype.status();
    entries.push_back(SafetensorsEntry{name, DTypeToSafetensorsDType(*dtype),
                                       std::vector<int64_t>(t->shape().begin(), t->shape().end()), t->data()});
  }
  std::map<std::string, std::string> metadata = c.metadata;
  metadata["format"] = kDumpFormat;
  absl::StatusOr<std::string> image = SerializeSafetensors(entries, metadata);
  if (!image.ok()) return image.status();

  std::lock_guard<std::mutex> lock(mu_);
  if (files_ + 1 > max_files_ || bytes_ + image->size() > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("dump limit reached (", files_, " files, ", bytes_,
                                                     " bytes; --shadow_dump_max_files=", max_files_,
                                                     ", --shadow_dump_max_bytes=", max_bytes_, ")"));
  }
  const std::string stem = absl::StrCat(kDumpPrefix, c.op, "-", FileSafe(c.request_id), "-", ++seq_);
  const fs::path path = fs::path(dir_) / absl::StrCat(stem, kDumpSuffix);
  const fs::path tmp = fs::path(dir_) / absl::StrCat(".", stem, ".tmp");
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f || !f.write(image->data(), static_cast<std::streamsize>(image->size())) || !f.flush()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp.string()));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);  // readers never see a partial dump
  if (ec) {
    fs::remove(tmp, ec);
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp.string(), " to ", path.string()));
  }
  ++files_;
  bytes_ += image->size();
  return path.string();
}

int64_t ShadowDumpWriter::files() const {
  std::lock_guard<std::mutex> lock(mu_);
  return files_;
}

uint64_t ShadowDumpWriter::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace fusedlayer::server::shadow
