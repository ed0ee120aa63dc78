#include "shadow/shadow_dump.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "codec/request_codec.h"
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

// The temporary name a dump is written under before its rename (Write); left behind by a crash.
bool IsDumpTemp(const fs::path& p) {
  const std::string name = p.filename().string();
  return absl::StartsWith(name, absl::StrCat(".", kDumpPrefix)) && absl::EndsWith(name, ".tmp");
}

// Writes `data` to a new file `path` readable by the server's user only (0600, whatever the
// umask): dumps hold client activations. False (errno set) on any failure.
bool WritePrivateFile(const fs::path& path, const std::string& data) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = fchmod(fd, 0600) == 0;  // an existing file keeps its mode under O_CREAT
  for (size_t done = 0; ok && done < data.size();) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ok = false;
    else done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) ok = false;
  return ok;
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
    if (e.is_regular_file() && IsDumpTemp(e.path())) {
      std::error_code rm;
      fs::remove(e.path(), rm);  // a dump a crash left half-written: never renamed, never counted
      continue;
    }
    if (!e.is_regular_file() || !IsDump(e.path())) continue;
    ++w->files_;
    w->bytes_ += e.file_size();
  }
  return w;
}

absl::StatusOr<std::string> ShadowDumpWriter::Write(const DumpCase& c) {
  // The budget first, on the tensor bytes (a lower bound of the file): a full budget must not cost
  // copies and a serialisation of every tensor per mismatch.
  uint64_t tensor_bytes = 0;
  for (const auto& named : c.tensors) tensor_bytes += named.second->data().size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (files_ + 1 > max_files_ || bytes_ + tensor_bytes > max_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat("dump limit reached (", files_, " files, ", bytes_,
                                                       " bytes; --shadow_dump_max_files=", max_files_,
                                                       ", --shadow_dump_max_bytes=", max_bytes_, ")"));
    }
  }
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
  if (!WritePrivateFile(tmp, *image)) {
    const std::string why = std::strerror(errno);
    std::error_code ec;
    fs::remove(tmp, ec);
    return absl::UnavailableError(absl::StrCat("cannot write ", tmp.string(), ": ", why));
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
