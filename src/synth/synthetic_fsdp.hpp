// Synthetic verl FSDP2 checkpoints of real model shapes (0.5B to 72B dense, a 30B MoE), written in torch 2.15's
// exact torch.save layout by our own writer: DTensors with Shard(0) on an ("fsdp",) mesh,
// padded local storages, tied lm_head sharing the embedding's storage, optional PEFT LoRA
// tensors. Values are a pure function of (tensor, global element index), so any world size
// of the same model merges to the same tensors, and a test can recompute any element.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardmerge::synth {

struct ModelShape {
  std::string name;   // "qwen2.5-0.5b"
  std::string architecture;
  std::string model_type;
  int64_t hidden, intermediate, layers, heads, kv_heads, vocab;
  bool tied, qkv_bias;
  // Mixture of experts (Qwen3-MoE layout): every layer's MLP is a router `mlp.gate`
  // [experts, hidden] and `experts` SwiGLU experts of width `moe_intermediate`: each its own
  // gate/up/down Linear as transformers saves them, or fused (SyntheticOptions::fused_experts).
  // 0 experts: a dense MLP of width `intermediate`.
  int64_t head_dim = 0;  // 0: hidden / heads
  int64_t experts = 0, moe_intermediate = 0, experts_per_token = 0;
  bool qk_norm = false;  // per-head RMSNorm of q and k (q_norm, k_norm [head_dim])
  // DeepSeek-V3 (model_type deepseek_v3): multi-head latent attention (q and kv down- and
  // up-projections with their norms) when kv_lora_rank > 0; the first `first_k_dense` layers
  // dense; each MoE layer with `shared_experts` always-on experts fused in one MLP of width
  // shared_experts * moe_intermediate, and the router's `e_score_correction_bias` [experts].
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t first_k_dense = 0, shared_experts = 0;
};

const std::vector<ModelShape>& model_shapes();
const ModelShape& find_model(const std::string& name);
// One line for --list: name, architecture, sizes.
std::string shape_line(const ModelShape& m);

struct SyntheticOptions {
  std::string out_dir;    // the run root
  std::string model = "qwen2.5-0.5b";
  int64_t world_size = 8;
  int64_t lora_rank = 0;  // > 0 adds PEFT LoRA A/B tensors on every linear layer
  double lora_alpha = 16;
  int64_t step = 1;
  std::string tokenizer_from;  // copy tokenizer files from this HF dir (optional)
  std::string dtype = "float32";  // float32 or bfloat16 parameters
  bool optimizer = false;         // also optim_ rank files: AdamW state (step, exp_avg, exp_avg_sq)
  // MoE experts as transformers 5 holds them at run time (what its FSDP rank files carry): one
  // `mlp.experts.gate_up_proj` [experts, 2*moe_intermediate, hidden] and one `mlp.experts.down_proj`
  // [experts, hidden, moe_intermediate] per layer. Not with LoRA.
  bool fused_experts = false;
  int64_t layers = 0;  // > 0: this many decoder layers instead of the shape's own (a shallower model of that width)
};

struct SyntheticSummary {
  std::string role_dir;
  uint64_t rank_file_bytes = 0;
  uint64_t parameters = 0;
};

SyntheticSummary write_synthetic_fsdp(const SyntheticOptions& options);

// What write_synthetic_fsdp will write, and what a default merge of it writes, computed from the
// shape alone (zip and pickle overheads estimated from above), so a caller can check free space
// before generating.
struct SyntheticSize {
  uint64_t rank_file_bytes = 0;
  uint64_t merged_bytes = 0;  // bf16 weights, LoRA folded, tied lm_head not written
};
SyntheticSize estimate_synthetic(const SyntheticOptions& options);

// The value synthetic checkpoints hold at `index` of tensor number `tensor` (as fp32).
float synthetic_value(uint64_t tensor, uint64_t index);

}  // namespace shardmerge::synth
