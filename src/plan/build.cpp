#include "plan/build.hpp"

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "formats/safetensors.hpp"
#include "plan/saved_names.hpp"
#include "util/json_text.hpp"
#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

std::string shard_file_name(const std::string& stem, size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", index + 1, count);
  return stem + buf;
}

// huggingface_hub's split_state_dict_into_shards_factory: greedy, in order; a tensor larger
// than the limit gets a shard of its own and the current shard stays open. Tensors that share a
// storage (`storage[i]`, non-null) follow the first of them, which counts the storage's bytes.
using StorageKey = std::pair<const SourceTensor*, int64_t>;
std::vector<std::vector<size_t>> split_into_shards(const std::vector<uint64_t>& sizes,
                                                   const std::vector<StorageKey>& storage, uint64_t max_shard) {
  std::map<StorageKey, uint64_t> storage_bytes;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (storage[i].first) storage_bytes[storage[i]] += sizes[i];
  std::map<StorageKey, size_t> storage_first;  // -> the first tensor's index
  std::vector<size_t> followers;
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  // Each tensor's shard: a follower joins its storage's first tensor there.
  auto place_followers = [&] {
    std::vector<size_t> shard_of(sizes.size());
    for (size_t s = 0; s < shards.size(); ++s)
      for (size_t i : shards[s]) shard_of[i] = s;
    for (size_t i : followers) shards[shard_of[storage_first.at(storage[i])]].push_back(i);
  };
  for (size_t i = 0; i < sizes.size(); ++i) {
    uint64_t size = sizes[i];
    if (storage[i].first) {
      if (!storage_first.try_emplace(storage[i], i).second) {
        followers.push_back(i);
        continue;
      }
      size = storage_bytes.at(storage[i]);
    }
    if (size > max_shard) {
      shards.push_back({i});
      continue;
    }
    if (current_size + size > max_shard && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += size;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  place_followers();
  return shards;
}

// The model index as transformers writes it (json.dumps with sort_keys and indent 2, then a
// newline), written directly: 100k weight_map entries as json values cost more than the rest
// of planning.
std::string index_json(uint64_t total_params, uint64_t total_size,
                       std::vector<std::pair<std::string_view, size_t>> weight_map,
                       const std::vector<std::string>& shard_names) {
  std::sort(weight_map.begin(), weight_map.end());
  std::string text = "{\n  \"metadata\": {\n    \"total_parameters\": " + std::to_string(total_params) +
                     ",\n    \"total_size\": " + std::to_string(total_size) + "\n  },\n  \"weight_map\": {";
  for (size_t i = 0; i < weight_map.size(); ++i) {
    text += i ? ",\n    " : "\n    ";
    append_json_string(text, weight_map[i].first);
    text += ": ";
    append_json_string(text, shard_names[weight_map[i].second]);
  }
  text += "\n  }\n}\n";
  return text;
}

bool is_16bit_float(DType t) { return t == DType::F16 || t == DType::BF16; }

// Calls f for each tensor whose output dtype the policy decides: floating point, not pinned.
template <typename F>
void for_each_cast_candidate(const PlanInput& input, F&& f) {
  for (const OutputGroup& group : input.groups)
    for (const PlannedTensor& p : group.tensors)
      if (is_floating(p.source->dtype) && !p.keep_dtype) f(p);
}

// --dtype default: a 16-bit float checkpoint keeps its dtype; wider floats become bf16 as in verl.
DType default_float_dtype(const PlanInput& input, std::vector<std::string>& notes) {
  const PlannedTensor* f16 = nullptr;
  const PlannedTensor* bf16 = nullptr;
  size_t wider = 0;
  for_each_cast_candidate(input, [&](const PlannedTensor& p) {
    if (p.source->dtype == DType::F16 && !f16) f16 = &p;
    if (p.source->dtype == DType::BF16 && !bf16) bf16 = &p;
    if (dtype_size(p.source->dtype) > 2) ++wider;
  });
  if (f16 && bf16)
    throw Error("the checkpoint holds float16 tensors (e.g. '" + f16->name + "') and bfloat16 tensors (e.g. '" +
                bf16->name + "'): no single 16-bit dtype keeps both exactly; choose one with --dtype bf16, fp16, fp32 or keep");
  if (!f16) return DType::BF16;
  notes.push_back("--dtype default: float16 checkpoint, written as float16" +
                  (wider ? " (its " + std::to_string(wider) + " wider float tensor(s) too)" : std::string()) +
                  "; --dtype bf16 would cast it");
  return DType::F16;
}

// A bf16 <-> fp16 cast loses bits that the user may not expect to lose: say so, in one line.
std::optional<std::string> lossy_cast_warning(const PlanInput& input, DType out, const std::string& chosen_by) {
  if (!is_16bit_float(out)) return std::nullopt;
  size_t count = 0;
  const PlannedTensor* first = nullptr;
  for_each_cast_candidate(input, [&](const PlannedTensor& p) {
    if (is_16bit_float(p.source->dtype) && p.source->dtype != out && count++ == 0) first = &p;
  });
  if (!count) return std::nullopt;
  const std::string from(dtype_name(first->source->dtype));
  return chosen_by + " casts " + std::to_string(count) + " " + from + " tensor(s) (e.g. '" + first->name + "') to " +
         std::string(dtype_name(out)) +
         (out == DType::BF16 ? ", dropping 3 of float16's 10 mantissa bits"
                             : ", where values beyond float16's range overflow to inf or underflow to 0") +
         "; --dtype default keeps " + from;
}

}  // namespace

std::optional<DType> config_dtype(const nlohmann::ordered_json& config) {
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (config.is_object() && config.contains(key) && config[key].is_string()) {
      std::string s = config[key].get<std::string>();
      if (s.rfind("torch.", 0) == 0) s = s.substr(6);
      if (auto t = dtype_from_torch_name(s)) return t;
    }
  }
  return std::nullopt;
}

