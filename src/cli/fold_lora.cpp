// `shardmerge fold-lora --base HF_DIR --adapter ADAPTER_DIR --target_dir OUT`: a PEFT LoRA
// adapter folded into an HF model, streaming, without any training checkpoint.
#include <memory>

#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge::cli {
namespace {

struct FoldLoraCli {
  std::string base, adapter;
  std::string dtype = "auto";
  std::string max_shard_size = "5GB";
  double lora_alpha = 0;
  bool force_lora_alpha = false;
  ExecCliOptions exec;
};

FoldLoraRequest to_request(const FoldLoraCli& o) {
  FoldLoraRequest r;
  r.base_dir = o.base;
  r.adapter_dir = o.adapter;
  r.output = api::output_dtype_options(o.dtype);
  r.output.max_shard_size = parse_size(o.max_shard_size);
  if (o.lora_alpha != 0) r.lora_alpha = o.lora_alpha;
  r.force_lora_alpha = o.force_lora_alpha;
  return r;
}

}  // namespace

void add_fold_lora(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("fold-lora", "Fold a PEFT LoRA adapter into a HuggingFace model: W + scale * B @ A");
  auto o = std::make_shared<FoldLoraCli>();
  cmd->add_option("--base", o->base, "HuggingFace model directory (safetensors)")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("--adapter", o->adapter, "PEFT adapter directory (adapter_config.json + adapter_model.*)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--dtype", o->dtype,
                  "Output dtype of floating-point tensors: auto (default: config.json's), default (fp32 -> bf16; fp16 "
                  "and bf16 keep theirs), bf16, fp16, fp32, keep")
      ->check(CLI::IsMember(api::kDTypeChoices));
  cmd->add_option("--max-shard-size,--max_shard_size", o->max_shard_size, "Largest output shard, e.g. 5GB")
      ->check(byte_size_check());
  add_lora_alpha_options(cmd, o->lora_alpha, o->force_lora_alpha);
  add_exec_options(cmd, o->exec);
  cmd->callback([&run, o] {
    run = [o] { return write_merge([o] { return plan_fold_lora(to_request(*o)); }, o->exec); };
  });
}

}  // namespace shardmerge::cli
