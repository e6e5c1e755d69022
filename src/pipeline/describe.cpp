#include "pipeline/describe.hpp"

#include <filesystem>
#include <vector>

#include "layouts/fsdp.hpp"
#include "layouts/megatron.hpp"
#include "shardmerge/error.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge {

SourceSet describe_fsdp(const layouts::FsdpRole& role, const layouts::GatheredSummaries* gathered) {
  layouts::check_fsdp_role(role);
  if (!gathered) return combine_fsdp(role, layouts::summarise_rank_files(role));
  std::vector<layouts::RankFileSummary> files;
  for (size_t r = 0; r < role.rank_files.size(); ++r)
    if (!role.rank_files[r].empty()) files.push_back({static_cast<int64_t>(r), gathered->torch_file(role.rank_files[r])});
  return combine_fsdp(role, files);
}

SourceSet describe_dcp(const std::string& dir, const layouts::GatheredSummaries* gathered) {
  layouts::check_sharded_backend(dir);
  if (!gathered) return combine_dcp(layouts::summarise_dcp(dir));
  // The .metadata from the view, the items from the processes holding each .distcp file.
  layouts::DcpSummary dcp = gathered->dcp;
  dcp.metadata = read_dcp_metadata(dir);
  dcp.metadata.dir = gathered->view->real_path(dir);
  for (const DcpTensor& t : dcp.metadata.tensors) {
    if (!layouts::merge_reads_items(dcp.metadata, t)) continue;
    for (const DcpChunk& c : t.chunks)
      if (!(c.transforms.empty() ? dcp.stored_items : dcp.compressed_items).count({c.relative_path, c.offset}))
        throw Error("no process holds this file, which .metadata says holds tensor " + t.fqn)
            .file(dcp.metadata.dir + "/" + c.relative_path);
  }
  return combine_dcp(dcp);
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
