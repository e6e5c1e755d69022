#include "pipeline/planner.hpp"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <functional>
#include <span>

#include "layouts/fsdp.hpp"
#include "pipeline/describe.hpp"
#include "plan/hf_config_check.hpp"
#include "plan/megatron_names.hpp"
#include "plan/torchtitan_names.hpp"
#include "plan/peft_names.hpp"
#include "util/file.hpp"
#include "layouts/layout.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

bool config_ties_embeddings(const layouts::HfTree* hf) {
  if (!hf || !hf->has_config) return false;
  const auto& c = hf->config;
  if (c.contains("tie_word_embeddings") && c["tie_word_embeddings"].is_boolean()) return c["tie_word_embeddings"].get<bool>();
  // transformers' PretrainedConfig default is True; configs that omit it tie.
  return true;
}

std::optional<LoraConfig> fsdp_lora_config(const layouts::FsdpRole& role) {
  if (role.lora_adapter && role.lora_adapter->config.is_object())
    return lora_config_from_adapter_config(role.lora_adapter->config, role.lora_adapter->path + "/adapter_config.json");
  if (role.lora_train_meta) return lora_config_from_train_meta(*role.lora_train_meta, role.path + "/lora_train_meta.json");
  return std::nullopt;
}

// Megatron LoRA's r and alpha: the HF PEFT adapter verl exports beside the bridge's weights, or
// lora_train_meta.json; else only r is known (from the tensors) and --lora-alpha must say alpha.
LoraConfig megatron_lora_config(const layouts::MegatronRole& role, const layouts::HfTree* hf) {
  namespace fs = std::filesystem;
  std::vector<fs::path> adapter_configs = {fs::path(role.path) / "model" / "huggingface" / "adapter" / "adapter_config.json"};
  if (hf) adapter_configs.push_back(fs::path(hf->path) / "adapter" / "adapter_config.json");
  auto parse = [](const fs::path& p) {
    auto j = nlohmann::json::parse(read_small_file(p.string()), nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw Error("is not a JSON object").file(p.string());
    return j;
  };
  for (const fs::path& p : adapter_configs)
    if (fs::is_regular_file(p)) return lora_config_from_adapter_config(parse(p), p.string());
  const fs::path meta = fs::path(role.path) / "lora_train_meta.json";
  if (fs::is_regular_file(meta)) return lora_config_from_train_meta(parse(meta), meta.string());
  LoraConfig none;
  none.source = "the Megatron checkpoint (it does not record LoRA's alpha)";
  return none;
}

// What a planner found in the checkpoint: its PEFT split, the LoRA config, whether lm_head is
// the embedding's alias, and the base's saved names (HF base weights under LoRA modules that
// carry run-time names).
struct Found {
  const PeftSplit* split = nullptr;
  std::optional<LoraConfig> lora_config = std::nullopt;
  bool drop_tied_lm_head = false;
  const SavedNameRules* base_saved_names = nullptr;
};

// The one tail of every planner: the LoRA summary, the model groups (from what the planner
// `found`, and the LoRA options of `req`, a MergeRequest or a FoldLoraRequest), the save-time
// names where out.saved_names has rules for the rank files' run-time names, then the plan with
// the HF sidecars of `hf`.
template <typename Request>
void finish_plan(PlannedMerge& out, const Request& req, const Found& found, const std::string& source_dir,
                 const layouts::HfTree* hf, std::vector<std::string> notes) {
  ModelGroupsInput groups;
  groups.split = found.split;
  groups.config = found.lora_config;
  groups.drop_tied_lm_head = found.drop_tied_lm_head;
  groups.base_saved_names = found.base_saved_names;
  groups.mode = req.lora;
  groups.alpha_override = req.lora_alpha;
  groups.force_alpha = req.force_lora_alpha;
  out.lora_summary = describe_lora(*groups.split, groups.config);
  ModelGroups made = make_model_groups(groups);
  std::deque<SourceTensor> expert_parts;  // what the plan's per-expert tensors are cut from, until it is built
  if (out.saved_names && !groups.base_saved_names) {
    apply_saved_names(made.model, *out.saved_names, expert_parts);
    if (made.unfolded) apply_saved_names(*made.unfolded, *out.saved_names, expert_parts);
  }
  PlanInput in;
  in.sources = &out.sources;
  in.source_dir = source_dir;
  in.model_dirs = made.model_dirs();
  in.groups.push_back(std::move(made.model));
  if (made.unfolded) in.groups.push_back(std::move(*made.unfolded));
  if (made.adapter) in.groups.push_back(std::move(*made.adapter));
  if (made.adapter_config) in.extra_sidecars.push_back(*made.adapter_config);
  in.hf = hf;
  in.notes = std::move(notes);
  in.notes.insert(in.notes.end(), made.notes.begin(), made.notes.end());
  out.plan = build_plan(in, req.output);
}

// An HF model's weights with a PEFT adapter's LoRA (fold-lora, and a Megatron checkpoint whose
// bridge saved complete HF weights beside verl's adapter). `role_dir` is what the plan's target is
// kept out of; the base is another source dir unless it lies inside role_dir.
template <typename Request>
PlannedMerge plan_hf_with_adapter(const Request& req, const std::string& base_dir, const std::string& adapter_dir,
                                  const std::string& role_dir, std::vector<std::string> notes) {
  PlannedMerge out;
  out.role_dir = role_dir;
  const std::filesystem::path inside = std::filesystem::path(base_dir).lexically_relative(role_dir);
  if (inside.empty() || *inside.begin() == "..") out.other_source_dirs = {base_dir};
  out.sources = describe_hf_weights(base_dir);
  const size_t base_count = out.sources.tensors.size();
  AdapterSources adapter = describe_adapter(adapter_dir);
  append_sources(out.sources, std::move(adapter.tensors));
  out.sources.description = "HF model " + base_dir + " + PEFT adapter " + adapter_dir;

  PeftSplit split;
  const std::span<const SourceTensor> all(out.sources.tensors);
  add_peft_tensors(split, all.first(base_count), /*saved_adapter=*/false);
  add_peft_tensors(split, all.subspan(base_count), /*saved_adapter=*/true);
  for (const auto& name : split.replaced)
    notes.push_back("the adapter saves its own copy of " + name + " (e.g. a trained embedding); it replaces the base's");

  const layouts::HfTree hf = layouts::read_hf_tree(base_dir);
  const LoraConfig config = lora_config_from_adapter_config(adapter.config, adapter.config_path);
  finish_plan(out, req, {.split = &split, .lora_config = config, .drop_tied_lm_head = config_ties_embeddings(&hf)}, role_dir,
              &hf, std::move(notes));
  return out;
}

// --hf_model_path: the config and tokenizer to use instead of the checkpoint's own.
std::optional<layouts::HfTree> hf_model_path_tree(const MergeRequest& req, std::vector<std::string>& notes) {
  if (req.hf_model_path.empty()) return std::nullopt;
  layouts::HfTree tree = layouts::read_hf_tree(req.hf_model_path);
  if (!tree.has_config)
    throw usage_error("--hf_model_path " + req.hf_model_path + " has no valid config.json" +
                      (tree.config_problem.empty() ? "" : " (" + tree.config_problem + ")"));
  notes.push_back("config.json and tokenizer files from --hf_model_path " + req.hf_model_path);
  return tree;
}

// The --hf_model_path config must describe these weights (HF names).
void check_given_config(const std::optional<layouts::HfTree>& given, const std::vector<NamedShape>& shapes,
                        const std::string& weights) {
  if (given)
    check_config_matches_weights(given->config, (std::filesystem::path(given->path) / "config.json").string(), shapes,
                                 weights);
}

// Which save-time conversion turns transformers' run-time names (FSDP rank files, TorchTitan's
// experts as mapped) into what the model's save_pretrained writes (nullptr: none). A class the
// table refuses, or one it does not know whose names look like run-time-only ones, is an error
// rather than a silent copy.
const SavedNameRules* runtime_name_rules(const MergeRequest& req, const layouts::HfTree* hf, const PeftSplit& split,
                                         std::vector<std::string>& notes) {
  if (req.runtime_names) {
    notes.push_back("--keep-runtime-names: tensors keep the rank files' run-time names (transformers >= 5 loads them; "
                    "save_pretrained would write other names for some models)");
    return nullptr;
  }
  const std::string config_file = hf ? (std::filesystem::path(hf->path) / "config.json").string() : std::string();
  const SavedNameClass* row = hf && hf->has_config ? saved_name_class(hf->config) : nullptr;
  if (row && row->rules && row->rules->refused)
    throw Error("model class " + std::string(row->architecture) + " (model_type " + std::string(row->model_type) +
                "): transformers converts its tensor names on save in ways shardmerge does not reproduce; "
                "--keep-runtime-names writes the run-time names (which only transformers >= 5 loads)")
        .file(config_file);
  if (row && row->rules && row->rules->converts()) {
    notes.push_back("tensor names as " + std::string(row->architecture) + "'s save_pretrained writes them: " + std::string(row->rules->family) +
                    " (--keep-runtime-names keeps the run-time names)");
    return row->rules;
  }
  if (row) return nullptr;
  std::vector<std::string> runtime_only;
  for (const auto& [name, tensor] : split.base)
    if (looks_like_runtime_name(name, tensor->shape)) runtime_only.push_back(name);
  if (runtime_only.empty()) return nullptr;
  std::string keys;
  for (size_t i = 0; i < runtime_only.size() && i < 3; ++i) keys += (i ? ", " : "") + runtime_only[i];
  const std::string arch = hf && !hf->architecture.empty() ? "\"" + hf->architecture + "\""
                                                           : std::string("(no architectures in config.json)");
  throw Error("the rank files hold transformers run-time names (" + keys + (runtime_only.size() > 3 ? ", ..." : "") +
              ") and shardmerge has no save-time name table for model class " + arch +
              ": the names save_pretrained writes are unknown; --keep-runtime-names writes them as they are")
      .file(config_file.empty() ? req.local_dir : config_file);
}

// Whether the base weights come from --hf_model_path: the rank files hold only LoRA tensors
// (verl's save_lora_only), the LoRA is to be folded or dropped, and the given directory holds a
// complete HF model.
bool lora_only_with_base(const MergeRequest& req, const layouts::FsdpRole& role, const PeftSplit& split,
                         const std::optional<layouts::HfTree>& given) {
  if (!split.base.empty() || split.lora.empty() || req.lora == LoraMode::Adapter || !given) return false;
  if (!given->weights_complete)
    throw Error("the rank files hold only LoRA tensors (verl's save_lora_only) and --hf_model_path has no complete "
                "safetensors weights to fold them into: pass the base model's HF directory (config.json and "
                "model*.safetensors)")
        .file(given->path);
  if (req.gathered)
    throw Error("a node-local multi-process merge cannot take base weights from --hf_model_path; merge this "
                "save_lora_only checkpoint in one process")
        .file(req.gathered->view->real_path(role.path));
  return true;
}

PlannedMerge plan_fsdp(const MergeRequest& req, const layouts::FsdpRole& role, std::vector<std::string> notes) {
  PlannedMerge out;
  out.role_dir = role.path;
  out.sources = describe_fsdp(role, req.gathered);
  const std::optional<layouts::HfTree> given = hf_model_path_tree(req, notes);
  const layouts::HfTree* hf = given ? &*given : role.huggingface ? &*role.huggingface : nullptr;

  PeftSplit split = split_peft_names(out.sources);
  const bool base_from_given = lora_only_with_base(req, role, split, given);
  if (base_from_given) {
    // verl's save_lora_only: the base weights are the --hf_model_path model's, streamed from its
    // files like any source; the checkpoint's own config must describe them.
    append_sources(out.sources, describe_hf_weights(given->path));
    out.other_source_dirs = {given->path};
    split = split_peft_names(out.sources);
    notes.push_back("the rank files hold only LoRA tensors (verl's save_lora_only): base weights from --hf_model_path " +
                    given->path);
  }
  std::vector<NamedShape> base_shapes;
  for (const auto& [name, tensor] : split.base) base_shapes.emplace_back(name, &tensor->shape);
  check_given_config(given, base_shapes, role.path);
  if (base_from_given && role.huggingface && role.huggingface->has_config)
    check_config_matches_weights(role.huggingface->config,
                                 (std::filesystem::path(role.huggingface->path) / "config.json").string(), base_shapes,
                                 "--hf_model_path " + given->path + " (the base the LoRA was trained on)");
  const std::optional<LoraConfig> lora_config = split.lora.empty() ? std::nullopt : fsdp_lora_config(role);

  // FSDP rank files hold lm_head as trained: only a config that ties it makes it an alias.
  const bool tied = config_ties_embeddings(hf);
  if (req.tie_word_embedding && !tied)
    notes.push_back("--tie-word-embedding is ignored for FSDP (as verl's merger does): config.json does not tie the "
                    "embeddings, so a saved lm_head.weight is a trained matrix of its own and is kept");
  if (req.is_value_model) notes.push_back("--is-value-model only changes Megatron merges; FSDP value heads are written as saved");
  out.saved_names = runtime_name_rules(req, hf, split, notes);
  // An HF base holds saved names already; the LoRA modules keep the rank files' run-time ones.
  finish_plan(out, req,
              {.split = &split,
               .lora_config = lora_config,
               .drop_tied_lm_head = tied,
               .base_saved_names = base_from_given ? out.saved_names : nullptr},
              role.path, hf, std::move(notes));
  return out;
}

// A node-local multi-process merge gathers FSDP rank files and dist_ckpt shards only.
void refuse_node_local(const MergeRequest& req, const std::string& path, const std::string& what) {
  if (req.gathered)
    throw Error("a node-local multi-process merge reads FSDP rank files and Megatron dist_ckpt shards; " + what +
                " must be on a filesystem every process sees (or merged by one process)")
        .file(req.gathered->view->real_path(path));
}

// The checkpoint already holds complete HF weights (a bridge's or Automodel's consolidated
// save): a verified copy through the same pipeline, LoRA tensors left in the weights folded.
PlannedMerge plan_complete_hf(const MergeRequest& req, const layouts::HfTree& hf, const std::string& role_dir,
                              const std::function<std::optional<LoraConfig>()>& lora_config_of, std::vector<std::string> notes) {
  PlannedMerge out;
  out.role_dir = role_dir;
  notes.push_back("the checkpoint's HF weights in " + hf.path + " are already complete: nothing to merge, "
                  "writing a verified copy");
  out.sources = describe_hf_weights(hf.path);
  const PeftSplit split = split_peft_names(out.sources);
  std::optional<LoraConfig> lora_config;
  if (!split.lora.empty()) lora_config = lora_config_of();
  finish_plan(out, req, {.split = &split, .lora_config = lora_config, .drop_tied_lm_head = config_ties_embeddings(&hf)},
              role_dir, &hf, std::move(notes));
  return out;
}

// NeMo-Automodel: model/consolidated/ is the HF model the training processes consolidated.
PlannedMerge plan_automodel(const MergeRequest& req, const layouts::AutomodelRole& role, std::vector<std::string> notes) {
  refuse_node_local(req, role.path, "this NeMo-Automodel checkpoint's consolidated HF weights");
  const std::string consolidated = (std::filesystem::path(role.path) / "model" / "consolidated").string();
  if (!role.consolidated || !role.consolidated->weights_complete)
    throw Error("NeMo-Automodel checkpoint without complete consolidated HF weights in model/consolidated/ (" +
                std::to_string(role.shard_files) +
                " model/shard-*.safetensors files; a save with save_consolidated=False, or one that did not finish): "
                "shardmerge merges the consolidated model only")
        .file(role.consolidated && !role.consolidated->missing_shards.empty()
                  ? consolidated + "/" + role.consolidated->missing_shards.front()
                  : consolidated);
  if (!role.consolidated->config_problem.empty()) throw Error(role.consolidated->config_problem);
  return plan_complete_hf(req, *role.consolidated, role.path, [] { return std::optional<LoraConfig>(); }, std::move(notes));
}

// TorchTitan (verl's torchtitan engine): one DCP checkpoint under TorchTitan's model names,
// mapped to HF names as its own state-dict adapter does. It carries no HF config.
PlannedMerge plan_torchtitan(const MergeRequest& req, const layouts::TorchTitanCheckpoint& titan,
                             std::vector<std::string> notes) {
  refuse_node_local(req, titan.path, "this TorchTitan checkpoint");
  const std::optional<layouts::HfTree> given = hf_model_path_tree(req, notes);
  if (!given)
    throw Error("a TorchTitan checkpoint carries no HuggingFace config: pass the base model's directory (the model "
                "the run started from) as --hf_model_path")
        .file(titan.path);
  PlannedMerge out;
  out.role_dir = titan.path;
  out.sources = describe_dcp(titan.path);
  HfTensors mapped = map_torchtitan_to_hf(out.sources, given->config);
  out.sources.description = "TorchTitan " + out.sources.description;
  out.sources.tensors = std::move(mapped.tensors);  // the DCP files and records stay the sources
  notes.insert(notes.end(), mapped.notes.begin(), mapped.notes.end());
  std::vector<NamedShape> shapes;
  for (const SourceTensor& t : out.sources.tensors) shapes.emplace_back(t.name, &t.shape);
  check_given_config(given, shapes, titan.path);
  PeftSplit split;
  add_peft_tensors(split, out.sources.tensors, /*saved_adapter=*/false);
  out.saved_names = runtime_name_rules(req, &*given, split, notes);  // fused experts -> per expert
  finish_plan(out, req, {.split = &split}, titan.path, &*given, std::move(notes));
  return out;
}

// Megatron: dist_ckpt (or legacy per-rank files) -> per-layer Megatron names -> HF names.
PlannedMerge plan_megatron(const MergeRequest& req, const layouts::MegatronRole& role, std::vector<std::string> notes) {
  PlannedMerge out;
  out.role_dir = role.path;
  const layouts::HfTree* hf = role.huggingface ? &*role.huggingface : nullptr;
  if (role.dist_ckpt.empty() || (role.model_format == "huggingface" && hf && hf->weights_complete))
    refuse_node_local(req, role.path,
                      std::string("this checkpoint's ") + (role.dist_ckpt.empty() ? "legacy mp_rank files" : "HuggingFace weights"));
  if (role.model_format == "huggingface" && hf && hf->weights_complete) {
    // The bridge already saved complete HF weights: a verified copy through the same pipeline,
    // with LoRA folded (or exported) from verl's PEFT adapter beside them, or from PEFT names
    // left in the weights themselves (verl#4761).
    if (!role.peft_adapter.empty()) {
      notes.push_back("the checkpoint's HF weights in " + hf->path + " are complete; LoRA comes from the PEFT adapter in " +
                      role.peft_adapter);
      return plan_hf_with_adapter(req, hf->path, role.peft_adapter, role.path, std::move(notes));
    }
    return plan_complete_hf(req, *hf, role.path, [&] { return std::optional<LoraConfig>(megatron_lora_config(role, hf)); },
                            std::move(notes));
  }
  const std::optional<layouts::HfTree> given = hf_model_path_tree(req, notes);
  // A PEFT save through Megatron-Bridge: model/huggingface/ holds the config and the adapter in
  // PEFT's format, no base weights (model/dist_ckpt/ has the adapter's Megatron shards).
  if (role.adapter_only()) {
    if (!given || !given->weights_complete)
      throw Error("a Megatron PEFT save: " + hf->path + " holds the LoRA adapter alone (" + role.peft_adapter +
                  ", in PEFT's format) and no base weights: pass the base model's HF directory (config.json and "
                  "model*.safetensors) as --hf_model_path BASE_HF_DIR to fold it into, or use the adapter as it is")
          .file(role.path);
    notes.push_back("a Megatron PEFT save: the LoRA adapter in " + role.peft_adapter + " onto the base weights of " +
                    given->path);
    return plan_hf_with_adapter(req, given->path, role.peft_adapter, role.path, std::move(notes));
  }
  if (given) hf = &*given;
  if (hf && !hf->has_config && !hf->config_problem.empty()) throw Error(hf->config_problem);
  if (!hf || !hf->has_config)
    throw Error("no HuggingFace config.json beside the Megatron checkpoint (looked in huggingface/, model/huggingface/, "
                "hf_config_and_tokenizer/; verl's dist-only saves have none): pass the base model's directory as "
                "--hf_model_path")
        .file(role.path);
  SourceSet megatron;
  if (!role.dist_ckpt.empty()) {
    megatron = describe_dcp(role.dist_ckpt, req.gathered);
  } else if (!role.mp_rank_dirs.empty()) {
    megatron = describe_megatron_legacy(role, hf->config);
  } else {
    throw Error("Megatron role directory without model weights (no dist_ckpt, no model/mp_rank_*)").file(role.path);
  }
  MegatronMapOptions map_options;
  map_options.value_model = req.is_value_model;
  map_options.tie_word_embedding = req.tie_word_embedding;
  HfTensors mapped;
  try {
    mapped = map_megatron_to_hf(megatron, hf->config, map_options);
  } catch (Error& e) {
    // The mapping reads head and layer counts from the config: name the file the user gave.
    if (given) e.file((std::filesystem::path(given->path) / "config.json").string());
    throw;
  }
  out.sources = std::move(megatron);  // its files and records; the tensors become the mapped ones
  // Base weights first, then the LoRA tensors the mapping named as in a saved PEFT adapter.
  const auto lora_begin = std::stable_partition(mapped.tensors.begin(), mapped.tensors.end(), [](const SourceTensor& t) {
    return t.name.find(".lora_A.") == std::string::npos && t.name.find(".lora_B.") == std::string::npos;
  });
  const size_t base_count = static_cast<size_t>(lora_begin - mapped.tensors.begin());
  out.sources.tensors = std::move(mapped.tensors);
  notes.insert(notes.end(), mapped.notes.begin(), mapped.notes.end());

  PeftSplit split;
  const std::span<const SourceTensor> all(out.sources.tensors);
  std::vector<NamedShape> base_shapes;
  for (const SourceTensor& t : all.first(base_count)) base_shapes.emplace_back(t.name, &t.shape);
  check_given_config(given, base_shapes, role.path);
  add_peft_tensors(split, all.first(base_count), /*saved_adapter=*/false);
  add_peft_tensors(split, all.subspan(base_count), /*saved_adapter=*/true);
  std::optional<LoraConfig> lora_config;
  if (!split.lora.empty()) lora_config = megatron_lora_config(role, hf);
  // The mapping already dropped a tied output layer.
  finish_plan(out, req, {.split = &split, .lora_config = lora_config}, role.path, hf, std::move(notes));
  return out;
}

}  // namespace

