// TorchTitan -> HF names on synthetic descriptions: renames, Llama's rotary row order, grouped
// experts fused as transformers holds them, TorchTitan-only state left out, unknown keys. No file
// is opened: the checks look at where each HF tensor's pieces point in the imaginary file.
#include <gtest/gtest.h>

#include "plan/torchtitan_names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace shardmerge {
namespace {

SourceTensor stored(const std::string& name, std::vector<int64_t> shape, uint64_t offset) {
  return test::whole_tensor(name, std::move(shape), DType::BF16, offset);
}

const SourceTensor& find(const HfTensors& m, const std::string& name) {
  for (const auto& t : m.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// The source row each output row is read from (pieces of whole rows of a [rows, cols] bf16 tensor).
std::vector<int64_t> source_rows(const SourceTensor& t, uint64_t base, int64_t cols) {
  std::vector<int64_t> rows(static_cast<size_t>(t.shape[0]), -1);
  for (const Slice& s : t.pieces)
    for (int64_t r = 0; r < s.extent[0]; ++r)
      rows[static_cast<size_t>(s.start[0] + r)] =
          static_cast<int64_t>((s.offset - base) / (2 * static_cast<uint64_t>(cols))) + r * s.strides[0] / cols;
  return rows;
}

TEST(TorchTitanNames, LlamaRotaryRowsAndRenames) {
  // 2 query heads of dim 4, 1 KV head, hidden 8: TorchTitan interleaves each head's rotary
  // pairs (rows 0,1 = pair 0), HF keeps the halves (rows 0,1 = first elements of pairs 0,1).
  const nlohmann::ordered_json config = {{"model_type", "llama"}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                                         {"hidden_size", 8}, {"tie_word_embeddings", false}};
  SourceSet set;
  set.tensors = {stored("tok_embeddings.weight", {10, 8}, 0), stored("layers.0.attention.qkv_linear.wq.weight", {8, 8}, 1000),
                 stored("layers.0.attention.qkv_linear.wk.weight", {4, 8}, 2000),
                 stored("layers.0.attention.qkv_linear.wv.weight", {4, 8}, 3000), stored("norm.weight", {8}, 4000),
                 stored("lm_head.weight", {10, 8}, 5000), stored("layers.0.feed_forward.w1.weight", {6, 8}, 6000)};
  const HfTensors m = map_torchtitan_to_hf(set, config);
  EXPECT_EQ(source_rows(find(m, "model.layers.0.self_attn.q_proj.weight"), 1000, 8),
            (std::vector<int64_t>{0, 2, 1, 3, 4, 6, 5, 7}));
  EXPECT_EQ(source_rows(find(m, "model.layers.0.self_attn.k_proj.weight"), 2000, 8), (std::vector<int64_t>{0, 2, 1, 3}));
  EXPECT_EQ(source_rows(find(m, "model.layers.0.self_attn.v_proj.weight"), 3000, 8), (std::vector<int64_t>{0, 1, 2, 3}));
  // HF's state-dict order: the embedding, the layer (attention before the MLP), the norm, the head
  std::vector<std::string> names;
  for (const auto& t : m.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                             "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                                             "model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"}));
}

TEST(TorchTitanNames, QwenMoeExpertsFusedAsTransformersHoldsThemAndTiedHead) {
  // Grouped experts become transformers' run-time fused tensors (the saved-names step then
  // writes them per expert): gate_up_proj [E, 2I, H] = w1 then w3 along dim 1, down_proj = w2.
  const nlohmann::ordered_json config = {{"model_type", "qwen3_moe"}, {"num_attention_heads", 2},
                                         {"num_key_value_heads", 2}, {"tie_word_embeddings", true}};
  SourceSet set;
  set.tensors = {stored("layers.0.moe.routed_experts.inner_experts.w2_EDF", {2, 8, 3}, 0),
                 stored("layers.0.moe.routed_experts.inner_experts.w1_EFD", {2, 3, 8}, 1000),
                 stored("layers.0.moe.routed_experts.inner_experts.w3_EFD", {2, 3, 8}, 2000),
                 stored("layers.0.moe.router.gate.weight", {2, 8}, 3000), stored("layers.0.moe.expert_bias_E", {2}, 4000),
                 stored("tok_embeddings.weight", {10, 8}, 5000), stored("lm_head.weight", {10, 8}, 6000)};
  const HfTensors m = map_torchtitan_to_hf(set, config);
  std::vector<std::string> names;
  for (const auto& t : m.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                                             "model.layers.0.mlp.experts.gate_up_proj",
                                             "model.layers.0.mlp.experts.down_proj"}));
  const SourceTensor& gate_up = find(m, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(gate_up.shape, (std::vector<int64_t>{2, 6, 8}));
  ASSERT_EQ(gate_up.pieces.size(), 2u);
  EXPECT_EQ(gate_up.pieces[0].offset, 1000u);  // w1 at rows [0, 3) of every expert
  EXPECT_EQ(gate_up.pieces[0].start, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(gate_up.pieces[1].offset, 2000u);  // w3 at rows [3, 6)
  EXPECT_EQ(gate_up.pieces[1].start, (std::vector<int64_t>{0, 3, 0}));
  EXPECT_EQ(find(m, "model.layers.0.mlp.experts.down_proj").shape, (std::vector<int64_t>{2, 8, 3}));
  EXPECT_EQ(m.notes.size(), 2u);  // the tied head; the load-balancing bias

  // TorchTitan 0.2's names for the same layouts
  SourceSet v02;
  v02.tensors = {stored("layers.0.moe.experts.w1", {2, 3, 8}, 1000), stored("layers.0.moe.experts.w3", {2, 3, 8}, 2000),
                 stored("layers.0.moe.experts.w2", {2, 8, 3}, 0), stored("layers.0.moe.tokens_per_expert", {2}, 4000)};
  const HfTensors old = map_torchtitan_to_hf(v02, config);
  ASSERT_EQ(old.tensors.size(), 2u);
  EXPECT_EQ(old.tensors[0].name, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(old.tensors[0].pieces.at(1).offset, 2000u);
}

TEST(TorchTitanNames, UnknownKeysAndModelTypesAreErrors) {
  SourceSet set;
  set.tensors = {stored("layers.0.attention.wq.weight", {4, 4}, 0), stored("layers.0.mystery.weight", {4}, 100)};
  const nlohmann::ordered_json llama = {{"model_type", "llama"}, {"num_attention_heads", 1}};
  try {
    map_torchtitan_to_hf(set, llama);
    FAIL() << "an unknown key was mapped";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.mystery.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW(map_torchtitan_to_hf(set, {{"model_type", "gpt2"}, {"num_attention_heads", 1}}), Error);
}

}  // namespace
}  // namespace shardmerge
