#include "api/options.hpp"

#include <algorithm>

#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge::api {
namespace {

// The CLI's validators catch these while parsing; the Python API's values arrive here unchecked.
const std::string& one_of(const std::string& flag, const std::string& value, const std::vector<std::string>& choices) {
  if (std::find(choices.begin(), choices.end(), value) != choices.end()) return value;
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  throw usage_error(flag + ": '" + value + "' is not one of " + list);
}

}  // namespace

uint64_t positive_size(const std::string& flag, const std::string& text) {
  uint64_t n = 0;
  try {
    n = parse_size(text);
  } catch (const Error& e) {
    throw usage_error(flag + ": " + e.message());
  }
  if (n == 0) throw usage_error(flag + " must be positive");
  return n;
}

OutputOptions output_dtype_options(const std::string& dtype) {
  OutputOptions out;
  if (dtype == "default") {
    out.dtype_policy = DTypePolicy::Default;
  } else if (dtype == "auto") {
    out.dtype_policy = DTypePolicy::Auto;
  } else if (dtype == "keep") {
    out.dtype_policy = DTypePolicy::Keep;
  } else {
    out.dtype_policy = DTypePolicy::Fixed;
    out.dtype = *dtype_from_user(one_of("--dtype", dtype, kDTypeChoices));
  }
  return out;
}

ChosenExecutor choose_executor(const std::string& device, const std::string& gpu_memory, const Workload& workload) {
  const uint64_t per_device = gpu_memory == "auto" ? 0 : positive_size("--gpu-memory", gpu_memory);
  return choose_executor(parse_device(device), per_device, workload);
}

MergeRequest to_request(const MergeOptions& o) {
  if (o.local_dir.empty()) throw usage_error("--local_dir is required");
  MergeRequest r;
  r.local_dir = o.local_dir;
  r.backend = one_of("--backend", o.backend, kBackendChoices);
  r.role = o.role;
  r.hf_model_path = o.hf_model_path;
  r.output = output_dtype_options(o.dtype);
  r.output.max_shard_size = positive_size("--max-shard-size", o.max_shard_size);
  r.lora = *lora_mode_from_string(one_of("--lora", o.lora, kLoraChoices));
  if (o.lora_alpha != 0) r.lora_alpha = o.lora_alpha;
  r.force_lora_alpha = o.force_lora_alpha;
  r.tie_word_embedding = o.tie_word_embedding;
  r.is_value_model = o.is_value_model;
  r.runtime_names = o.runtime_names;
  return r;
}

FoldLoraRequest to_request(const FoldLoraOptions& o) {
  if (o.base.empty() || o.adapter.empty()) throw usage_error("--base and --adapter are required");
  FoldLoraRequest r;
  r.base_dir = o.base;
  r.adapter_dir = o.adapter;
  r.output = output_dtype_options(o.dtype);
  r.output.max_shard_size = positive_size("--max-shard-size", o.max_shard_size);
  if (o.lora_alpha != 0) r.lora_alpha = o.lora_alpha;
  r.force_lora_alpha = o.force_lora_alpha;
  return r;
}

nlohmann::ordered_json planning_options_json(const MergeOptions& o) {
  return {{"local_dir", o.local_dir},
          {"backend", o.backend},
          {"role", o.role},
          {"dtype", o.dtype},
          {"max_shard_size", o.max_shard_size},
          {"lora", o.lora},
          {"lora_alpha", o.lora_alpha},
          {"force_lora_alpha", o.force_lora_alpha},
          {"tie_word_embedding", o.tie_word_embedding},
          {"is_value_model", o.is_value_model},
          {"hf_model_path", o.hf_model_path},
          {"runtime_names", o.runtime_names}};
}

}  // namespace shardmerge::api