PlannedMerge plan_fold_lora(const FoldLoraRequest& req) {
  return plan_hf_with_adapter(req, req.base_dir, req.adapter_dir, req.adapter_dir, {});
}

namespace {

// Why `merge` refuses a directory of this kind, and what to run instead.
std::string not_mergeable_reason(layouts::Kind kind, const std::string& dir) {
  switch (kind) {
    case layouts::Kind::HfTree:
      return "it is a HuggingFace model directory, not a training checkpoint (nothing to merge; `shardmerge verify` "
             "or `shardmerge diff` compare it)";
    case layouts::Kind::PeftAdapter:
      return "it is a PEFT adapter directory, not a training checkpoint (`shardmerge fold-lora --base BASE_HF_DIR "
             "--adapter " + dir + " --target_dir OUT` folds it into a model)";
    default:
      return "it is not a checkpoint shardmerge recognises (no verl FSDP rank files model_world_size_W_rank_R.pt, "
             "no Megatron dist_ckpt/ or mp_rank_*/, no run or step root); `shardmerge inspect " + dir +
             "` says what it holds";
  }
}

}  // namespace

PlannedMerge plan_merge(const MergeRequest& req) {
  std::vector<std::string> notes;
  const std::string role_dir = layouts::resolve_role_dir(req.local_dir, req.role, notes);
  layouts::Layout layout = layouts::detect(role_dir);
  for (const auto& w : layout.warnings) notes.push_back("warning: " + w);

  const bool fsdp = layout.kind == layouts::Kind::FsdpRole;
  const bool megatron = layout.kind == layouts::Kind::MegatronRole;
  if (req.backend == "fsdp" && !fsdp)
    throw Error(std::string("--backend fsdp, but this is a ") + layouts::kind_name(layout.kind)).file(role_dir);
  if (req.backend == "megatron" && !megatron)
    throw Error(std::string("--backend megatron, but this is a ") + layouts::kind_name(layout.kind)).file(role_dir);
  if (fsdp) return plan_fsdp(req, std::get<layouts::FsdpRole>(layout.info), std::move(notes));
  if (megatron) return plan_megatron(req, std::get<layouts::MegatronRole>(layout.info), std::move(notes));
  if (layout.kind == layouts::Kind::AutomodelRole && req.backend == "auto")
    return plan_automodel(req, std::get<layouts::AutomodelRole>(layout.info), std::move(notes));
  if (layout.kind == layouts::Kind::TorchTitan && req.backend == "auto")
    return plan_torchtitan(req, std::get<layouts::TorchTitanCheckpoint>(layout.info), std::move(notes));
  throw Error("cannot merge " + role_dir + ": " + not_mergeable_reason(layout.kind, role_dir));
}

}  // namespace shardmerge
