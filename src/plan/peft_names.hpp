// PEFT / FSDP state-dict names to HuggingFace names, with LoRA tensors grouped by the module
// they adapt. Handles the wrapper segments FSDP and torch.compile add, PEFT's
// `base_model.model.` prefix and `.base_layer`, adapter-name segments (`lora_A.default.weight`
// in a training state dict, `lora_A.weight` in a saved adapter), embedding LoRA
// (`lora_embedding_A/B`), and `modules_to_save` copies.
#pragma once

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "geometry/source_set.hpp"

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
  std::vector<std::string> replaced;  // base names given twice: the later tensor (e.g. an adapter's saved embedding) wins
};

// FSDP/FSDP2 wrapper and torch.compile segments removed ("_fsdp_wrapped_module." ...).
std::string strip_wrapper_segments(const std::string& name);

// Adds tensors named as in a model state dict (LoRA names carry the adapter name,
// `lora_A.default.weight`) or, with `saved_adapter`, as in adapter_model.safetensors
// (`lora_A.weight`). Pointers into `tensors` are kept: it must outlive `split`.
void add_peft_tensors(PeftSplit& split, std::span<const SourceTensor> tensors, bool saved_adapter);
PeftSplit split_peft_names(const SourceSet& checkpoint);

}  // namespace shardmerge
