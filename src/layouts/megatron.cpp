#include "layouts/megatron.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {

bool is_training_state(const std::string& fqn) {
  for (const char* prefix : {"optimizer.", "optimizer/", "lr_scheduler", "rng_state", "common_state", "opt_param_scheduler"})
    if (fqn.rfind(prefix, 0) == 0) return true;
  return false;
}

bool merge_reads_items(const DcpMetadata& meta, const DcpTensor& t) {
  return !is_training_state(t.fqn) && !meta.reformulated_shapes.count(t.fqn);
}

void check_sharded_backend(const std::string& dir) {
  const fs::path path = fs::path(dir) / "metadata.json";
  if (!fs::is_regular_file(path)) return;
  const auto cfg = nlohmann::json::parse(read_small_file(path.string()), nullptr, false);
  if (cfg.is_object() && cfg.contains("sharded_backend") && cfg["sharded_backend"] != "torch_dist")
    throw Error("sharded_backend is " + cfg["sharded_backend"].dump() + "; only torch_dist checkpoints are supported")
        .file(path.string());
}

}  // namespace shardmerge::layouts
