#include "exec/dist/source_server.hpp"

#include "shardmerge/error.hpp"

namespace shardmerge::dist {

void SourceServer::read(uint32_t file, uint64_t offset, void* buf, size_t n) {
  if (file >= plan_.sources.size()) throw Error("asked for source " + std::to_string(file) + ", which the plan does not have");
  const SourceFile& s = plan_.sources[file];
  if (s.owner != rank_)
    throw Error("asked for a source that rank " + std::to_string(s.owner) + " owns, not rank " + std::to_string(rank_))
        .file(s.path);
  // Offsets into a compressed item are offsets into its decoded bytes.
  const uint64_t readable = s.compressed ? s.compressed->decoded_size : s.size;
  if (offset > readable || n > readable - offset)
    throw Error("asked for bytes past the end of the source").file(s.path).offset(offset);
  const OpenSources* open = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_[file]) open_[file] = std::make_unique<OpenSources>(plan_, std::vector<uint32_t>{file}, false, rank_);
    open = open_[file].get();
  }
  open->fds().read(file, offset, buf, n);
}

void SourceServer::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& o : open_)
    if (o) o->finish();
}

}  // namespace shardmerge::dist
