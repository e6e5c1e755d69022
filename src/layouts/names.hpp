// verl's file and directory naming conventions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardmerge::layouts {

struct RankFileName {
  int64_t world_size = 0;
  int64_t rank = 0;
};

// "<prefix>_world_size_<W>_rank_<R>.pt" (prefix: model, optim, extra_state).
std::optional<RankFileName> parse_rank_file_name(const std::string& name, const std::string& prefix);
std::string rank_file_name(const std::string& prefix, int64_t world_size, int64_t rank);

// Step directories "global_step_<N>" (and "global_steps_<N>", which some verl versions wrote).
std::optional<int64_t> parse_step_dir(const std::string& name);
// TorchTitan's checkpoint directory name, `step-N`: N.
std::optional<int64_t> parse_torchtitan_step_dir(const std::string& name);
// latest_checkpointed_iteration.txt: a step number, read as verl reads it with int()
// (surrounding whitespace allowed).
std::optional<int64_t> parse_tracker_step(std::string_view text);

// Megatron legacy per-rank directories "mp_rank_<tp:02>[_<pp:03>][_<ep:03>]".
struct MpRankName {
  int64_t tp = 0;
  std::optional<int64_t> pp;
  std::optional<int64_t> ep;
};
std::optional<MpRankName> parse_mp_rank_dir(const std::string& name);
std::vector<std::string> list_mp_rank_dirs(const std::filesystem::path& model_dir);

}  // namespace shardmerge::layouts
