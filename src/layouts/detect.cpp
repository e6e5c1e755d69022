#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "layouts/layout.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/json_fields.hpp"
#include "layouts/names.hpp"
#include "util/text.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::RunRoot: return "verl run root";
    case Kind::StepRoot: return "verl step root";
    case Kind::FsdpRole: return "verl FSDP role directory";
    case Kind::MegatronRole: return "verl Megatron role directory";
    case Kind::AutomodelRole: return "verl NeMo-Automodel role directory";
    case Kind::TorchTitan: return "TorchTitan DCP checkpoint";
    case Kind::HfTree: return "HuggingFace model directory";
    case Kind::PeftAdapter: return "PEFT adapter directory";
    case Kind::Unknown: return "unknown";
  }
  return "?";
}

namespace {

const char* const kRoleNames[] = {"actor", "critic", "ref", "rollout", "reward", "reward_model"};

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}
bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

std::vector<fs::path> list_dir(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<nlohmann::ordered_json> read_json(const fs::path& p, std::vector<std::string>& warnings) {
  if (!is_file(p)) return std::nullopt;
  try {
    return nlohmann::ordered_json::parse(read_small_file(p.string()));
  } catch (const std::exception& e) {
    warnings.push_back(p.string() + ": not valid JSON (" + e.what() + ")");
    return std::nullopt;
  }
}

bool is_weight_file(const std::string& name) {
  auto ends = [&](const char* s) { return name.size() >= strlen(s) && name.compare(name.size() - strlen(s), strlen(s), s) == 0; };
  return ends(".safetensors") || ends(".bin") || ends(".pt") || ends(".pth") || ends(".gguf") ||
         name == "model.safetensors.index.json" || name == "pytorch_model.bin.index.json";
}

bool has_rank_files(const fs::path& dir) {
  for (const auto& p : list_dir(dir))
    if (parse_rank_file_name(p.filename().string(), "model")) return true;
  return false;
}

bool looks_like_megatron(const fs::path& dir) {
  return is_file(dir / "ckpt_contents.json") || is_file(dir / "checkpoint_contents_metadata.json") ||
         is_dir(dir / "model" / "dist_ckpt") || is_file(dir / "dist_ckpt" / ".metadata") ||
         is_file(dir / "transformer_config.json") || !list_mp_rank_dirs(dir / "model").empty();
}

bool is_automodel_shard(const std::string& name) {
  return name.starts_with("shard-") && name.find("-model-") != std::string::npos && name.ends_with(".safetensors");
}

bool looks_like_automodel(const fs::path& dir) {
  if (is_file(dir / "model" / "consolidated" / "config.json")) return true;
  if (!is_dir(dir / "model")) return false;
  const auto files = list_dir(dir / "model");
  return std::any_of(files.begin(), files.end(), [](const fs::path& p) { return is_automodel_shard(p.filename().string()); });
}

bool is_torchtitan_checkpoint(const fs::path& dir) {
  return parse_torchtitan_step_dir(dir.filename().string()) && is_file(dir / ".metadata");
}

// The highest step-N checkpoint in a step directory (TorchTitan keeps its latest k there).
std::optional<fs::path> torchtitan_checkpoint_in(const fs::path& dir) {
  std::optional<fs::path> best;
  std::optional<int64_t> best_step;
  for (const auto& p : list_dir(dir))
    if (auto step = parse_torchtitan_step_dir(p.filename().string());
        step && is_file(p / ".metadata") && (!best_step || *step > *best_step)) {
      best = p;
      best_step = step;
    }
  return best;
}

bool looks_like_role(const fs::path& dir) {
  return has_rank_files(dir) || is_file(dir / "fsdp_config.json") || looks_like_megatron(dir) || looks_like_automodel(dir);
}

AutomodelRole read_automodel_role(const fs::path& dir) {
  AutomodelRole role;
  role.path = dir.string();
  if (is_dir(dir / "model" / "consolidated")) role.consolidated = read_hf_tree((dir / "model" / "consolidated").string());
  for (const auto& p : list_dir(dir / "model")) role.shard_files += is_automodel_shard(p.filename().string());
  role.has_optimizer = is_file(dir / "optim" / ".metadata");
  return role;
}

FsdpRole read_fsdp_role(const fs::path& dir, std::vector<std::string>& warnings) {
  FsdpRole role;
  role.path = dir.string();
  // A world size sizes the table of rank files: one from a file name or fsdp_config.json is
  // used only when it is a plausible job size (far above any real one), not 10^11.
  constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
  auto plausible = [](int64_t w) { return w >= 1 && w <= kMaxWorldSize; };
  std::map<int64_t, std::map<int64_t, std::string>> by_world;  // world size -> rank -> path
  for (const auto& p : list_dir(dir)) {
    const std::string name = p.filename().string();
    if (auto r = parse_rank_file_name(name, "model")) {
      if (plausible(r->world_size))
        by_world[r->world_size][r->rank] = p.string();
      else
        warnings.push_back(p.string() + ": world size " + std::to_string(r->world_size) + " is not a plausible job size; ignored");
    }
    if (parse_rank_file_name(name, "optim")) ++role.optim_files;
    if (parse_rank_file_name(name, "extra_state")) ++role.extra_state_files;
  }
  if (auto cfg = read_json(dir / "fsdp_config.json", warnings)) {
    const nlohmann::ordered_json world = cfg->is_object() ? cfg->value("world_size", nlohmann::ordered_json()) : nullptr;
    if (!world.is_number_integer()) {
      warnings.push_back("fsdp_config.json has no integer world_size");
    } else if (plausible(world.get<int64_t>())) {  // (an unsigned past int64 comes out negative)
      role.world_size = world.get<int64_t>();
      role.world_size_source = "fsdp_config.json";
    } else {
      warnings.push_back((dir / "fsdp_config.json").string() + ": world_size " + world.dump() +
                         " is not a plausible job size; ignored");
    }
    if (cfg->contains("FSDP_version") && (*cfg)["FSDP_version"].is_number_integer())
      role.fsdp_version = (*cfg)["FSDP_version"].get<int>();
  }
  for (const auto& [w, _] : by_world) role.rank_file_world_sizes.push_back(w);
  if (role.world_size == 0) {
    if (by_world.size() == 1) {
      role.world_size = by_world.begin()->first;
      role.world_size_source = "rank file names";
      warnings.push_back("no fsdp_config.json world_size (older verl checkpoint); world size " +
                         std::to_string(role.world_size) + " taken from the rank file names");
    } else if (by_world.size() > 1) {
      std::string sizes;
      for (const auto& [w, _] : by_world) sizes += (sizes.empty() ? "" : ", ") + std::to_string(w);
      warnings.push_back("rank files of several world sizes (" + sizes + ") and no fsdp_config.json to choose");
    }
  }
  if (role.world_size > 0) {
    for (const auto& [w, _] : by_world)
      if (w != role.world_size)
        warnings.push_back("ignoring rank files of world size " + std::to_string(w) + " (this checkpoint has " +
                           std::to_string(role.world_size) + ")");
    role.rank_files.assign(static_cast<size_t>(role.world_size), "");
    const auto& ranks = by_world[role.world_size];
    for (const auto& [r, path] : ranks) {
      if (r >= role.world_size) {
        warnings.push_back(path + ": rank " + std::to_string(r) + " is outside world size " + std::to_string(role.world_size));
        continue;
      }
      role.rank_files[static_cast<size_t>(r)] = path;
    }
    for (int64_t r = 0; r < role.world_size; ++r)
      if (role.rank_files[static_cast<size_t>(r)].empty()) role.missing_ranks.push_back(r);
  }
  if (is_dir(dir / "huggingface")) role.huggingface = read_hf_tree((dir / "huggingface").string());
  if (auto meta = read_json(dir / "lora_train_meta.json", warnings)) role.lora_train_meta = *meta;
  if (is_file(dir / "lora_adapter" / "adapter_config.json")) {
    PeftAdapter a;
    a.path = (dir / "lora_adapter").string();
    if (auto c = read_json(dir / "lora_adapter" / "adapter_config.json", warnings)) a.config = *c;
    for (const char* w : {"adapter_model.safetensors", "adapter_model.bin"})
      if (is_file(dir / "lora_adapter" / w)) a.weights_file = (dir / "lora_adapter" / w).string();
    role.lora_adapter = std::move(a);
  }
  return role;
}

MegatronRole read_megatron_role(const fs::path& dir, std::vector<std::string>& warnings) {
  MegatronRole role;
  role.path = dir.string();
  role.has_transformer_config = is_file(dir / "transformer_config.json");
  for (const char* name : {"ckpt_contents.json", "checkpoint_contents_metadata.json"}) {
    if (auto m = read_json(dir / name, warnings)) {
      if (!m->is_object()) {
        warnings.push_back((dir / name).string() + ": not a JSON object; ignored");
        continue;
      }
      role.manifest = nlohmann::json(*m);
      role.manifest_name = name;
      break;
    }
  }
  auto hf_at = [&](const fs::path& p) {
    if (is_dir(p)) role.huggingface = read_hf_tree(p.string());
  };
  if (role.manifest) {
    role.layout = "v2 manifest";
    const auto& contents = (*role.manifest)["contents"];
    if (contents.is_object() && contents.contains("model") && contents["model"].is_object()) {
      const auto& model = contents["model"];
      const std::string manifest_path = (dir / role.manifest_name).string();
      role.model_format = json_field<std::string>(model, "format", manifest_path, "contents.model").value_or("");
      const std::string rel = json_field<std::string>(model, "path", manifest_path, "contents.model").value_or("");
      if (role.model_format == "megatron_dist_checkpoint" && !rel.empty()) role.dist_ckpt = (dir / rel).string();
    }
    hf_at(dir / "model" / "huggingface");
  } else if (is_dir(dir / "model" / "dist_ckpt") || is_dir(dir / "model" / "huggingface")) {
    role.layout = "v2 (no manifest)";
    warnings.push_back("no ckpt_contents.json: the save may not have completed (the manifest is written last)");
    if (is_file(dir / "model" / "dist_ckpt" / ".metadata")) {
      role.dist_ckpt = (dir / "model" / "dist_ckpt").string();
      role.model_format = "megatron_dist_checkpoint";
    }
    hf_at(dir / "model" / "huggingface");
  } else if (is_dir(dir / "dist_ckpt")) {
    role.layout = "v1 dist_ckpt";
    role.dist_ckpt = (dir / "dist_ckpt").string();
    role.model_format = "megatron_dist_checkpoint";
    hf_at(dir / "huggingface");
  } else {
    role.layout = "legacy mp_rank";
    hf_at(is_dir(dir / "hf_config_and_tokenizer") ? dir / "hf_config_and_tokenizer" : dir / "huggingface");
  }
  for (const auto& d : list_mp_rank_dirs(dir / "model")) role.mp_rank_dirs.push_back(d);
  if (role.huggingface && role.huggingface->weights_complete && role.model_format.empty())
    role.model_format = "huggingface";
  if (role.huggingface && is_file(fs::path(role.huggingface->path) / "adapter" / "adapter_config.json"))
    role.peft_adapter = (fs::path(role.huggingface->path) / "adapter").string();
  return role;
}

RunRoot read_run_root(const fs::path& dir) {
  RunRoot run;
  run.path = dir.string();
  for (const auto& p : list_dir(dir))
    if (auto step = parse_step_dir(p.filename().string()); step && is_dir(p)) run.steps.emplace_back(*step, p.string());
  std::sort(run.steps.begin(), run.steps.end());
  const fs::path tracker = dir / "latest_checkpointed_iteration.txt";
  if (!is_file(tracker)) {
    run.tracker_problem = "no latest_checkpointed_iteration.txt";
    return run;
  }
  const std::string text = read_small_file(tracker.string(), 4096);
  const auto parsed = parse_tracker_step(text);
  if (!parsed) {
    run.tracker_problem =
        "latest_checkpointed_iteration.txt does not hold a step number ('" + std::string(trim_whitespace(text)) + "')";
    return run;
  }
  const int64_t step = *parsed;
  run.tracker_step = step;
  const bool exists = std::any_of(run.steps.begin(), run.steps.end(), [&](const auto& s) { return s.first == step; });
  if (!exists) run.tracker_problem = "latest_checkpointed_iteration.txt points to step " + std::to_string(step) +
                                     ", which has no global_step_" + std::to_string(step) + " directory";
  return run;
}

}  // namespace

