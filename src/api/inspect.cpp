// `inspect`: what a path holds and what to run next, from names, small JSON files, pickles and
// headers only (never tensor data), as the JSON report both `shardmerge inspect --json` and
// shardmerge.inspect() give.
#include "api/inspect.hpp"

#include <filesystem>
#include <set>

#include "formats/dcp.hpp"
#include "layouts/fsdp.hpp"
#include "layouts/layout.hpp"
#include "layouts/megatron.hpp"
#include "layouts/names.hpp"
#include "layouts/summaries.hpp"
#include "pipeline/describe.hpp"
#include "plan/lora.hpp"
#include "plan/peft_names.hpp"
#include "plan/saved_names.hpp"
#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace shardmerge::api {
namespace {

std::string quote(const std::string& path) {
  return path.find_first_of(" \t'\"$") == std::string::npos ? path : "'" + path + "'";
}

// A target directory beside (never inside) the checkpoint that does not exist yet, so that the
// suggested command works again after it has been run: NAME_hf, then NAME_hf-2, ...
std::string suggested_target(const std::string& role_dir) {
  fs::path p = fs::absolute(role_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::string name = p.filename().string();
  fs::path parent = p.parent_path();
  if (!parent.filename().empty() && parent.filename().string().rfind("global_step", 0) == 0) {
    name = parent.filename().string() + "_" + name;
    parent = parent.parent_path();
  }
  std::error_code ec;
  fs::path target = parent / (name + "_hf");
  for (int n = 2; fs::exists(fs::symlink_status(target, ec)); ++n) target = parent / (name + "_hf-" + std::to_string(n));
  return target.string();
}

std::string merge_command(const std::string& role_dir, const std::string& backend) {
  return "shardmerge merge --backend " + backend + " --local_dir " + quote(role_dir) + " --target_dir " +
         quote(suggested_target(role_dir));
}

// The command that merges a role directory of this kind.
std::string merge_command(const std::string& role_dir, layouts::Kind kind) {
  if (kind == layouts::Kind::TorchTitan)  // no HF config in it
    return merge_command(role_dir, "auto") + " --hf_model_path BASE_HF_DIR";
  return merge_command(role_dir, kind == layouts::Kind::MegatronRole    ? "megatron"
                                 : kind == layouts::Kind::AutomodelRole ? "auto"
                                                                        : "fsdp");
}

json hf_json(const layouts::HfTree& hf) {
  json j;
  j["path"] = hf.path;
  j["config"] = hf.has_config;
  if (!hf.architecture.empty()) j["architecture"] = hf.architecture;
  const char* weights[] = {"none", "model.safetensors", "sharded safetensors", "pytorch_model.bin"};
  j["weights"] = weights[static_cast<int>(hf.weights)];
  j["weights_complete"] = hf.weights_complete;
  if (!hf.missing_shards.empty()) j["missing_shards"] = hf.missing_shards;
  j["sidecar_files"] = hf.sidecar_files;
  return j;
}

json tensors_json(const SourceSet& set) {
  json list = json::array();
  for (const auto& t : set.tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    list.push_back({{"name", t.name},
                    {"dtype", dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"placement", t.origin},
                    {"bytes", numel * dtype_size(t.dtype)}});
  }
  return list;
}

void fsdp_report(const layouts::FsdpRole& role, bool with_tensors, json& j, std::vector<std::string>& warnings) {
  j["world_size"] = role.world_size;
  j["world_size_from"] = role.world_size_source;
  if (role.fsdp_version) j["fsdp_version"] = role.fsdp_version;
  std::vector<int64_t> present;
  for (size_t r = 0; r < role.rank_files.size(); ++r)
    if (!role.rank_files[r].empty()) present.push_back(static_cast<int64_t>(r));
  j["ranks_present"] = present;
  j["ranks_missing"] = role.missing_ranks;
  j["optimizer_files"] = role.optim_files;
  j["extra_state_files"] = role.extra_state_files;
  if (role.huggingface) j["huggingface"] = hf_json(*role.huggingface);
  else warnings.push_back("no huggingface/ directory: the merge will have weights but no config or tokenizer");
  if (role.lora_train_meta) j["lora_train_meta"] = *role.lora_train_meta;
  if (role.lora_adapter) j["lora_adapter"] = role.lora_adapter->path;
  if (role.world_size <= 0 || present.empty()) return;
  try {
    SourceSet set = describe_fsdp(role);
    j["layout"] = set.description;
    uint64_t bytes = 0, params = 0;
    for (const auto& t : set.tensors) {
      uint64_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      params += n;
      bytes += n * dtype_size(t.dtype);
    }
    j["tensors"] = set.tensors.size();
    j["parameters"] = params;
    j["source_tensor_bytes"] = bytes;
    for (const auto& n : set.notes) warnings.push_back(n);
    const PeftSplit split = split_peft_names(set);
    std::optional<LoraConfig> cfg;
    try {
      if (role.lora_adapter && role.lora_adapter->config.is_object())
        cfg = lora_config_from_adapter_config(role.lora_adapter->config, role.lora_adapter->path + "/adapter_config.json");
      else if (role.lora_train_meta)
        cfg = lora_config_from_train_meta(*role.lora_train_meta, role.path + "/lora_train_meta.json");
    } catch (const Error& e) {
      warnings.push_back(e.what());
    }
    if (!split.lora.empty()) j["lora"] = describe_lora(split, cfg);
    j["lora_only"] = !split.lora.empty() && split.base.empty();
    if (j["lora_only"])
      warnings.push_back("the rank files hold only LoRA tensors (verl's save_lora_only): fold them into the base model "
                         "with --hf_model_path BASE_HF_DIR, or write the adapter alone with --lora adapter");
    // Which names the merge writes: the model class's saved names (plan/saved_names.hpp); a
    // class the table does not list saves its run-time names.
    if (role.huggingface && role.huggingface->has_config) {
      const json& config = role.huggingface->config;
      const SavedNameClass* row = saved_name_class(config);
      json names;
      names["class"] = row ? std::string(row->architecture) : role.huggingface->architecture;
      names["model_type"] = row ? std::string(row->model_type) : config.value("model_type", std::string());
      names["conversion"] = row && row->rules && row->rules->converts() ? json(std::string(row->rules->family)) : json(nullptr);
      names["refused"] = row && row->rules && row->rules->refused;
      j["saved_names"] = std::move(names);
      if (row && row->rules && row->rules->refused)
        warnings.push_back("transformers converts " + std::string(row->architecture) +
                           "'s names on save in ways shardmerge does not reproduce: merge needs --keep-runtime-names");
    }
    if (with_tensors) j["tensor_list"] = tensors_json(set);
  } catch (const Error& e) {
    warnings.push_back(std::string("cannot be merged as is: ") + e.what());
    j["mergeable"] = false;
  }
}

// dist_ckpt contents from .metadata alone: model tensors with their global shapes and chunk
// grids (distinct chunk offsets per dim), training state counted apart.
// What transformer_config.json (Megatron's TransformerConfig, as verl saves it) says the model
// holds: the attention kind, experts and where they are, multi-token-prediction layers.
json model_holds(const layouts::MegatronRole& role, std::vector<std::string>& warnings) {
  const std::string path = (fs::path(role.path) / "transformer_config.json").string();
  json c;
  try {
    c = json::parse(read_small_file(path, 16u << 20));
  } catch (const std::exception& e) {
    warnings.push_back(path + " is not JSON: " + e.what());
    return nullptr;
  }
  if (!c.is_object()) return nullptr;
  auto integer = [&](const char* key) { return c.contains(key) && c[key].is_number_integer() ? c[key].get<int64_t>() : 0; };
  auto flag = [&](const char* key) { return c.contains(key) && c[key].is_boolean() && c[key].get<bool>(); };
  json h = json::object();
  if (integer("num_layers")) h["layers"] = integer("num_layers");
  if (flag("multi_latent_attention"))
    h["attention"] = "multi-head latent (q_lora_rank " +
                     (c.contains("q_lora_rank") && c["q_lora_rank"].is_number_integer() ? std::to_string(integer("q_lora_rank")) : "none") +
                     ", kv_lora_rank " + std::to_string(integer("kv_lora_rank")) + ")";
  else if (integer("num_attention_heads"))
    h["attention"] = std::to_string(integer("num_attention_heads")) + " heads, " +
                     std::to_string(integer("num_query_groups") ? integer("num_query_groups") : integer("num_attention_heads")) +
                     " KV groups";
  if (const int64_t experts = integer("num_moe_experts")) {
    h["experts"] = experts;
    // moe_layer_freq: a 0/1 list per layer, or N for every N-th layer (from layer 0)
    if (c.contains("moe_layer_freq") && c["moe_layer_freq"].is_array()) {
      int64_t moe = 0;
      for (const auto& f : c["moe_layer_freq"]) moe += f.is_number_integer() && f.get<int64_t>() == 1;
      h["moe_layers"] = moe;
    } else if (const int64_t every = integer("moe_layer_freq"); every > 0) {
      h["moe_layers"] = (integer("num_layers") + every - 1) / every;
    }
    h["shared_experts"] = integer("moe_shared_expert_intermediate_size") > 0;
    h["expert_bias"] = flag("moe_router_enable_expert_bias");
  }
  if (const int64_t mtp = integer("mtp_num_layers")) h["mtp_layers"] = mtp;
  return h;
}

void megatron_report(const layouts::MegatronRole& role, bool with_tensors, json& j, std::vector<std::string>& warnings) {
  if (role.dist_ckpt.empty()) return;
  try {
    // .metadata alone: no item is read.
    const DcpMetadata meta = read_dcp_metadata(role.dist_ckpt);
    json list = json::array();
    size_t model = 0, state = 0;
    uint64_t bytes = 0;
    bool vision = false;
    for (const DcpTensor& t : meta.tensors) {
      if (layouts::is_training_state(t.fqn)) {
        ++state;
        continue;
      }
      ++model;
      vision = vision || t.fqn.starts_with("vision_model.");
      uint64_t n = dtype_size(t.dtype);
      for (int64_t d : t.size) n *= static_cast<uint64_t>(d);
      bytes += n;
      if (!with_tensors) continue;
      std::string grid;
      for (size_t d = 0; d < t.size.size(); ++d) {
        std::set<int64_t> offsets;
        for (const DcpChunk& c : t.chunks) offsets.insert(c.offsets.at(d));
        if (!grid.empty()) grid += 'x';
        grid += std::to_string(offsets.size());
      }
      list.push_back({{"name", t.fqn}, {"dtype", dtype_name(t.dtype)}, {"shape", t.size}, {"bytes", n},
                      {"placement", std::to_string(t.chunks.size()) + " chunk(s), grid " + grid}});
    }
    if (vision && j.contains("model")) j["model"]["vision_tower"] = true;  // mbridge's vision_model.*
    j["dist_ckpt_tensors"] = model;
    j["source_tensor_bytes"] = bytes;
    if (state) j["dist_ckpt_training_state_tensors"] = state;
    if (!meta.bytes_items.empty()) j["dist_ckpt_bytes_items"] = meta.bytes_items.size();
    if (with_tensors) j["tensor_list"] = list;
  } catch (const Error& e) {
    warnings.push_back(std::string("cannot read the dist_ckpt: ") + e.what());
  }
}

std::string placement_of(const StateEntry& e) {
  if (e.is_plain()) return "plain tensor";
  if (const auto* d = std::get_if<DTensorValue>(&e.value)) {
    std::string p;
    for (const auto& pl : d->placements) p += (p.empty() ? "" : ", ") + pl.to_string();
    return "DTensor [" + p + "] local " + shape_string(d->local.size);
  }
  return "ShardedTensor, " + std::to_string(std::get<ShardedTensorValue>(e.value).local_shards.size()) + " local shard(s)";
}

json safetensors_tensor_list(const std::string& path) {
  json list = json::array();
  for (const auto& t : layouts::summarise_safetensors_file(path).tensors)
    list.push_back({{"name", t.name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"bytes", t.nbytes}});
  return list;
}

// A single file: a torch.save archive or a safetensors file.
json file_report(const std::string& path) {
  json j;
  j["path"] = path;
  json list = json::array();
  if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0) {
    j["kind"] = "safetensors file";
    list = safetensors_tensor_list(path);
  } else {
    j["kind"] = "torch.save file";
    for (const auto& e : layouts::summarise_torch_file(path).entries) {
      uint64_t n = dtype_size(e.dtype());
      for (int64_t d : e.global_shape()) n *= static_cast<uint64_t>(d);
      list.push_back({{"name", e.name}, {"dtype", dtype_name(e.dtype())}, {"shape", e.global_shape()},
                      {"placement", placement_of(e)}, {"bytes", n}});
    }
  }
  j["tensors"] = list.size();
  j["tensor_list"] = list;
  j["warnings"] = json::array();
  j["next"] = json::array();
  return j;
}

}  // namespace

