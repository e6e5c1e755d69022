#include "write/hf_tree_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "exec/io.hpp"
#include "shardmerge/error.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Starts the disk write of a just-written range now, without waiting for it: the final fsync
// then has little left to do, and the disk works while the CPUs still convert.
void start_writeback(int fd, uint64_t offset, uint64_t n) {
  ::sync_file_range(fd, static_cast<off64_t>(offset), static_cast<off64_t>(n), SYNC_FILE_RANGE_WRITE);
}

bool is_inside(const fs::path& child, const fs::path& parent) {
  auto c = child.begin(), p = parent.begin();
  for (; p != parent.end(); ++p, ++c)
    if (c == child.end() || *c != *p) return false;
  return true;
}

// "OUT/" names OUT: without the trailing separator the temp dir is OUT's sibling, not its child.
std::string without_trailing_separator(const std::string& target) {
  fs::path p = fs::path(target).lexically_normal();
  if (p.has_relative_path() && p.filename().empty()) p = p.parent_path();
  return p.empty() ? target : p.string();
}

}  // namespace

HfTreeWriter::HfTreeWriter(std::string target, bool force, const std::string& source_dir)
    : target_(without_trailing_separator(target)), force_(force) {
  std::error_code ec;
  const fs::path abs_target = fs::weakly_canonical(fs::absolute(target_), ec);
  if (!source_dir.empty()) refuse_overlap(source_dir);
  if (fs::exists(target_, ec)) {
    if (!fs::is_directory(target_, ec)) throw usage_error("target " + target_ + " exists and is not a directory");
    if (!fs::is_empty(target_, ec) && !force_)
      throw usage_error("target directory " + target_ + " exists and is not empty; pass --force to replace it");
  }
  const fs::path parent = abs_target.parent_path();
  if (!fs::is_directory(parent, ec)) fs::create_directories(parent, ec);
  if (!fs::is_directory(parent, ec)) throw Error("cannot create the parent directory " + parent.string());
  static std::atomic<int> counter{0};
  temp_ = (parent / (abs_target.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                     std::to_string(counter++)))
              .string();
}

HfTreeWriter::~HfTreeWriter() {
  files_.clear();
  if (!committed_ && !attached_ && !temp_.empty()) {
    std::error_code ec;
    fs::remove_all(temp_, ec);
  }
}

void HfTreeWriter::refuse_overlap(const std::string& source_dir) const {
  std::error_code ec;
  const fs::path abs_target = fs::weakly_canonical(fs::absolute(target_), ec);
  const fs::path abs_source = fs::weakly_canonical(fs::absolute(source_dir), ec);
  if (is_inside(abs_target, abs_source))
    throw usage_error("target directory " + target_ + " is inside the source " + source_dir +
                      "; shardmerge never writes into its sources");
  if (is_inside(abs_source, abs_target) && force_)
    throw usage_error("target directory " + target_ + " contains the source " + source_dir + "; refusing to replace it");
}

void HfTreeWriter::refuse_replacing_sources(const MergePlan& plan) const {
  if (!force_) return;
  std::error_code ec;
  const fs::path abs_target = fs::weakly_canonical(fs::absolute(target_), ec);
  auto check = [&](const std::string& path) {
    if (!path.empty() && is_inside(fs::weakly_canonical(fs::absolute(path), ec), abs_target))
      throw usage_error("target directory " + target_ + " holds " + path + ", which this merge reads; refusing to replace it");
  };
  for (const SourceFile& f : plan.sources) check(f.path);
  for (const Sidecar& s : plan.sidecars) check(s.source);
}

void HfTreeWriter::create(const MergePlan& plan, const std::vector<bool>& owned) {
  refuse_replacing_sources(plan);
  std::error_code ec;
  if (!fs::create_directory(temp_, ec)) throw Error("cannot create temp directory: " + ec.message()).file(temp_);
  create_files(plan, owned);
}

void HfTreeWriter::attach(const std::string& temp_dir, const MergePlan& plan, const std::vector<bool>& owned) {
  refuse_replacing_sources(plan);
  temp_ = temp_dir;
  attached_ = true;
  if (!fs::is_directory(temp_)) throw Error("the shared temp directory does not exist here (is the target on a filesystem all processes share?)").file(temp_);
  create_files(plan, owned);
}

void HfTreeWriter::create_files(const MergePlan& plan, const std::vector<bool>& owned) {
  std::error_code ec;
  files_.clear();
  for (size_t i = 0; i < plan.files.size(); ++i) {
    files_.emplace_back();
    if (!owned.empty() && !owned[i]) continue;
    const OutputFile& f = plan.files[i];
    const fs::path path = fs::path(temp_) / f.name;
    fs::create_directories(path.parent_path(), ec);
    File file = File::create(path.string());
    file.allocate(f.size);
    file.write_exact(0, f.header.data(), f.header.size());
    files_.back() = std::move(file);
  }
}

void HfTreeWriter::sync_files() {
  for (const File& f : files_)
    if (f.is_open()) f.sync();
}

void HfTreeWriter::write(uint32_t file, uint64_t offset, const void* data, size_t n) const {
  const File& f = files_.at(file);
  if (!f.is_open()) throw Error("internal: write to an output file another process owns").file(temp_);
  f.write_exact(offset, data, n);
  start_writeback(f.fd(), offset, n);
}

bool HfTreeWriter::copy_from(int src_fd, uint64_t src_offset, uint32_t file, uint64_t offset, uint64_t n) const {
  // A partial copy is finished by the caller's read + write of the whole range: same bytes.
  if (copy_file_bytes(src_fd, src_offset, files_.at(file).fd(), offset, n) != n) return false;
  start_writeback(files_.at(file).fd(), offset, n);
  return true;
}

void HfTreeWriter::commit(const MergePlan& plan) {
  std::error_code ec;
  for (const Sidecar& s : plan.sidecars) {
    const fs::path path = fs::path(temp_) / s.name;
    fs::create_directories(path.parent_path(), ec);
    const std::string content = s.content ? *s.content : read_small_file(s.source, 1ull << 30);
    File f = File::create(path.string());
    f.write_exact(0, content.data(), content.size());
    f.sync();
  }
  sync_files();
  files_.clear();
  for (const auto& e : fs::recursive_directory_iterator(temp_, ec))
    if (e.is_directory()) fsync_dir(e.path());
  fsync_dir(temp_);

  const fs::path target(target_);
  if (fs::exists(target, ec) && !fs::is_empty(target, ec)) {
    // --force: swap the new tree in, then delete the old one.
    const fs::path old = temp_ + ".old";
    fs::rename(target, old, ec);
    if (ec) throw Error("cannot move the existing target aside: " + ec.message()).file(target_);
    fs::rename(temp_, target, ec);
    if (ec) {
      std::error_code ignored;
      fs::rename(old, target, ignored);
      throw Error("cannot rename the output into place: " + ec.message()).file(target_);
    }
    fs::remove_all(old, ec);
  } else {
    if (fs::exists(target, ec)) fs::remove(target, ec);  // an empty directory
    fs::rename(temp_, target, ec);
    if (ec) throw Error("cannot rename the output into place: " + ec.message()).file(target_);
  }
  committed_ = true;
  fsync_dir(fs::absolute(target).parent_path());
}

}  // namespace shardmerge
