#include "cli/merge_options.hpp"

#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge::cli {

void add_merge_options(CLI::App* cmd, MergeCliOptions& o) {
  cmd->add_option("--local_dir,--local-dir", o.local_dir, "Role directory (e.g. global_step_N/actor), step root or run root")
      ->required();
  cmd->add_option("--backend", o.backend, "Checkpoint backend")->check(CLI::IsMember({"auto", "fsdp", "megatron"}));
  cmd->add_option("--dtype", o.dtype, "Output dtype of floating-point tensors: auto (config.json), bf16, fp16, fp32, keep")
      ->check(CLI::IsMember({"auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "keep"}));
  cmd->add_option("--max-shard-size,--max_shard_size", o.max_shard_size, "Largest output shard, e.g. 5GB, 500MiB");
  cmd->add_option("--lora", o.lora, "LoRA adapters: fold into W, adapter (PEFT dir beside), both, drop")
      ->check(CLI::IsMember({"fold", "adapter", "both", "drop"}));
  cmd->add_option("--lora-alpha,--lora_alpha", o.lora_alpha, "LoRA alpha to use when the checkpoint has none (or 0)");
  cmd->add_flag("--tie-word-embedding,--tie_word_embedding", o.tie_word_embedding,
                "Drop lm_head.weight as the embedding's alias even if config.json does not say tied");
  cmd->add_flag("--is-value-model,--is_value_model", o.is_value_model, "Value/reward model (Megatron: write score.weight)");
  cmd->add_flag("--trust-remote-code,--trust_remote_code", o.trust_remote_code,
                "Accepted for verl compatibility (shardmerge never runs model code)");
  cmd->add_option("--hf_model_path,--hf-model-path", o.hf_model_path,
                  "HF directory to take config.json and tokenizer from when the checkpoint has none (or to override it)");
  cmd->add_option("--role", o.role, "Role to take from a run or step root");
  cmd->add_flag("-v,--verbose", o.verbose, "More detail (repeat for more)");
}

void add_device_options(CLI::App* cmd, std::string& device, std::string& gpu_memory) {
  cmd->add_option("--device", device, "Executor: cpu, cuda (all GPUs), cuda:0,1 (these GPUs), auto (CUDA if a GPU is usable)");
  cmd->add_option("--gpu-memory,--gpu_memory", gpu_memory,
                  "GPU memory each device may use, e.g. 8GiB (auto: the smaller of 4 GiB and 80% of what is free)");
}

ChosenExecutor choose_executor(const std::string& device, const std::string& gpu_memory) {
  uint64_t per_device = 0;
  if (gpu_memory != "auto") {
    per_device = parse_size(gpu_memory);
    if (per_device == 0) throw usage_error("--gpu-memory must be positive (or auto)");
  }
  return choose_executor(parse_device(device), per_device);
}

MergeRequest to_request(const MergeCliOptions& o) {
  MergeRequest r;
  r.local_dir = o.local_dir;
  r.backend = o.backend;
  r.role = o.role;
  r.hf_model_path = o.hf_model_path;
  if (o.dtype == "auto") {
    r.output.dtype_policy = DTypePolicy::Auto;
  } else if (o.dtype == "keep") {
    r.output.dtype_policy = DTypePolicy::Keep;
  } else {
    r.output.dtype_policy = DTypePolicy::Fixed;
    r.output.dtype = *dtype_from_user(o.dtype);
  }
  r.output.max_shard_size = parse_size(o.max_shard_size);
  if (r.output.max_shard_size == 0) throw usage_error("--max-shard-size must be positive");
  r.lora = *lora_mode_from_string(o.lora);
  if (o.lora_alpha != 0) r.lora_alpha = o.lora_alpha;
  r.tie_word_embedding = o.tie_word_embedding;
  r.is_value_model = o.is_value_model;
  return r;
}

}  // namespace shardmerge::cli
