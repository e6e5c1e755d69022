// shardmerge-gen: writes a synthetic verl FSDP2 checkpoint of a real model's shape, e.g.
//   shardmerge-gen --model qwen2.5-0.5b --world-size 8 --out /data/run
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>

#include "shardmerge/error.hpp"
#include "synth/synthetic_fsdp.hpp"
#include "util/units.hpp"

int main(int argc, char** argv) {
  using namespace shardmerge;
  CLI::App app{"Write a synthetic verl FSDP2 checkpoint (torch.save layout of torch 2.15) of a real model shape"};
  synth::SyntheticOptions o;
  bool list = false;
  app.add_option("--out", o.out_dir, "Run root to create");
  app.add_option("--model", o.model, "Model shape (see --list)");
  app.add_option("--world-size", o.world_size, "Number of rank files");
  app.add_option("--lora-rank", o.lora_rank, "Add PEFT LoRA A/B on every linear layer with this rank");
  app.add_option("--lora-alpha", o.lora_alpha, "lora_alpha written to lora_train_meta.json");
  app.add_option("--dtype", o.dtype, "Parameter dtype: float32 or bfloat16");
  app.add_option("--tokenizer-from", o.tokenizer_from, "Copy tokenizer files from this HF directory");
  app.add_flag("--optimizer", o.optimizer, "Also write optim_ rank files (AdamW state, as torch saves it)");
  app.add_option("--layers", o.layers, "Decoder layers, instead of the shape's own");
  app.add_flag("--fused-experts", o.fused_experts,
               "MoE experts fused as transformers 5 holds them at run time (mlp.experts.gate_up_proj / down_proj)");
  app.add_flag("--list", list, "List the model shapes");
  CLI11_PARSE(app, argc, argv);
  try {
    if (list) {
      for (const auto& m : synth::model_shapes()) std::printf("%s\n", synth::shape_line(m).c_str());
      return 0;
    }
    if (o.out_dir.empty()) throw usage_error("--out is required");
    const auto t0 = std::chrono::steady_clock::now();
    const auto s = synth::write_synthetic_fsdp(o);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("wrote %s: %.3fB parameters, %s of rank files in %.1f s\n", s.role_dir.c_str(),
                static_cast<double>(s.parameters) / 1e9, format_bytes(s.rank_file_bytes).c_str(), secs);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "shardmerge-gen: error: %s\n", e.what());
    return static_cast<int>(e.exit_code());
  }
}
