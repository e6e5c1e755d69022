// PEFT / FSDP state-dict names to HuggingFace names, with LoRA tensors grouped by the module
// they adapt. Handles the wrapper segments FSDP and torch.compile add, PEFT's
// `base_model.model.` prefix and `.base_layer`, adapter-name segments (`lora_A.default.weight`
// in a training state dict, `lora_A.weight` in a saved adapter), embedding LoRA
// (`lora_embedding_A/B`), and `modules_to_save` copies.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "layouts/sources.hpp"

namespace shardmerge {

struct LoraModule {
  std::string module;  // HF path of the adapted module, e.g. "model.layers.0.self_attn.q_proj"
  const SourceTensor* a = nullptr;  // lora_A [r, in] or lora_embedding_A [r, num_embeddings]
  const SourceTensor* b = nullptr;  // lora_B [out, r] or lora_embedding_B [dim, r]
  bool embedding = false;
};

struct PeftSplit {
  std::vector<std::pair<std::string, const SourceTensor*>> base;  // HF name -> tensor, in order
  std::vector<LoraModule> lora;                                    // in order of first appearance
  std::vector<std::string> adapter_names;                          // adapter segments seen ("default")
  std::vector<std::string> unsupported;                            // keys of PEFT features we cannot fold
};

// FSDP/FSDP2 wrapper and torch.compile segments removed ("_fsdp_wrapped_module." ...).
std::string strip_wrapper_segments(const std::string& name);

// A model state dict (base weights and, for PEFT models, adapter tensors).
PeftSplit split_peft_names(const SourceSet& checkpoint);
// Adds the tensors of a saved PEFT adapter (adapter_model.safetensors) to `split`.
void add_adapter_tensors(PeftSplit& split, const SourceSet& adapter);

}  // namespace shardmerge
