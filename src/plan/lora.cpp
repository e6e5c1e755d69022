#include "plan/lora.hpp"

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>
#include <unordered_map>

#include "plan/saved_names.hpp"
#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"

namespace shardmerge {

std::optional<LoraMode> lora_mode_from_string(const std::string& s) {
  if (s == "fold") return LoraMode::Fold;
  if (s == "adapter") return LoraMode::Adapter;
  if (s == "both") return LoraMode::Both;
  if (s == "drop") return LoraMode::Drop;
  return std::nullopt;
}

namespace {

// PEFT's get_pattern_key: the first pattern key k with re.match(rf"(.*\.)?({k})$", module).
template <typename V>
std::optional<V> pattern_value(const std::map<std::string, V>& patterns, const std::string& module) {
  for (const auto& [key, value] : patterns) {
    try {
      if (std::regex_match(module, std::regex("(.*\\.)?(" + key + ")"))) return value;
    } catch (const std::regex_error&) {
      throw Error("rank/alpha pattern '" + key + "' is not a regular expression we can evaluate");
    }
  }
  return std::nullopt;
}

}  // namespace

LoraConfig lora_config_from_adapter_config(const nlohmann::json& c, const std::string& source) {
  LoraConfig cfg;
  cfg.source = source;
  cfg.adapter_config = nlohmann::ordered_json(c);
  const std::string type = json_field<std::string>(c, "peft_type", source).value_or("LORA");
  if (type != "LORA") throw Error("PEFT type " + type + " is not supported; only LoRA adapters can be folded").file(source);
  if (json_field<bool>(c, "use_dora", source).value_or(false))
    throw Error("DoRA adapters (use_dora) are not supported: their magnitude re-normalisation is not implemented").file(source);
  if (c.contains("lora_bias") && c["lora_bias"].is_boolean() && c["lora_bias"].get<bool>())
    throw Error("adapters with lora_bias are not supported").file(source);
  if (c.contains("r") && c["r"].is_number_integer()) cfg.r = c["r"].get<int64_t>();
  if (c.contains("lora_alpha") && c["lora_alpha"].is_number()) cfg.alpha = c["lora_alpha"].get<double>();
  cfg.use_rslora = json_field<bool>(c, "use_rslora", source).value_or(false);
  cfg.fan_in_fan_out = json_field<bool>(c, "fan_in_fan_out", source).value_or(false);
  if (c.contains("rank_pattern") && c["rank_pattern"].is_object())
    for (const auto& [k, v] : c["rank_pattern"].items())
      if (auto r = json_field<int64_t>(c["rank_pattern"], k, source, "rank_pattern")) cfg.rank_pattern[k] = *r;
  if (c.contains("alpha_pattern") && c["alpha_pattern"].is_object())
    for (const auto& [k, v] : c["alpha_pattern"].items())
      if (auto a = json_field<double>(c["alpha_pattern"], k, source, "alpha_pattern")) cfg.alpha_pattern[k] = *a;
  if (c.contains("task_type") && c["task_type"].is_string()) cfg.task_type = c["task_type"].get<std::string>();
  return cfg;
}

LoraConfig lora_config_from_train_meta(const nlohmann::json& m, const std::string& source) {
  LoraConfig cfg;
  cfg.source = source;
  if (m.contains("r") && m["r"].is_number_integer()) cfg.r = m["r"].get<int64_t>();
  if (m.contains("lora_alpha") && m["lora_alpha"].is_number()) cfg.alpha = m["lora_alpha"].get<double>();
  if (m.contains("task_type") && m["task_type"].is_string()) cfg.task_type = m["task_type"].get<std::string>();
  cfg.use_rslora = json_field<bool>(m, "use_rslora", source).value_or(false);
  return cfg;
}

double lora_scale(const LoraConfig& config, const std::string& module, int64_t rank) {
  const int64_t r = pattern_value(config.rank_pattern, module).value_or(config.r.value_or(rank));
  if (r != rank)
    throw Error("LoRA rank " + std::to_string(rank) + " of module '" + module + "' differs from r=" + std::to_string(r) +
                " in " + config.source);
  const double alpha = pattern_value(config.alpha_pattern, module).value_or(config.alpha.value_or(0.0));
  return config.use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

namespace {

// Shapes as PEFT defines them: Linear W [out, in] (or [in, out] with fan_in_fan_out),
// A [r, in], B [out, r]; Embedding W [num, dim], A [r, num], B [dim, r].
void check_lora_shapes(const LoraModule& m, const SourceTensor& w, bool transposed) {
  const auto& a = m.a->shape;
  const auto& b = m.b->shape;
  if (w.shape.size() != 2 || a.size() != 2 || b.size() != 2 || a[0] != b[1])
    throw Error("LoRA A " + std::to_string(a.size()) + "-d / B " + std::to_string(b.size()) +
                "-d tensors do not form a rank-r update of a 2-d weight")
        .tensor(w.name);
  const int64_t out = transposed ? w.shape[1] : w.shape[0];
  const int64_t in = transposed ? w.shape[0] : w.shape[1];
  if (b[0] != out || a[1] != in)
    throw Error("LoRA update B[" + std::to_string(b[0]) + "x" + std::to_string(b[1]) + "] @ A[" + std::to_string(a[0]) +
                "x" + std::to_string(a[1]) + "] does not match the weight's shape")
        .tensor(w.name);
}

std::string alpha_text(double alpha) { return nlohmann::json(alpha).dump(); }

std::string alpha_help(const LoraConfig& c) {
  return "LoRA alpha is " + (c.alpha ? std::string("0") : std::string("missing")) + " in " +
         (c.source.empty() ? std::string("the checkpoint") : c.source) +
         " (older verl wrote lora_alpha=0); pass the value used in training with --lora-alpha N";
}

// PEFT matches a target_modules entry t against a module named n when n == t or n ends with
// "." + t. Each adapted module gets the shortest dotted suffix of its name that no other module
// of the model matches, as PEFT's own save_pretrained minimises them ("mlp.0", not "0" which
// would also match a vision block "blocks.0"). The modules are the dotted prefixes of the
// tensor names; a module that holds no tensor here (a save_lora_only checkpoint's untargeted
// layers) cannot be told apart.
bool peft_target_matches(const std::string& target, const std::string& module) {
  return module == target || (module.size() > target.size() && module.compare(module.size() - target.size(), target.size(), target) == 0 &&
                              module[module.size() - target.size() - 1] == '.');
}

std::vector<std::string> peft_target_modules(const PeftSplit& split) {
  std::set<std::string> adapted, modules;
  for (const LoraModule& m : split.lora) adapted.insert(m.module);
  const auto add_prefixes = [&](const std::string& name) {
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) modules.insert(name.substr(0, dot));
  };
  for (const auto& [name, tensor] : split.base) add_prefixes(name);
  for (const std::string& m : adapted) add_prefixes(m + ".weight");
  std::set<std::string> targets;
  for (const std::string& module : adapted) {
    for (size_t start = module.rfind('.');; start = start == 0 ? std::string::npos : module.rfind('.', start - 1)) {
      const std::string suffix = start == std::string::npos ? module : module.substr(start + 1);
      const bool only_adapted = std::all_of(modules.begin(), modules.end(), [&](const std::string& other) {
        return adapted.count(other) || !peft_target_matches(suffix, other);
      });
      if (only_adapted || start == std::string::npos) {
        targets.insert(suffix);
        break;
      }
    }
  }
  return {targets.begin(), targets.end()};
}

}  // namespace

std::vector<std::string> ModelGroups::model_dirs() const {
  std::vector<std::string> dirs = {""};
  if (unfolded) dirs.push_back(unfolded->subdir);
  return dirs;
}

ModelGroups make_model_groups(const ModelGroupsInput& in) {
  const PeftSplit& split = *in.split;
  ModelGroups out;
  out.model.file_stem = "model";
  const bool has_lora = !split.lora.empty();
  const bool fold = has_lora && (in.mode == LoraMode::Fold || in.mode == LoraMode::Both);
  const bool export_adapter = has_lora && (in.mode == LoraMode::Adapter || in.mode == LoraMode::Both);

  // verl's save_lora_only: the adapter alone. There is nothing to fold into and nothing to keep.
  if (has_lora && split.base.empty() && in.mode != LoraMode::Adapter)
    throw Error("the checkpoint holds only LoRA adapter tensors (" + std::to_string(split.lora.size()) +
                " adapted modules, no base weights, as verl's save_lora_only writes them): --lora " +
                (in.mode == LoraMode::Drop ? "drop" : in.mode == LoraMode::Both ? "both" : "fold") +
                " needs the base model: pass its HF directory as --hf_model_path BASE_HF_DIR (or write the adapter "
                "alone with --lora adapter)");
  if (!split.unsupported.empty() && has_lora && in.mode != LoraMode::Drop)
    throw Error("tensor '" + split.unsupported.front() + "' belongs to a PEFT feature that cannot be merged exactly (" +
                std::to_string(split.unsupported.size()) + " such tensors); use --lora drop to write the base weights only");
  if (split.adapter_names.size() > 1) {
    std::string names;
    for (const auto& n : split.adapter_names) names += (names.empty() ? "" : ", ") + n;
    throw Error("the checkpoint holds several adapters (" + names + "); merging more than one is not supported");
  }

  LoraConfig config;
  if (has_lora && in.mode != LoraMode::Drop) {
    if (!in.config && !in.alpha_override)
      throw Error("LoRA tensors found but no lora_train_meta.json or adapter_config.json gives r and lora_alpha; pass "
                  "--lora-alpha N (r is read from the tensors)");
    if (in.config) config = *in.config;
    else config.source = "--lora-alpha";
    // A recorded alpha is what training used: replacing it changes every folded weight, so only on request.
    const bool recorded = config.alpha && *config.alpha != 0;
    if (in.alpha_override && recorded && *in.alpha_override != *config.alpha && !in.force_alpha)
      throw usage_error("--lora-alpha " + alpha_text(*in.alpha_override) + " differs from lora_alpha=" +
                        alpha_text(*config.alpha) + " recorded in " + config.source + "; add --force-lora-alpha to use " +
                        alpha_text(*in.alpha_override) + " anyway");
    if (in.alpha_override) config.alpha = in.alpha_override;
    if (!config.alpha || *config.alpha == 0) throw Error(alpha_help(config));
  }

  std::unordered_map<std::string, size_t> base_index;
  for (size_t i = 0; i < split.base.size(); ++i) base_index.emplace(split.base[i].first, i);
  std::unordered_map<std::string, PlannedTensor::Fold> folds;
  for (const LoraModule& m : split.lora) {
    if (!m.a || !m.b) throw Error("module '" + m.module + "' has only one of its LoRA A/B tensors");
    if (!fold) continue;
    const std::string weight = in.base_saved_names ? saved_parts(*in.base_saved_names, m.module + ".weight", {}).front().name
                                                   : m.module + ".weight";
    auto it = base_index.find(weight);
    if (it == base_index.end())
      throw Error("LoRA adapts module '" + m.module + "' but the base weights have no " + weight);
    const SourceTensor& w = *split.base[it->second].second;
    const bool transposed = m.embedding || config.fan_in_fan_out;
    check_lora_shapes(m, w, transposed);
    folds[w.name] = {m.a, m.b, lora_scale(config, m.module, m.a->shape[0]), transposed};
  }

  // A tied lm_head is the input embedding under a second name; save_pretrained drops it.
  const SourceTensor* embedding = nullptr;
  for (const auto& [name, tensor] : split.base)
    if (name.find("embed") != std::string::npos && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0)
      embedding = tensor;
  const bool unfolded_copy = fold && export_adapter;  // --lora both
  if (unfolded_copy) {
    out.unfolded = OutputGroup{};
    out.unfolded->file_stem = "model";
    out.unfolded->subdir = kUnfoldedDir;
  }
  for (const auto& [name, tensor] : split.base) {
    if (in.drop_tied_lm_head && name == "lm_head.weight" && embedding && embedding->shape == tensor->shape) {
      out.notes.push_back("tie_word_embeddings: lm_head.weight is the embedding's alias and is not written "
                          "(as save_pretrained does)");
      continue;
    }
    PlannedTensor p;
    p.name = name;
    p.source = tensor;
    if (unfolded_copy) out.unfolded->tensors.push_back(p);
    if (auto f = folds.find(tensor->name); f != folds.end()) p.fold = f->second;
    out.model.tensors.push_back(std::move(p));
  }
  const std::string folded = "folded " + std::to_string(folds.size()) + " LoRA module(s) into the weights";
  if (fold && !export_adapter)
    out.notes.push_back(folded + "; no adapter is written (verl's layout, the unfolded base + lora_adapter/, is "
                                 "`merge --lora adapter`)");
  if (unfolded_copy)
    out.notes.push_back(folded + " at the target's root; " + kUnfoldedDir +
                        "/ holds verl's layout (the unfolded base + lora_adapter/)");
  if (has_lora && in.mode == LoraMode::Drop) out.notes.push_back("--lora drop: LoRA tensors are not written");

  if (export_adapter) {
    const std::string dir = unfolded_copy ? std::string(kUnfoldedDir) + "/lora_adapter" : "lora_adapter";
    OutputGroup adapter;
    adapter.file_stem = "adapter_model";
    adapter.subdir = dir;
    adapter.shard = false;
    adapter.metadata = {};  // verl saves the adapter with safetensors' save_file, without metadata
    for (const LoraModule& m : split.lora) {
      const std::string prefix = "base_model.model." + m.module;
      const std::string a = prefix + (m.embedding ? ".lora_embedding_A" : ".lora_A.weight");
      const std::string b = prefix + (m.embedding ? ".lora_embedding_B" : ".lora_B.weight");
      adapter.tensors.push_back({a, m.a, std::nullopt, false});
      adapter.tensors.push_back({b, m.b, std::nullopt, false});
    }
    // Start from the training adapter_config.json when there is one; make sure what PEFT needs is right.
    nlohmann::ordered_json cfg = config.adapter_config.is_object() ? config.adapter_config : nlohmann::ordered_json::object();
    cfg["peft_type"] = "LORA";
    cfg["r"] = config.r.value_or(split.lora.front().a->shape[0]);
    cfg["lora_alpha"] = *config.alpha;
    if (!cfg.contains("target_modules") || cfg["target_modules"].is_null() || cfg["target_modules"] == "all-linear")
      cfg["target_modules"] = peft_target_modules(split);
    if (!config.task_type.empty()) cfg["task_type"] = config.task_type;
    if (!cfg.contains("bias")) cfg["bias"] = "none";
    cfg["use_rslora"] = config.use_rslora;
    cfg["fan_in_fan_out"] = config.fan_in_fan_out;
    if (!cfg.contains("lora_dropout")) cfg["lora_dropout"] = 0.0;
    cfg["inference_mode"] = true;
    out.adapter = std::move(adapter);
    out.adapter_config = Sidecar{dir + "/adapter_config.json", "", cfg.dump(2) + "\n"};
    out.notes.push_back("wrote the LoRA adapter to " + dir + "/ (r=" + cfg["r"].dump() + ", lora_alpha=" +
                        cfg["lora_alpha"].dump() + ")");
  }
  return out;
}

std::vector<std::string> describe_lora(const PeftSplit& split, const std::optional<LoraConfig>& config) {
  std::vector<std::string> lines;
  if (split.lora.empty()) return lines;
  std::set<std::string> targets;
  for (const auto& m : split.lora) targets.insert(m.module.substr(m.module.rfind('.') + 1));
  std::string t;
  for (const auto& s : targets) t += (t.empty() ? "" : ",") + s;
  const int64_t r = split.lora.front().a ? split.lora.front().a->shape[0] : 0;
  std::string alpha = config && config->alpha ? nlohmann::json(*config->alpha).dump() : "unknown";
  lines.push_back("LoRA: " + std::to_string(split.lora.size()) + " adapted modules, r=" + std::to_string(r) +
                  ", lora_alpha=" + alpha + (config && config->use_rslora ? " (rsLoRA)" : "") + ", targets " + t +
                  (config && !config->source.empty() ? " [from " + config->source + "]" : ""));
  if (!split.unsupported.empty())
    lines.push_back("LoRA: " + std::to_string(split.unsupported.size()) + " tensors of unsupported PEFT features (e.g. " +
                    split.unsupported.front() + "): only --lora drop can merge this checkpoint");
  lines.push_back("  --lora fold:    base weights with W + scale*B@A folded in, no adapter (default)");
  lines.push_back("  --lora adapter: unfolded base weights + lora_adapter/ (PEFT format, verl's layout)");
  lines.push_back(std::string("  --lora both:    folded weights; ") + kUnfoldedDir + "/ = unfolded base + lora_adapter/");
  lines.push_back("  --lora drop:    base weights only");
  if (!config || !config->alpha || *config->alpha == 0)
    lines.push_back("  warning: lora_alpha is missing or 0; fold/adapter need --lora-alpha N");
  return lines;
}

}  // namespace shardmerge
