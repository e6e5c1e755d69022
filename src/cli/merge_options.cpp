#include "cli/merge_options.hpp"

#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge::cli {

void add_merge_options(CLI::App* cmd, MergeCliOptions& cli) {
  api::MergeOptions& o = cli.plan;
  cmd->add_option("--local_dir,--local-dir", o.local_dir, "Role directory (e.g. global_step_N/actor), step root or run root")
      ->required();
  cmd->add_option("--backend", o.backend, "Checkpoint backend")->check(CLI::IsMember(api::kBackendChoices));
  cmd->add_option("--dtype", o.dtype,
                  "Output dtype of floating-point tensors: default (fp32 -> bf16 as verl does; fp16 and bf16 keep "
                  "theirs), bf16, fp16, fp32, auto (config.json), keep")
      ->check(CLI::IsMember(api::kDTypeChoices));
  cmd->add_option("--max-shard-size,--max_shard_size", o.max_shard_size, "Largest output shard, e.g. 5GB, 500MiB")
      ->check(byte_size_check());
  cmd->add_option("--lora", o.lora,
                  "LoRA adapters: fold (default: folded into W, no adapter), adapter (verl's layout: unfolded base + "
                  "lora_adapter/), both (folded model + unfolded/ holding verl's layout), drop")
      ->check(CLI::IsMember(api::kLoraChoices));
  add_lora_alpha_options(cmd, o.lora_alpha, o.force_lora_alpha);
  cmd->add_flag("--tie-word-embedding,--tie_word_embedding", o.tie_word_embedding,
                "Drop lm_head.weight as the embedding's alias even if config.json does not say tied");
  cmd->add_flag("--is-value-model,--is_value_model", o.is_value_model, "Value/reward model (Megatron: write score.weight)");
  cmd->add_flag("--trust-remote-code,--trust_remote_code", cli.trust_remote_code,
                "Accepted for verl compatibility (shardmerge never runs model code)");
  cmd->add_option("--hf_model_path,--hf-model-path", o.hf_model_path,
                  "HF directory to take config.json and tokenizer from when the checkpoint has none (or to override "
                  "it); default: the checkpoint's own huggingface/");
  cmd->add_flag("--keep-runtime-names,--keep_runtime_names", o.runtime_names,
                "Write FSDP rank files' tensors under transformers' run-time names (fused MoE experts, "
                "model.language_model.*) instead of the names the model's save_pretrained writes");
  cmd->add_option("--role", o.role, "Role to take from a run or step root");
  cmd->add_flag("-v,--verbose", cli.verbose,
                "More detail: merge prints its phase timings and every output tensor, verify every tensor it "
                "compared, plan every source piece");
}

void add_lora_alpha_options(CLI::App* cmd, double& alpha, bool& force) {
  cmd->add_option("--lora-alpha,--lora_alpha", alpha, "LoRA alpha to use when the checkpoint records none (or 0)");
  cmd->add_flag("--force-lora-alpha,--force_lora_alpha", force,
                "Let --lora-alpha replace a different alpha the checkpoint records");
}

void add_device_options(CLI::App* cmd, std::string& device, std::string& gpu_memory) {
  cmd->add_option("--device", device,
                  "Executor: cpu, cuda (all GPUs), cuda:0,1 (these GPUs), auto (the GPU where it is predicted at least "
                  "25% faster than the CPU cores, by measured rates; docs/executors.md)");
  cmd->add_option("--gpu-memory,--gpu_memory", gpu_memory,
                  "GPU memory each device may use, e.g. 8GiB (auto: the smaller of 4 GiB and 80% of what is free)")
      ->check(byte_size_check(true));
}

CLI::Validator byte_size_check(bool allow_auto) {
  return CLI::Validator(
      [allow_auto](std::string& text) -> std::string {
        if (allow_auto && text == "auto") return {};
        try {
          if (parse_size(text) == 0) return "'" + text + "' must be positive";
        } catch (const Error& e) {
          return e.message();
        }
        return {};
      },
      allow_auto ? "SIZE|auto" : "SIZE");
}

}  // namespace shardmerge::cli
