#include "pipeline/describe.hpp"

#include <filesystem>
#include <vector>

#include "layouts/fsdp.hpp"
#include "layouts/megatron.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge {

SourceSet describe_fsdp(const layouts::FsdpRole& role) {
  layouts::check_fsdp_role(role);
  return combine_fsdp(role, layouts::summarise_rank_files(role));
}

SourceSet describe_megatron_dist(const std::string& dir) {
  layouts::check_sharded_backend(dir);
  return combine_megatron_dist(
      layouts::summarise_dcp(dir, [](const std::string& fqn) { return !layouts::is_training_state(fqn); }));
}

SourceSet describe_megatron_legacy(const layouts::MegatronRole& role, const nlohmann::ordered_json& config) {
  check_mp_rank_dirs(role);
  std::vector<layouts::TorchFileSummary> files;
  for (const std::string& dir : role.mp_rank_dirs)
    files.push_back(layouts::summarise_torch_file((std::filesystem::path(dir) / "model.pt").string()));
  return combine_megatron_legacy(role, config, files);
}

SourceSet describe_hf_weights(const std::string& dir) { return combine_hf_weights(layouts::summarise_hf_weights(dir)); }

AdapterSources describe_adapter(const std::string& dir) { return combine_adapter(layouts::summarise_adapter(dir)); }

}  // namespace shardmerge
