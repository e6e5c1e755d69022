#include "exec/sources.hpp"

#include <fcntl.h>

#include <map>

#include "shardmerge/error.hpp"
#include "util/fd_io.hpp"
#include "util/file_stamp.hpp"
#include "util/zstd_frame.hpp"

namespace shardmerge {

void SourceFds::read(uint32_t file, uint64_t offset, void* buf, size_t n) const {
  struct Counted {
    ReadsInFlight* gauge;
    uint64_t n;
    ~Counted() {
      if (gauge) gauge->end(n);
    }
  } counted{in_flight, n};
  if (in_flight) in_flight->begin(n);
  read_unchecked(file, offset, buf, n);
  if (checker) checker->consume(file, offset, buf, n);
}

void SourceFds::read_unchecked(uint32_t file, uint64_t offset, void* buf, size_t n) const {
  if (fds[file] >= 0)
    pread_exact(fds[file], offset, buf, n, names[file]);
  else if (remote && remote_owner[file] >= 0)
    remote->read(remote_owner[file], file, offset, buf, n);
  else
    throw Error("internal: a read of a source that is not open").file(names[file]).offset(offset);
}

namespace {

// A source another process owns: its file is on that process's node (or is that process's to
// read), and a copy here, if any, is not the one the plan describes.
bool owned_elsewhere(const SourceFile& s, int32_t rank) { return rank >= 0 && s.owner != kAnyOwner && s.owner != rank; }

// The compressed item of `s`, decoded into a new unnamed temp file.
File decode(const SourceFile& s, const File& in) {
  const CompressedItem& item = *s.compressed;
  if (item.codec != "zstd") throw Error("unknown codec '" + item.codec + "' for a compressed item").file(s.path).offset(item.offset);
  File out = File::anonymous_temp();
  decode_zstd_frame(in, item.offset, item.length, item.decoded_size, out);
  return out;
}

}  // namespace

OpenSources::OpenSources(const MergePlan& plan, const std::vector<uint32_t>& files, bool check_crc, int32_t rank,
                         RemoteReader* remote) {
  for (uint32_t i : files)
    if (owned_elsewhere(plan.sources.at(i), rank) && !remote)
      throw Error("a task of process rank " + std::to_string(rank) + " reads this file, but the plan says only rank " +
                  std::to_string(plan.sources[i].owner) + " can read it")
          .file(plan.sources[i].path);
  fds_.fds.assign(plan.sources.size(), -1);
  fds_.remote_owner.assign(plan.sources.size(), -1);
  fds_.remote = remote;
  fds_.in_flight = in_flight_.get();
  for (const SourceFile& s : plan.sources) fds_.names.push_back(s.path);
  std::vector<bool> opened(plan.sources.size(), false);
  std::map<std::string, size_t> by_path;  // into files_: one descriptor per file, however many items it holds
  for (uint32_t i : files) {
    const SourceFile& s = plan.sources[i];
    if (owned_elsewhere(s, rank)) {  // its owner checks the stamp and decodes it
      fds_.remote_owner[i] = s.owner;
      opened[i] = true;
      continue;
    }
    const auto [at, fresh] = by_path.try_emplace(s.path, files_.size());
    if (fresh) {
      File f = File::open_read(s.path);
      opened_.push_back(file_stamp(f));
      files_.push_back(std::move(f));
      opened_index_.push_back(i);
    }
    const File& f = files_[at->second];
    const FileStamp& now = opened_[at->second];
    if (now.size != s.size)
      throw Error("changed since the plan was made (" + std::to_string(s.size) + " bytes then, " +
                  std::to_string(now.size) + " now)")
          .file(s.path);
    if (s.planned)
      if (auto change = stamp_change(*s.planned, now, StampMatch::Exact))
        throw Error("changed since the plan was made: " + *change).file(s.path);
    if (s.compressed) {
      fds_.fds[i] = decoded_.emplace_back(decode(s, f)).fd();
    } else {
      ::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
      fds_.fds[i] = f.fd();
    }
    opened[i] = true;
  }
  if (check_crc) {
    std::vector<RecordCheck> records;
    for (const RecordCheck& r : plan.records)
      if (r.file >= opened.size() || opened[r.file]) records.push_back(r);  // the checker refuses a bad index
    for (RecordCheck& r : records)
      if (r.crc32_at && r.file < opened.size()) {  // stored in the source, after the record (decoded, when compressed)
        unsigned char le[4];
        fds_.read_unchecked(r.file, *r.crc32_at, le, 4);
        r.crc32 = uint32_t{le[0]} | uint32_t{le[1]} << 8 | uint32_t{le[2]} << 16 | uint32_t{le[3]} << 24;
      }
    if (!records.empty()) {
      checker_ = std::make_unique<RecordChecker>(std::move(records), fds_.names);
      fds_.checker = checker_.get();
    }
  }
}

uint64_t OpenSources::finish() {
  if (checker_) checker_->finish(fds_);
  for (size_t i = 0; i < files_.size(); ++i)
    if (auto change = stamp_change(opened_[i], file_stamp(files_[i]), StampMatch::Exact))
      throw Error("changed during the merge: " + *change).file(fds_.names[opened_index_[i]]);
  return checker_ ? checker_->records_checked() : 0;
}

}  // namespace shardmerge