json inspect(const std::string& path, bool with_tensors) {
  if (fs::is_regular_file(path)) return file_report(path);
  layouts::Layout layout = layouts::detect(path);
  json j;
  j["path"] = path;
  j["kind"] = layouts::kind_name(layout.kind);
  std::vector<std::string> warnings = layout.warnings;
  std::vector<std::string> next;
  switch (layout.kind) {
    case layouts::Kind::RunRoot: {
      const auto& run = std::get<layouts::RunRoot>(layout.info);
      json steps = json::array();
      for (const auto& [s, p] : run.steps) steps.push_back({{"step", s}, {"path", p}});
      j["steps"] = steps;
      if (run.tracker_step) j["tracker_step"] = *run.tracker_step;
      j["tracker_ok"] = run.tracker_problem.empty();
      std::vector<std::string> notes;
      try {
        const std::string role_dir = layouts::resolve_role_dir(path, "actor", notes);
        j["resolves_to"] = role_dir;
        layouts::Layout role = layouts::detect(role_dir);
        next.push_back(merge_command(role_dir, role.kind));
      } catch (const Error& e) {
        warnings.push_back(e.what());
      }
      break;
    }
    case layouts::Kind::StepRoot: {
      const auto& step = std::get<layouts::StepRoot>(layout.info);
      if (step.step) j["step"] = *step.step;
      j["roles"] = step.roles;
      j["dataloader_state"] = step.has_dataloader_state;
      for (const auto& r : step.roles) {
        const std::string dir = (fs::path(path) / r).string();
        next.push_back(merge_command(dir, layouts::detect(dir).kind));
      }
      if (step.torchtitan) {
        j["torchtitan"] = *step.torchtitan;
        next.push_back(merge_command(*step.torchtitan, layouts::Kind::TorchTitan));
      }
      break;
    }
    case layouts::Kind::FsdpRole: {
      const auto& role = std::get<layouts::FsdpRole>(layout.info);
      fsdp_report(role, with_tensors, j, warnings);
      if (!role.missing_ranks.empty()) {
        std::string m;
        for (int64_t r : role.missing_ranks) m += (m.empty() ? "" : ", ") + layouts::rank_file_name("model", role.world_size, r);
        warnings.push_back("missing rank files: " + m +
                           " (multi-node runs keep each node's ranks on its own disk: copy them here)");
      }
      if (j.value("lora_only", false)) {
        next.push_back(merge_command(path, "fsdp") + " --hf_model_path BASE_HF_DIR   # fold into the base");
        next.push_back(merge_command(path, "fsdp") + " --lora adapter   # the adapter alone");
      } else if (j.value("mergeable", true)) {
        next.push_back(merge_command(path, "fsdp"));
      }
      break;
    }
    case layouts::Kind::MegatronRole: {
      const auto& role = std::get<layouts::MegatronRole>(layout.info);
      j["layout"] = role.layout;
      if (role.manifest) {
        j["manifest"] = role.manifest_name;
        if (role.manifest->contains("contents")) j["contents"] = (*role.manifest)["contents"];
      }
      j["model_format"] = role.model_format;
      if (!role.dist_ckpt.empty()) j["dist_ckpt"] = role.dist_ckpt;
      j["transformer_config"] = role.has_transformer_config;
      if (role.has_transformer_config)
        if (json holds = model_holds(role, warnings); !holds.is_null()) j["model"] = std::move(holds);
      if (!role.mp_rank_dirs.empty()) j["mp_rank_dirs"] = role.mp_rank_dirs;
      if (role.huggingface) j["huggingface"] = hf_json(*role.huggingface);
      megatron_report(role, with_tensors, j, warnings);
      if (!role.huggingface || !role.huggingface->has_config)
        warnings.push_back("no HF config.json in the checkpoint (verl's dist-only saves): merge with --hf_model_path "
                           "BASE_MODEL_DIR");
      if (role.huggingface && role.huggingface->weights_complete)
        warnings.push_back("the HF weights are already complete in " + role.huggingface->path +
                           ": nothing needs merging (copy that directory)");
      if (role.adapter_only()) {
        warnings.push_back("a PEFT save: " + role.peft_adapter + " holds the LoRA adapter alone, no base weights");
        next.push_back(merge_command(path, "megatron") + " --hf_model_path BASE_HF_DIR   # fold into the base");
      } else {
        next.push_back(merge_command(path, "megatron"));
      }
      break;
    }
    case layouts::Kind::AutomodelRole: {
      const auto& role = std::get<layouts::AutomodelRole>(layout.info);
      j["model_shard_files"] = role.shard_files;
      j["optimizer"] = role.has_optimizer;
      if (role.consolidated) j["consolidated"] = hf_json(*role.consolidated);
      if (role.consolidated && role.consolidated->weights_complete) {
        warnings.push_back("model/consolidated/ already holds the complete HF model: merge writes a verified copy of it");
        next.push_back(merge_command(path, layout.kind));
      } else {
        warnings.push_back("no complete consolidated HF model in model/consolidated/ (save_consolidated=False, or the "
                           "save did not finish): shardmerge merges the consolidated model only");
      }
      break;
    }
    case layouts::Kind::TorchTitan: {
      const auto& titan = std::get<layouts::TorchTitanCheckpoint>(layout.info);
      if (titan.step) j["step"] = *titan.step;
      warnings.push_back("TorchTitan checkpoints carry no HF config: merge with --hf_model_path BASE_HF_DIR (the model "
                         "the run started from)");
      next.push_back(merge_command(path, layout.kind));
      break;
    }
    case layouts::Kind::HfTree: {
      const auto& hf = std::get<layouts::HfTree>(layout.info);
      j["huggingface"] = hf_json(hf);
      if (with_tensors && (hf.weights == layouts::HfTree::Weights::Safetensors ||
                           hf.weights == layouts::HfTree::Weights::ShardedSafetensors)) {
        const layouts::HfWeightsSummary w = layouts::summarise_hf_weights(path);
        json list = json::array();
        for (const auto& [name, index] : w.file_of) {
          const layouts::SafetensorsSummary& file = w.files[index];
          for (const auto& t : file.tensors)
            if (t.name == name)
              list.push_back({{"name", name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape},
                              {"file", fs::path(file.path).filename().string()}, {"bytes", t.nbytes}});
        }
        j["tensor_list"] = list;
      }
      next.push_back("shardmerge verify --local_dir CHECKPOINT_DIR --test_hf_dir " + quote(path) +
                     "   # is this the merge of that checkpoint?");
      next.push_back("shardmerge diff " + quote(path) + " OTHER_HF_DIR   # which tensors differ, and by how much");
      break;
    }
    case layouts::Kind::PeftAdapter: {
      const auto& a = std::get<layouts::PeftAdapter>(layout.info);
      j["adapter_config"] = a.config;
      j["weights_file"] = a.weights_file;
      if (with_tensors && a.weights_file.size() > 12 &&
          a.weights_file.compare(a.weights_file.size() - 12, 12, ".safetensors") == 0)
        j["tensor_list"] = safetensors_tensor_list(a.weights_file);
      next.push_back("shardmerge fold-lora --base BASE_HF_DIR --adapter " + quote(path) + " --target_dir OUT");
      next.push_back("shardmerge diff " + quote(path) + " OTHER_ADAPTER_DIR   # which tensors differ, and by how much");
      break;
    }
    case layouts::Kind::Unknown:
      warnings.push_back("no verl checkpoint, HuggingFace model or PEFT adapter found here");
      break;
  }
  j["warnings"] = warnings;
  j["next"] = next;
  return j;
}

}  // namespace shardmerge::api