HfTree read_hf_tree(const std::string& path) {
  HfTree tree;
  tree.path = path;
  const fs::path dir(path);
  std::vector<std::string> problems;
  auto cfg = read_json(dir / "config.json", problems);
  if (cfg && !cfg->is_object()) {
    problems.push_back((dir / "config.json").string() + ": not a JSON object");
    cfg.reset();
  }
  if (!problems.empty()) tree.config_problem = problems.front();
  if (cfg) {
    tree.has_config = true;
    tree.config = *cfg;
    if (cfg->contains("architectures") && (*cfg)["architectures"].is_array() && !(*cfg)["architectures"].empty() &&
        (*cfg)["architectures"][0].is_string())
      tree.architecture = (*cfg)["architectures"][0].get<std::string>();
  }
  for (const auto& p : list_dir(dir)) {
    const std::string name = p.filename().string();
    if (is_file(p) && !is_weight_file(name)) tree.sidecar_files.push_back(name);
  }
  auto non_empty = [](const fs::path& p) {
    std::error_code ec;
    return is_file(p) && fs::file_size(p, ec) > 0;
  };
  if (is_file(dir / "model.safetensors.index.json")) {
    tree.weights = HfTree::Weights::ShardedSafetensors;
    tree.weights_complete = true;
    try {
      auto index = nlohmann::json::parse(read_small_file((dir / "model.safetensors.index.json").string()));
      std::set<std::string> shards;
      for (const auto& [k, v] : index.at("weight_map").items()) shards.insert(v.get<std::string>());
      for (const auto& s : shards) {
        tree.weight_files.push_back(s);
        if (s.find("..") != std::string::npos || s.find('/') != std::string::npos || !non_empty(dir / s)) {
          tree.missing_shards.push_back(s);
          tree.weights_complete = false;
        }
      }
      if (shards.empty()) tree.weights_complete = false;
    } catch (const std::exception&) {
      tree.weights_complete = false;
      tree.missing_shards.push_back("model.safetensors.index.json (unreadable)");
    }
  } else if (is_file(dir / "model.safetensors")) {
    tree.weights = HfTree::Weights::Safetensors;
    tree.weight_files.push_back("model.safetensors");
    tree.weights_complete = non_empty(dir / "model.safetensors");
  } else if (is_file(dir / "pytorch_model.bin") || is_file(dir / "pytorch_model.bin.index.json")) {
    tree.weights = HfTree::Weights::PytorchBin;
    tree.weights_complete = true;
  }
  if (!tree.has_config) tree.weights_complete = false;
  return tree;
}

