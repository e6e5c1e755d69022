// `shardmerge fold-lora --base HF_DIR --adapter ADAPTER_DIR --target_dir OUT`: a PEFT LoRA
// adapter folded into an HF model, streaming, without any training checkpoint.
#include <memory>

#include "cli/commands.hpp"
#include "cli/merge_options.hpp"

namespace shardmerge::cli {
namespace {

struct FoldLoraCli {
  api::FoldLoraOptions fold;
  ExecCliOptions exec;
};

}  // namespace

void add_fold_lora(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("fold-lora", "Fold a PEFT LoRA adapter into a HuggingFace model: W + scale * B @ A");
  auto o = std::make_shared<FoldLoraCli>();
  cmd->add_option("--base", o->fold.base, "HuggingFace model directory (safetensors)")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("--adapter", o->fold.adapter, "PEFT adapter directory (adapter_config.json + adapter_model.*)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--dtype", o->fold.dtype,
                  "Output dtype of floating-point tensors: auto (default: config.json's), default (fp32 -> bf16; fp16 "
                  "and bf16 keep theirs), bf16, fp16, fp32, keep")
      ->check(CLI::IsMember(api::kDTypeChoices));
  cmd->add_option("--max-shard-size,--max_shard_size", o->fold.max_shard_size, "Largest output shard, e.g. 5GB")
      ->check(byte_size_check());
  add_lora_alpha_options(cmd, o->fold.lora_alpha, o->fold.force_lora_alpha);
  add_exec_options(cmd, o->exec);
  cmd->callback([&run, o] {
    run = [o] { return write_merge(api::to_request(o->fold), o->exec); };
  });
}

}  // namespace shardmerge::cli
