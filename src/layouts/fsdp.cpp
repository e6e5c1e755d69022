#include "layouts/fsdp.hpp"

#include <algorithm>
#include <filesystem>
#include <future>
#include <map>

#include "layouts/names.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::layouts {

void check_fsdp_role(const FsdpRole& role) {
  if (role.world_size <= 0) {
    std::string sizes;
    for (int64_t w : role.rank_file_world_sizes) sizes += (sizes.empty() ? "" : ", ") + std::to_string(w);
    if (role.rank_file_world_sizes.size() > 1)
      throw Error("cannot tell the world size: rank files of world sizes " + sizes +
                  " and no fsdp_config.json to choose; move the stale ones away").file(role.path);
    throw Error("cannot tell the world size: no fsdp_config.json and no model_world_size_W_rank_R.pt files").file(role.path);
  }
  // Any present rank will do for names and order: with replicas (HSDP) rank 0 may be gone.
  if (std::all_of(role.rank_files.begin(), role.rank_files.end(), [](const std::string& f) { return f.empty(); }))
    throw Error("no " + rank_file_name("model", role.world_size, 0) + "-style rank file is present").file(role.path);
}

std::vector<RankFileSummary> summarise_rank_files(const FsdpRole& role) {
  std::vector<RankFileSummary> out;
  for (size_t r = 0; r < role.rank_files.size(); ++r)
    if (!role.rank_files[r].empty()) out.push_back({static_cast<int64_t>(r), {}});
  // Parsing pickles is independent per file; a few threads hide per-file latency.
  std::vector<std::future<void>> jobs;
  for (RankFileSummary& s : out) {
    jobs.push_back(std::async(std::launch::async, [&role, &s] { s.file = summarise_torch_file(role.rank_files[s.rank]); }));
    if (jobs.size() >= 8) {
      for (auto& j : jobs) j.get();
      jobs.clear();
    }
  }
  for (auto& j : jobs) j.get();
  return out;
}

}  // namespace shardmerge::layouts