Layout detect(const std::string& path) {
  const fs::path dir(path);
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw usage_error(path + ": no such file or directory");
  Layout layout;
  layout.path = path;
  if (!is_dir(dir)) {
    layout.warnings.push_back("not a directory; point shardmerge at a checkpoint directory");
    return layout;
  }
  if (has_rank_files(dir) || is_file(dir / "fsdp_config.json")) {
    layout.kind = Kind::FsdpRole;
    layout.info = read_fsdp_role(dir, layout.warnings);
  } else if (looks_like_megatron(dir)) {
    layout.kind = Kind::MegatronRole;
    layout.info = read_megatron_role(dir, layout.warnings);
  } else if (looks_like_automodel(dir)) {
    layout.kind = Kind::AutomodelRole;
    layout.info = read_automodel_role(dir);
  } else if (is_torchtitan_checkpoint(dir)) {
    layout.kind = Kind::TorchTitan;
    layout.info = TorchTitanCheckpoint{path, parse_torchtitan_step_dir(dir.filename().string())};
  } else if (is_file(dir / "adapter_config.json")) {
    layout.kind = Kind::PeftAdapter;
    PeftAdapter a;
    a.path = path;
    if (auto c = read_json(dir / "adapter_config.json", layout.warnings)) a.config = *c;
    for (const char* w : {"adapter_model.safetensors", "adapter_model.bin"})
      if (is_file(dir / w)) a.weights_file = (dir / w).string();
    layout.info = std::move(a);
  } else if (is_file(dir / "config.json")) {
    layout.kind = Kind::HfTree;
    layout.info = read_hf_tree(path);
  } else {
    StepRoot step;
    step.path = path;
    step.step = parse_step_dir(dir.filename().string());
    for (const char* role : kRoleNames)
      if (is_dir(dir / role) && looks_like_role(dir / role)) step.roles.push_back(role);
    step.has_dataloader_state = is_file(dir / "data.pt");
    if (auto titan = torchtitan_checkpoint_in(dir)) step.torchtitan = titan->string();
    RunRoot run = read_run_root(dir);
    if (!step.roles.empty() || step.torchtitan || (step.step && run.steps.empty())) {
      layout.kind = Kind::StepRoot;
      if (step.roles.empty() && !step.torchtitan)
        layout.warnings.push_back("no role directory (actor, critic, ...) holds a checkpoint");
      layout.info = std::move(step);
    } else if (!run.steps.empty() || run.tracker_step) {
      layout.kind = Kind::RunRoot;
      if (!run.tracker_problem.empty()) layout.warnings.push_back(run.tracker_problem);
      layout.info = std::move(run);
    }
  }
  return layout;
}