MergePlan build_plan(const PlanInput& input, const OutputOptions& options) {
  MergePlan plan;
  plan.source_dir = input.source_dir;
  plan.layout = input.sources->description;
  plan.sources = input.sources->files;
  plan.records = unique_records(input.sources->records);
  plan.notes = input.sources->notes;
  plan.notes.insert(plan.notes.end(), input.notes.begin(), input.notes.end());

  // The dtype float tensors are written in.
  std::optional<DType> float_dtype;
  std::string chosen_by;
  if (options.dtype_policy == DTypePolicy::Default) {
    float_dtype = default_float_dtype(input, plan.notes);
  } else if (options.dtype_policy == DTypePolicy::Fixed) {
    float_dtype = options.dtype;
    chosen_by = "--dtype " + std::string(dtype_name(options.dtype));
  } else if (options.dtype_policy == DTypePolicy::Auto) {
    if (input.hf && input.hf->has_config) float_dtype = config_dtype(input.hf->config);
    if (!float_dtype) {
      float_dtype = DType::BF16;
      plan.notes.push_back("--dtype auto: config.json names no torch_dtype/dtype; writing bfloat16 as verl does");
    }
    chosen_by = "--dtype auto (config.json's " + std::string(dtype_name(*float_dtype)) + ")";
  }
  if (float_dtype && *float_dtype != DType::BF16 && *float_dtype != DType::F16 && *float_dtype != DType::F32 &&
      *float_dtype != DType::F64)
    throw usage_error("output dtype must be bf16, fp16, fp32 or fp64, not " + std::string(dtype_name(*float_dtype)));
  if (float_dtype)
    if (auto warning = lossy_cast_warning(input, *float_dtype, chosen_by)) plan.warnings.push_back(std::move(*warning));

  // A model loaded in a 16-bit dtype keeps some modules in float32 (routers, expert score
  // biases): its save_pretrained writes them as float32, and so do the default and auto
  // policies (an upcast of 16-bit sources is exact). --dtype bf16 or fp16 casts them too.
  std::vector<std::string_view> fp32_patterns;
  if (float_dtype && is_16bit_float(*float_dtype) && options.dtype_policy != DTypePolicy::Fixed && input.hf)
    fp32_patterns = fp32_module_patterns(input.hf->architecture);
  size_t kept_fp32 = 0;

  std::map<std::string_view, std::unordered_set<std::string_view>> names;  // by subdir
  for (const OutputGroup& group : input.groups) {
    std::vector<OutputTensor> outs;
    std::vector<TensorDecl> decls;  // each moved into its shard's list
    std::vector<uint64_t> sizes;
    std::vector<StorageKey> storage;
    outs.reserve(group.tensors.size());
    decls.reserve(group.tensors.size());
    std::unordered_set<std::string_view>& group_names = names[group.subdir];
    for (const PlannedTensor& p : group.tensors) {
      if (!group_names.insert(p.name).second)
        throw Error("two source tensors map to the same output name").tensor(p.name);
      OutputTensor t;
      t.name = p.name;
      t.shape = p.source->shape;
      const DType src = p.source->dtype;
      if (is_complex(src))
        throw Error("is " + std::string(dtype_name(src)) + "; complex tensors are not supported").tensor(p.name);
      t.dtype = src;
      if (float_dtype && is_floating(src) && !p.keep_dtype) {
        const bool fp32 = group.shard && kept_in_fp32(fp32_patterns, p.name);
        t.dtype = fp32 ? DType::F32 : *float_dtype;
        kept_fp32 += fp32;
      }
      t.copies = p.source->pieces;
      t.origin = p.source->origin;
      if (p.fold) {
        LoraFold fold;
        fold.a = p.fold->a->pieces;
        fold.b = p.fold->b->pieces;
        fold.rank = p.fold->a->shape.at(0);
        fold.scale = p.fold->scale;
        fold.fan_in_fan_out = p.fold->fan_in_fan_out;
        t.lora = std::move(fold);
        t.origin += " + LoRA fold";
      }
      decls.push_back({t.name, t.dtype, t.shape});
      t.nbytes = decls.back().nbytes();
      sizes.push_back(t.nbytes);
      storage.push_back(p.storage);
      outs.push_back(std::move(t));
    }
    if (outs.empty()) continue;

    const auto shards = split_into_shards(sizes, storage, group.shard ? options.max_shard_size : UINT64_MAX);
    const std::string prefix = group.subdir.empty() ? "" : group.subdir + "/";
    std::vector<std::pair<std::string_view, size_t>> weight_map;  // tensor -> shard, for the index
    uint64_t total_size = 0, total_params = 0;
    for (size_t s = 0; s < shards.size(); ++s) {
      OutputFile file;
      file.name = prefix + (shards.size() == 1 ? group.file_stem + ".safetensors"
                                                : shard_file_name(group.file_stem, s, shards.size()));
      std::vector<TensorDecl> shard_decls;
      shard_decls.reserve(shards[s].size());
      for (size_t i : shards[s]) shard_decls.push_back(std::move(decls[i]));
      SafetensorsLayout layout = layout_safetensors(shard_decls, group.metadata);
      file.header = std::move(layout.header);
      file.size = layout.file_size;
      const auto file_index = static_cast<uint32_t>(plan.files.size());
      for (size_t k = 0; k < layout.tensors.size(); ++k) {
        const size_t i = shards[s][layout.order[k]];
        outs[i].file = file_index;
        outs[i].offset = layout.tensors[k].file_offset;
        // The planned tensor's name: outs move into the plan before the index is written.
        if (shards.size() > 1) weight_map.emplace_back(group.tensors[i].name, s);
      }
      plan.files.push_back(std::move(file));
    }
    for (auto& t : outs) {
      total_size += t.nbytes;
      total_params += t.numel();
      plan.tensors.push_back(std::move(t));
    }
    if (shards.size() > 1) {
      std::vector<std::string> shard_names;
      for (size_t s = 0; s < shards.size(); ++s) shard_names.push_back(shard_file_name(group.file_stem, s, shards.size()));
      plan.sidecars.push_back({prefix + group.file_stem + ".safetensors.index.json", "",
                               index_json(total_params, total_size, std::move(weight_map), shard_names)});
    }
  }

  // config.json says what the weights are: the policy's dtype, or (keep) the one float dtype written.
  std::optional<DType> written_dtype = float_dtype;
  if (!written_dtype) {
    std::set<DType> floats;
    for (const OutputTensor& t : plan.tensors)
      if (is_floating(t.dtype)) floats.insert(t.dtype);
    if (floats.size() == 1) written_dtype = *floats.begin();
    if (floats.size() > 1 && input.hf && input.hf->has_config)
      plan.notes.push_back("--dtype keep: the output mixes float dtypes, so config.json's dtype is left as it was");
  }
  if (input.hf) {
    for (const std::string& dir : input.model_dirs) {
      const std::string prefix = dir.empty() ? "" : dir + "/";
      for (const auto& name : input.hf->sidecar_files) {
        Sidecar s{prefix + name, (std::filesystem::path(input.hf->path) / name).string(), std::nullopt};
        if (name == "config.json" && input.hf->has_config && written_dtype) {
          // Say what the weights now are, in whichever key this transformers version used.
          nlohmann::ordered_json cfg = input.hf->config;
          const std::string dt(dtype_name(*written_dtype));
          bool set = false;
          for (const char* key : {"torch_dtype", "dtype"})
            if (cfg.contains(key)) {
              cfg[key] = dt;
              set = true;
            }
          if (!set) cfg["torch_dtype"] = dt;
          s.content = cfg.dump(2) + "\n";
        }
        plan.sidecars.push_back(std::move(s));
      }
    }
  }
  plan.sidecars.insert(plan.sidecars.end(), input.extra_sidecars.begin(), input.extra_sidecars.end());
  if (kept_fp32)
    plan.notes.push_back(std::to_string(kept_fp32) + " tensor(s) written as float32, as " + input.hf->architecture +
                         " keeps them (routers, expert score biases) and its save_pretrained writes them");
  if (!input.hf || !input.hf->has_config)
    plan.notes.push_back("no HuggingFace config.json found beside the checkpoint: the output holds weights only");
  return plan;
}

}  // namespace shardmerge
