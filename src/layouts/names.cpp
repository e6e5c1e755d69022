#include "layouts/names.hpp"

#include <algorithm>

#include "util/text.hpp"

namespace shardmerge::layouts {

std::optional<RankFileName> parse_rank_file_name(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "_world_size_";
  const std::string mid = "_rank_";
  const std::string tail = ".pt";
  if (name.size() <= head.size() + mid.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return std::nullopt;
  const size_t m = name.find(mid, head.size());
  if (m == std::string::npos) return std::nullopt;
  const std::string_view n(name);
  const auto world_size = parse_decimal(n.substr(head.size(), m - head.size()));
  const auto rank = parse_decimal(n.substr(m + mid.size(), n.size() - tail.size() - m - mid.size()));
  if (!world_size || !rank) return std::nullopt;
  return RankFileName{*world_size, *rank};
}

std::string rank_file_name(const std::string& prefix, int64_t world_size, int64_t rank) {
  return prefix + "_world_size_" + std::to_string(world_size) + "_rank_" + std::to_string(rank) + ".pt";
}

std::optional<MpRankName> parse_mp_rank_dir(const std::string& name) {
  const std::string head = "mp_rank_";
  if (name.compare(0, head.size(), head) != 0) return std::nullopt;
  std::vector<int64_t> parts;
  size_t pos = head.size();
  while (pos <= name.size()) {
    size_t next = name.find('_', pos);
    if (next == std::string::npos) next = name.size();
    const auto v = parse_decimal(std::string_view(name).substr(pos, next - pos));
    if (!v) return std::nullopt;
    parts.push_back(*v);
    pos = next + 1;
  }
  if (parts.empty() || parts.size() > 3) return std::nullopt;
  MpRankName r;
  r.tp = parts[0];
  if (parts.size() >= 2) r.pp = parts[1];
  if (parts.size() == 3) r.ep = parts[2];
  return r;
}

std::vector<std::string> list_mp_rank_dirs(const std::filesystem::path& model_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(model_dir, ec))
    if (e.is_directory() && parse_mp_rank_dir(e.path().filename().string())) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<int64_t> parse_step_dir(const std::string& name) {
  for (const std::string prefix : {"global_step_", "global_steps_"})
    if (name.compare(0, prefix.size(), prefix) == 0)
      if (auto step = parse_decimal(std::string_view(name).substr(prefix.size()))) return step;
  return std::nullopt;
}

std::optional<int64_t> parse_torchtitan_step_dir(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return std::nullopt;
  return parse_decimal(std::string_view(name).substr(5));
}

std::optional<int64_t> parse_tracker_step(std::string_view text) { return parse_decimal(trim_whitespace(text)); }

}  // namespace shardmerge::layouts
