#include "write/hf_tree_writer.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "util/fd_io.hpp"
#include "shardmerge/error.hpp"
#include "util/free_space.hpp"
#include "write/stale_temps.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

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

// The directory the output will be renamed to: absolute, with every symlink resolved, the last
// component's too (also a dangling one: the output goes where it points). The temp directory
// is made beside this path, so the rename never crosses filesystems, and a symlink the user
// gave as the target is never replaced or removed: it points to the output afterwards.
fs::path resolve_target(const std::string& target) {
  fs::path p = fs::absolute(target).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    const fs::path parent = fs::weakly_canonical(p.parent_path(), ec);
    p = (ec ? p.parent_path() : parent) / p.filename();
    if (!fs::is_symlink(p, ec)) return p;
    const fs::path link = fs::read_symlink(p, ec);
    if (ec) return p;
    p = (link.is_absolute() ? link : p.parent_path() / link).lexically_normal();
    if (p.filename().empty()) p = p.parent_path();
  }
  throw usage_error("target " + target + ": too many levels of symbolic links");
}

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

HfTreeWriter::HfTreeWriter(std::string target, bool force, const std::string& source_dir)
    : display_(without_trailing_separator(target)), target_(resolve_target(display_).string()), force_(force) {
  if (!source_dir.empty()) refuse_overlap(source_dir);
  check_target();
  static std::atomic<int> counter{0};
  const fs::path t(target_);
  temp_ = (t.parent_path() / (t.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                              std::to_string(counter++)))
              .string();
}

HfTreeWriter::~HfTreeWriter() {
  files_.clear();
  std::error_code ec;
  if (created_ && !committed_) fs::remove_all(temp_, ec);
  temp_cleanup_ = {};
  lock_.release();
  if (!committed_)
    for (auto it = created_parents_.rbegin(); it != created_parents_.rend(); ++it) ::rmdir(it->c_str());
  cleanup_.clear();
}

void HfTreeWriter::check_target() const {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(target_, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(st)) throw usage_error("target " + display_ + " exists and is not a directory");
  if (!fs::is_empty(target_, ec) && !force_)
    throw usage_error("target directory " + display_ + " exists and is not empty; pass --force to replace it");
}

void HfTreeWriter::refuse_overlap(const std::string& source_dir) const {
  std::error_code ec;
  const fs::path abs_target(target_);
  const fs::path abs_source = fs::weakly_canonical(fs::absolute(source_dir), ec);
  if (is_inside(abs_target, abs_source))
    throw usage_error("target directory " + display_ + " is inside the source " + source_dir +
                      "; shardmerge never writes into its sources");
  if (is_inside(abs_source, abs_target) && force_)
    throw usage_error("target directory " + display_ + " contains the source " + source_dir + "; refusing to replace it");
}

void HfTreeWriter::refuse_replacing_sources(const MergePlan& plan) const {
  if (!force_) return;
  std::error_code ec;
  const fs::path abs_target(target_);
  auto check = [&](const std::string& path) {
    if (!path.empty() && is_inside(fs::weakly_canonical(fs::absolute(path), ec), abs_target))
      throw usage_error("target directory " + display_ + " holds " + path + ", which this merge reads; refusing to replace it");
  };
  for (const SourceFile& f : plan.sources) check(f.path);
  for (const Sidecar& s : plan.sidecars) check(s.source);
}

void HfTreeWriter::create_parents() {
  std::vector<fs::path> missing;
  std::error_code ec;
  for (fs::path p = fs::path(target_).parent_path(); !p.empty() && !fs::exists(fs::symlink_status(p, ec));
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.root_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    // Registered first: an interrupt right after mkdir still removes it.
    cleanup_.emplace_back(it->string(), interrupt::Removal::EmptyDir);
    if (::mkdir(it->c_str(), 0777) != 0) {
      const int err = errno;
      cleanup_.pop_back();  // not made by this run
      if (err == EEXIST) continue;
      throw Error("cannot create the parent directory: " + errno_text(err)).file(it->string());
    }
    created_parents_.push_back(it->string());
  }
  if (!fs::is_directory(fs::path(target_).parent_path(), ec))
    throw Error("the parent of the target is not a directory").file(fs::path(target_).parent_path().string());
}

std::string HfTreeWriter::lock_file() const {
  const fs::path t(target_);
  std::string name = ".";  // (built in steps: GCC 12 warns falsely on "." + string)
  name += t.filename().string();
  name += ".shardmerge.lock";
  return (t.parent_path() / name).string();
}

void HfTreeWriter::lock_target() {
  const std::string lock_file = this->lock_file();
  lock_ = DirLock::try_lock(lock_file);
  if (!lock_.locked())
    throw Error("another shardmerge run is writing " + display_ + " (it holds " + lock_file +
                "); wait for it to finish or choose another --target_dir");
  cleanup_.emplace_back(lock_file, interrupt::Removal::File);
}