std::string resolve_role_dir(const std::string& path, const std::string& role, std::vector<std::string>& notes) {
  Layout layout = detect(path);
  if (layout.kind == Kind::RunRoot) {
    const auto& run = std::get<RunRoot>(layout.info);
    if (run.steps.empty()) throw Error("run root has no global_step_N directory").file(path);
    std::string step_dir = run.steps.back().second;
    if (run.tracker_step && run.tracker_problem.empty()) {
      for (const auto& [s, p] : run.steps)
        if (s == *run.tracker_step) step_dir = p;
      notes.push_back("run root: latest_checkpointed_iteration.txt says step " + std::to_string(*run.tracker_step) +
                      "; using " + step_dir);
    } else {
      notes.push_back("run root: " + run.tracker_problem + "; using the highest step, " + step_dir);
    }
    return resolve_role_dir(step_dir, role, notes);
  }
  if (layout.kind == Kind::StepRoot) {
    const auto& step = std::get<StepRoot>(layout.info);
    const bool has_role = std::find(step.roles.begin(), step.roles.end(), role) != step.roles.end();
    if (!has_role && step.torchtitan) {
      // verl's TorchTitan engine saves every role's model into the one step-N checkpoint
      notes.push_back("step root: using its TorchTitan checkpoint " + *step.torchtitan);
      return *step.torchtitan;
    }
    if (!has_role) {
      std::string roles;
      for (const auto& r : step.roles) roles += (roles.empty() ? "" : ", ") + r;
      throw Error("step root has no '" + role + "' checkpoint (roles here: " + (roles.empty() ? "none" : roles) + ")")
          .file(path);
    }
    const std::string dir = (fs::path(path) / role).string();
    notes.push_back("step root: using its " + role + " directory " + dir);
    return dir;
  }
  return path;
}

}  // namespace shardmerge::layouts
