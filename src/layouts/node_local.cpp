#include "layouts/node_local.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <regex>

#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"
#include "util/process_start.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {
namespace {

constexpr uint64_t kLargestCopied = 64ull << 20;
constexpr uint64_t kMostCopiedInAll = 256ull << 20;  // per process, what every other process receives

// Views of runs that were killed while planning: `shardmerge-view-<pid>-XXXXXX` whose pid cannot
// have made them any more (that process is gone, or the pid now belongs to a later one).
void remove_stale_views(const fs::path& tmp) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(tmp, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    static const std::regex view_name(R"(shardmerge-view-(\d{1,9})-\w{6})");
    std::smatch m;
    const std::string name = it->path().filename().string();
    if (!std::regex_match(name, m, view_name) || !it->is_directory(ec)) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    if (!process_may_have_made(std::stoi(m[1].str()), st.st_mtime)) fs::remove_all(it->path(), ec);
  }
}

nlohmann::json stamp_json(const FileStamp& s) { return {s.size, s.mtime_ns, s.ctime_ns, s.inode, s.device}; }
FileStamp stamp_from(const nlohmann::json& j) {
  return {j.at(0).get<uint64_t>(), j.at(1).get<int64_t>(), j.at(2).get<int64_t>(), j.at(3).get<uint64_t>(),
          j.at(4).get<uint64_t>()};
}

}  // namespace

bool holds_tensor_data(const std::string& relative, uint64_t size) {
  static const std::regex rank_file(R"((model|optim|extra_state)_world_size_\d+_rank_\d+\.pt)");
  const std::string name = fs::path(relative).filename().string();
  return size > kLargestCopied || std::regex_match(name, rank_file) || fs::path(name).extension() == ".distcp";
}

std::vector<NodeFile> list_node_files(const std::string& dir) {
  std::vector<NodeFile> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  uint64_t copied = 0;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    NodeFile f;
    f.relative = fs::relative(it->path(), dir).string();
    const File file = File::open_read(it->path().string());
    f.stamp = file_stamp(file);
    if (!holds_tensor_data(f.relative, f.stamp.size)) {
      copied += f.stamp.size;
      if (copied > kMostCopiedInAll)
        throw Error("the small files of the role directory (configs, tokenizer, metadata) exceed 256 MiB; every process "
                    "would receive them").file(dir);
      f.content = file.read_string(0, f.stamp.size);
    }
    out.push_back(std::move(f));
  }
  if (ec) throw Error("cannot list the directory: " + ec.message()).file(dir);
  return out;
}

std::string encode_node_files(const std::vector<NodeFile>& files) {
  nlohmann::json j = nlohmann::json::array();
  for (const NodeFile& f : files) {
    nlohmann::json e = {{"path", f.relative}, {"stamp", stamp_json(f.stamp)}};
    if (f.content) e["content"] = nlohmann::json::binary(std::vector<uint8_t>(f.content->begin(), f.content->end()));
    j.push_back(std::move(e));
  }
  const std::vector<uint8_t> cbor = nlohmann::json::to_cbor(j);
  return std::string(cbor.begin(), cbor.end());
}

std::vector<NodeFile> decode_node_files(const std::string& blob) {
  const nlohmann::json j = nlohmann::json::from_cbor(blob);
  std::vector<NodeFile> out;
  for (const auto& e : j) {
    NodeFile f{e.at("path").get<std::string>(), stamp_from(e.at("stamp")), std::nullopt};
    if (e.contains("content")) {
      const auto& bytes = e["content"].get_binary();
      f.content = std::string(bytes.begin(), bytes.end());
    }
    out.push_back(std::move(f));
  }
  return out;
}

NodeLocalView::NodeLocalView(std::string role_dir, const std::vector<std::vector<NodeFile>>& listings, int rank)
    : role_dir_(fs::path(std::move(role_dir)).lexically_normal().string()) {
  while (role_dir_.size() > 1 && role_dir_.back() == '/') role_dir_.pop_back();
  const fs::path tmp = std::getenv("TMPDIR") && *std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp";
  remove_stale_views(tmp);
  std::string tmpl = (tmp / ("shardmerge-view-" + std::to_string(::getpid()) + "-XXXXXX")).string();
  if (!::mkdtemp(tmpl.data())) throw Error("cannot create a temp directory for the node-local view").file(tmpl);
  temp_root_ = tmpl;
  view_dir_ = (fs::path(temp_root_) / fs::path(role_dir_).filename()).string();
  fs::create_directories(view_dir_);

  // Per relative path: the holders, in rank order.
  std::map<std::string, std::vector<std::pair<int, const NodeFile*>>> holders;
  for (size_t r = 0; r < listings.size(); ++r)
    for (const NodeFile& f : listings[r]) holders[f.relative].emplace_back(static_cast<int>(r), &f);
  for (const auto& [relative, held] : holders) {
    const fs::path at = fs::path(view_dir_) / relative;
    fs::create_directories(at.parent_path());
    const NodeFile& first = *held.front().second;
    File out = File::create(at.string());
    if (first.content)
      out.write_exact(0, first.content->data(), first.content->size());
    else if (::ftruncate(out.fd(), static_cast<off_t>(first.stamp.size)) != 0)
      throw Error("cannot size a placeholder in the node-local view").file(at.string());
    const std::string real = (fs::path(role_dir_) / relative).string();
    stamp_[real] = first.stamp;
    bool same_everywhere = held.size() == listings.size();
    for (const auto& [r, f] : held) {
      if (!first.content && f->stamp.size != first.stamp.size)
        throw Error("rank " + std::to_string(held.front().first) + " holds " + std::to_string(first.stamp.size) +
                    " bytes of this file, rank " + std::to_string(r) + " " + std::to_string(f->stamp.size) +
                    "; which one is the checkpoint?")
            .file(real);
      same_everywhere = same_everywhere && f->stamp == first.stamp;
    }
    // One file that every process sees (a shared filesystem): any process reads it. Otherwise
    // copies, or a file on one node: the lowest rank holding it reads it.
    owner_[real] = same_everywhere ? kAnyOwner : held.front().first;
    if (!first.content && held.front().first == rank) summarised_here_.push_back(real);
  }
}

NodeLocalView::~NodeLocalView() {
  std::error_code ec;
  fs::remove_all(temp_root_, ec);
}

std::string NodeLocalView::real_path(const std::string& path) const {
  if (path.rfind(view_dir_, 0) != 0) return path;
  return role_dir_ + path.substr(view_dir_.size());
}

std::optional<std::pair<int32_t, FileStamp>> NodeLocalView::holder_of(const std::string& real) const {
  const std::string path = fs::path(real).lexically_normal().string();
  const auto it = owner_.find(path);
  if (it == owner_.end()) return std::nullopt;
  return std::pair{it->second, stamp_.at(path)};
}

const TorchFileSummary& GatheredSummaries::torch_file(const std::string& view_path) const {
  const std::string real = view->real_path(view_path);
  const auto it = torch_files.find(real);
  if (it == torch_files.end()) throw Error("no process summarised this file (is it a tensor data file?)").file(real);
  return it->second;
}

}  // namespace shardmerge::layouts