void HfTreeWriter::require_space(const MergePlan& plan) const {
  uint64_t needed = 0;
  for (const OutputFile& f : plan.files) needed += f.size;
  std::error_code ec;
  for (const Sidecar& s : plan.sidecars) {
    if (s.content) needed += s.content->size();
    else if (const auto n = fs::file_size(s.source, ec); !ec) needed += n;
  }
  const std::string parent = fs::path(target_).parent_path().string();
  require_free_space(needed, free_bytes(parent), parent);
}

void HfTreeWriter::create(const MergePlan& plan, const std::vector<bool>& owned) {
  refuse_replacing_sources(plan);
  create_parents();
  lock_target();
  for (const std::string& note : clean_stale_temps(target_)) std::fprintf(stderr, "shardmerge: note: %s\n", note.c_str());
  // Again, under the lock: another run may have committed since the constructor, or a target
  // moved aside by a killed --force run may have been put back.
  check_target();
  require_space(plan);
  {
    auto hold = interrupt::hold_off();
    if (::mkdir(temp_.c_str(), 0777) != 0) throw Error("cannot create temp directory: " + errno_text(errno)).file(temp_);
    created_ = true;
    temp_cleanup_ = interrupt::Registration(temp_, interrupt::Removal::Tree);
  }
  create_files(plan, owned);
}

void HfTreeWriter::attach(const std::string& temp_dir, const MergePlan& plan, const std::vector<bool>& owned) {
  refuse_replacing_sources(plan);
  temp_ = temp_dir;
  attached_ = true;
  if (!fs::is_directory(temp_)) throw Error("the shared temp directory does not exist here (is the target on a filesystem all processes share?)").file(temp_);
  create_files(plan, owned);
}

void HfTreeWriter::remove_joined() {
  if (!attached_) return;
  files_.clear();
  std::error_code ec;
  fs::remove_all(temp_, ec);
  fs::remove(lock_file(), ec);
}

void HfTreeWriter::create_files(const MergePlan& plan, const std::vector<bool>& owned) {
  std::error_code ec;
  files_.clear();
  for (size_t i = 0; i < plan.files.size(); ++i) {
    files_.emplace_back();
    if (!owned.empty() && !owned[i]) continue;
    const OutputFile& f = plan.files[i];
    const fs::path path = fs::path(temp_) / f.name;
    {
      // Under hold_off: an interrupt that removed the temp directory must not see it made again.
      auto hold = interrupt::hold_off();
      if (fs::is_directory(temp_)) fs::create_directories(path.parent_path(), ec);
    }
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
    {
      auto hold = interrupt::hold_off();
      if (fs::is_directory(temp_)) fs::create_directories(path.parent_path(), ec);
    }
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
  publish();
  fsync_dir(fs::path(target_).parent_path());
}

void HfTreeWriter::publish() {
  auto hold = interrupt::hold_off();
  // rename() replaces a missing or empty directory and fails on a non-empty one, a file or a
  // symlink: a target that something else filled since the start check is never replaced.
  if (::rename(temp_.c_str(), target_.c_str()) == 0) {
    committed_ = true;
    temp_cleanup_ = {};
    return;
  }
  const int err = errno;
  if ((err == ENOTEMPTY || err == EEXIST) && !force_)
    throw Error("target directory " + display_ + " was filled by something else during the merge; not replacing it" +
                " (pass --force to replace it)");
  if (err == ENOTDIR) throw Error("target " + display_ + " is no longer a directory; not replacing it");
  if (err != ENOTEMPTY && err != EEXIST)
    throw Error("cannot rename the output into place: " + errno_text(err)).file(display_);

  // --force over a non-empty directory: swap the trees in one step, then delete the old one,
  // now at the temp name (an interrupt from here on removes it there).
  if (::renameat2(AT_FDCWD, temp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
    committed_ = true;
    hold.unlock();
    std::error_code ec;
    fs::remove_all(temp_, ec);
    temp_cleanup_ = {};
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
    throw Error("cannot swap the output into place: " + errno_text(errno)).file(display_);
  // No exchange on this filesystem: move the old tree aside, rename, delete the old tree. A run
  // killed between the two renames leaves `.old`, which the next run puts back (stale_temps).
  const std::string old = temp_ + ".old";
  if (::rename(target_.c_str(), old.c_str()) != 0)
    throw Error("cannot move the existing target aside: " + errno_text(errno)).file(display_);
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int failed = errno;
    ::rename(old.c_str(), target_.c_str());
    throw Error("cannot rename the output into place: " + errno_text(failed)).file(display_);
  }
  committed_ = true;
  temp_cleanup_ = interrupt::Registration(old, interrupt::Removal::Tree);
  hold.unlock();
  std::error_code ec;
  fs::remove_all(old, ec);
  temp_cleanup_ = {};
}

}  // namespace shardmerge
