#include "write/stale_temps.hpp"

#include <sys/stat.h>

#include <charconv>
#include <optional>

#include "util/process_start.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

struct TempName {
  int pid = 0;
  bool moved_aside = false;  // the `.old` of an unfinished swap
};

// Parses `<pid>-<n>` or `<pid>-<n>.old`, the part after `<name>.tmp-`.
std::optional<TempName> parse_temp_suffix(std::string_view rest) {
  TempName t;
  if (rest.ends_with(".old")) {
    t.moved_aside = true;
    rest.remove_suffix(4);
  }
  const size_t dash = rest.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == rest.size()) return std::nullopt;
  const auto [p, ec] = std::from_chars(rest.data(), rest.data() + dash, t.pid);
  if (ec != std::errc() || p != rest.data() + dash) return std::nullopt;
  for (char c : rest.substr(dash + 1))
    if (c < '0' || c > '9') return std::nullopt;
  return t;
}

}  // namespace

std::vector<std::string> clean_stale_temps(const fs::path& target) {
  std::vector<std::string> notes;
  const std::string prefix = target.filename().string() + ".tmp-";
  std::error_code ec;
  std::vector<std::pair<fs::path, TempName>> found;
  for (const auto& e : fs::directory_iterator(target.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const std::optional<TempName> t = parse_temp_suffix(std::string_view(name).substr(prefix.size()));
    struct stat st {};
    if (!t || ::lstat(e.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (process_may_have_made(t->pid, st.st_mtime)) continue;
    found.emplace_back(e.path(), *t);
  }
  for (const auto& [path, t] : found) {
    const std::string who = " (left by process " + std::to_string(t.pid) + ", which has ended)";
    std::error_code gone;
    if (t.moved_aside && !fs::exists(fs::symlink_status(target, gone))) {
      fs::rename(path, target, gone);
      if (!gone) {
        notes.push_back("put back " + target.string() + " from " + path.string() + ", where an interrupted --force" +
                        " replacement had moved it" + who);
        continue;
      }
    }
    fs::remove_all(path, gone);
    if (!gone) notes.push_back("removed " + path.string() + ", the unfinished output of an interrupted run" + who);
  }
  return notes;
}

}  // namespace shardmerge
