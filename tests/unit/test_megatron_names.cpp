// Megatron -> HF mapping on synthetic descriptions: un-stacking, QKV per-group split, gate/up
// halves, vocab trimming, tied and value heads, unknown keys. No file is opened: the checks
// look at where each HF tensor's pieces point in the (imaginary) source file.
#include <gtest/gtest.h>

#include "plan/megatron_names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace shardmerge {
namespace {

// A whole, row-major bf16 tensor at `offset` of file 0.
SourceTensor stored(const std::string& name, std::vector<int64_t> shape, uint64_t offset) {
  return test::whole_tensor(name, std::move(shape), DType::BF16, offset);
}

nlohmann::ordered_json qwen2_config() {
  // 2 layers, hidden 8, 4 query heads of dim 2 in 2 KV groups (q_per_kv 2), ffn 6, vocab 10.
  return {{"architectures", {"Qwen2ForCausalLM"}}, {"num_hidden_layers", 2}, {"hidden_size", 8},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", 10}, {"tie_word_embeddings", true}};
}

const SourceTensor& find(const HfTensors& m, const std::string& name) {
  for (const auto& t : m.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

TEST(MegatronNames, UnstacksAndSplitsQkvPerGroup) {
  // linear_qkv: [L=2, groups 2 x (2 + 2) x head_dim 2 = 16 rows, H=8]; a row is 16 bytes.
  SourceSet set;
  set.tensors = {stored("decoder.layers.self_attention.linear_qkv.weight", {2, 16, 8}, 0),
                 stored("decoder.layers.self_attention.linear_qkv.bias", {2, 16}, 100000)};
  const HfTensors m = map_megatron_to_hf(set, qwen2_config(), {});
  const SourceTensor& q1 = find(m, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(q1.shape, (std::vector<int64_t>{8, 8}));
  // Group g's q rows are rows [8g, 8g + 4) of layer 1's block: two pieces.
  ASSERT_EQ(q1.pieces.size(), 2u);
  EXPECT_EQ(q1.pieces[0].offset, (16u * 8) * 2);           // layer 1, group 0, row 0
  EXPECT_EQ(q1.pieces[0].start, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(q1.pieces[1].offset, (16u * 8 + 8 * 8) * 2);   // layer 1, group 1, row 0
  EXPECT_EQ(q1.pieces[1].start, (std::vector<int64_t>{4, 0}));
  const SourceTensor& k0 = find(m, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(k0.shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(k0.pieces[0].offset, (4u * 8) * 2);            // group 0 rows 4-5
  EXPECT_EQ(k0.pieces[1].offset, (12u * 8) * 2);           // group 1 rows 12-13
  const SourceTensor& v0 = find(m, "model.layers.0.self_attn.v_proj.bias");
  EXPECT_EQ(v0.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(v0.pieces[1].offset, 100000u + 14 * 2);
  EXPECT_EQ(v0.pieces[1].extent, (std::vector<int64_t>{2}));
}

TEST(MegatronNames, LoraAdaptersBecomePeftNamesSplitLikeTheirWeights) {
  // Megatron-Bridge adapters: linear_in = A [L, r, in], linear_out = B [L, out, r]; r = 3.
  SourceSet set;
  set.tensors = {stored("decoder.layers.self_attention.linear_qkv.weight", {2, 16, 8}, 0),
                 stored("decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight", {2, 3, 8}, 10000),
                 stored("decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight", {2, 16, 3}, 20000),
                 stored("decoder.layers.self_attention.linear_qkv.adapter.linear_in._extra_state", {1}, 29000),
                 stored("decoder.layers.mlp.linear_fc2.adapter.linear_in.weight", {2, 3, 6}, 30000),
                 stored("decoder.layers.mlp.linear_fc2.adapter.linear_out.weight", {2, 8, 3}, 40000)};
  const HfTensors m = map_megatron_to_hf(set, qwen2_config(), {});
  // A is shared by q, k and v: the same bytes (layer 1's block) under three names.
  for (const char* p : {"q", "k", "v"}) {
    const SourceTensor& a = find(m, std::string("model.layers.1.self_attn.") + p + "_proj.lora_A.weight");
    EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 8}));
    ASSERT_EQ(a.pieces.size(), 1u);
    EXPECT_EQ(a.pieces[0].offset, 10000u + 3 * 8 * 2);
  }
  // B's rows split per query group exactly like the fused weight's: k rows 4-5 and 12-13.
  const SourceTensor& bk = find(m, "model.layers.0.self_attn.k_proj.lora_B.weight");
  EXPECT_EQ(bk.shape, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(bk.pieces.size(), 2u);
  EXPECT_EQ(bk.pieces[0].offset, 20000u + 4 * 3 * 2);
  EXPECT_EQ(bk.pieces[1].offset, 20000u + 12 * 3 * 2);
  EXPECT_EQ(find(m, "model.layers.1.mlp.down_proj.lora_B.weight").shape, (std::vector<int64_t>{8, 3}));
  EXPECT_EQ(find(m, "model.layers.0.mlp.down_proj.lora_A.weight").shape, (std::vector<int64_t>{3, 6}));
}

TEST(MegatronNames, AdapterOfAnUnknownModuleIsAnError) {
  SourceSet set;
  set.tensors = {stored("decoder.layers.self_attention.linear_xyz.adapter.linear_in.weight", {2, 3, 8}, 0)};
  EXPECT_THROW(map_megatron_to_hf(set, qwen2_config(), {}), Error);
}

TEST(MegatronNames, GateUpHalvesExpertsAndGlobals) {
  nlohmann::ordered_json cfg = qwen2_config();
  cfg["architectures"] = {"Qwen2MoeForCausalLM"};
  cfg["tie_word_embeddings"] = false;
  SourceSet set;
  set.tensors = {stored("embedding.word_embeddings.weight", {12, 8}, 0),  // 2 padded rows
                 stored("decoder.layers.mlp.experts.experts.linear_fc1.weight", {2, 3, 12, 8}, 1000),
                 stored("decoder.layers.mlp.shared_experts.linear_fc1.weight", {2, 12, 8}, 9000),
                 stored("decoder.layers.1.mlp.router.weight", {3, 8}, 20000),
                 stored("decoder.final_layernorm.weight", {8}, 30000),
                 stored("output_layer.weight", {10, 8}, 40000)};
  const HfTensors m = map_megatron_to_hf(set, cfg, {});
  const SourceTensor& emb = find(m, "model.embed_tokens.weight");
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{10, 8}));
  const SourceTensor& up = find(m, "model.layers.1.mlp.experts.2.up_proj.weight");
  EXPECT_EQ(up.shape, (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(up.pieces[0].offset, 1000u + ((1 * 3 + 2) * 12 + 6) * 8 * 2);
  EXPECT_EQ(find(m, "model.layers.0.mlp.shared_expert.gate_proj.weight").pieces[0].offset, 9000u);
  EXPECT_EQ(find(m, "model.layers.1.mlp.gate.weight").shape, (std::vector<int64_t>{3, 8}));
  EXPECT_EQ(find(m, "model.norm.weight").pieces[0].offset, 30000u);
  EXPECT_EQ(find(m, "lm_head.weight").shape, (std::vector<int64_t>{10, 8}));
  // HF order: embedding first, lm_head last, layers in between in order.
  EXPECT_EQ(m.tensors.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(m.tensors.back().name, "lm_head.weight");
  EXPECT_FALSE(m.notes.empty());  // the dropped padding rows are reported
}

TEST(MegatronNames, TiedAndValueHeads) {
  SourceSet set;
  set.tensors = {stored("output_layer.weight", {10, 8}, 0)};
  EXPECT_TRUE(map_megatron_to_hf(set, qwen2_config(), {}).tensors.empty());  // tied: the embedding's copy
  SourceSet value;
  value.tensors = {stored("output_layer.weight", {1, 8}, 0)};
  EXPECT_THROW(map_megatron_to_hf(value, qwen2_config(), {}), Error);
  MegatronMapOptions o;
  o.value_model = true;
  EXPECT_EQ(map_megatron_to_hf(value, qwen2_config(), o).tensors.at(0).name, "score.weight");
}

TEST(MegatronNames, UnknownKeysAndArchitecturesAreListed) {
  SourceSet set;
  set.tensors = {stored("mtp.layers.0.eh_proj.weight", {8, 16}, 0), stored("vision_model.patch.weight", {8, 8}, 0)};
  try {
    map_megatron_to_hf(set, qwen2_config(), {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mtp.layers.0.eh_proj.weight"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("vision_model.patch.weight"), std::string::npos);
  }
  nlohmann::ordered_json cfg = qwen2_config();
  cfg["architectures"] = {"GPTNeoXForCausalLM"};
  try {
    map_megatron_to_hf(SourceSet{}, cfg, {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Qwen3MoeForCausalLM"), std::string::npos);  // lists what is supported
  }
}

TEST(MegatronNames, StackedLayerCountMustMatchConfig) {
  SourceSet set;
  set.tensors = {stored("decoder.layers.mlp.linear_fc2.weight", {3, 8, 6}, 0)};
  EXPECT_THROW(map_megatron_to_hf(set, qwen2_config(), {}), Error);
}

// Found by fuzz_megatron_names: names and configs that threw std::out_of_range or divided by 0.
TEST(MegatronNames, MalformedNamesAndConfigsAreErrors) {
  auto error_of = [](const SourceSet& set, const nlohmann::ordered_json& config) -> std::string {
    try {
      map_megatron_to_hf(set, config, {});
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "no shardmerge::Error";
    return "";
  };
  SourceSet bare;  // "decoder.layers.1" with nothing after the layer number
  bare.tensors = {stored("decoder.layers.1", {8}, 0)};
  EXPECT_NE(error_of(bare, qwen2_config()).find("layer-stacked tensor has shape [8]"), std::string::npos);
  SourceSet expert;  // "mlp.experts.<e>" and "local_experts.<e>" with no name after the expert
  expert.tensors = {stored("decoder.layers.0.mlp.experts.1", {8}, 0), stored("decoder.layers.0.mlp.experts.local_experts.1", {8}, 64)};
  EXPECT_NE(error_of(expert, qwen2_config()).find("Megatron keys with no Qwen2ForCausalLM mapping"), std::string::npos);
  SourceSet grouped;  // grouped experts stacked over layers, with no experts axis left
  grouped.tensors = {stored("decoder.layers.mlp.experts.experts.linear_fc1.weight", {2}, 0)};
  EXPECT_NE(error_of(grouped, qwen2_config()).find("has no experts axis"), std::string::npos);
  SourceSet empty;
  auto config = qwen2_config();
  config["num_attention_heads"] = 0;
  EXPECT_NE(error_of(empty, config).find("num_attention_heads 0, not a head count"), std::string::npos);
  config = qwen2_config();
  config["num_key_value_heads"] = 0;
  EXPECT_NE(error_of(empty, config).find("num_key_value_heads 0 does not divide num_attention_heads 4"), std::string::npos);
  config = qwen2_config();
  config["head_dim"] = int64_t{1} << 40;
  EXPECT_NE(error_of(empty, config).find("head dimension of 1099511627776"), std::string::npos);
  config = qwen2_config();
  config["vocab_size"] = -1;
  EXPECT_NE(error_of(empty, config).find("vocab_size -1, fewer than 1"), std::string::npos);
}

TEST(MegatronNames, MultiTokenPredictionLayersAsDeepseekV3CheckpointsStoreThem) {
  // One MTP layer after 2 decoder layers: HF layer 2 (DeepSeek-V3's hub checkpoint stores its
  // MTP module as model.layers.61 with enorm, hnorm, eh_proj, shared_head.norm, the layer's own
  // attention and MLP, and copies of embed_tokens and shared_head.head).
  const nlohmann::ordered_json config = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"num_hidden_layers", 2},
                                         {"hidden_size", 8}, {"num_attention_heads", 2}, {"vocab_size", 10}};
  SourceSet set;
  set.tensors = {stored("embedding.word_embeddings.weight", {12, 8}, 0),
                 stored("output_layer.weight", {12, 8}, 1000),
                 stored("mtp.layers.0.enorm.weight", {8}, 2000),
                 stored("mtp.layers.0.hnorm.weight", {8}, 2100),
                 stored("mtp.layers.0.eh_proj.weight", {8, 16}, 2200),
                 stored("mtp.layers.0.final_layernorm.weight", {8}, 2600),
                 stored("mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight", {4}, 2700),
                 stored("mtp.layers.0.transformer_layer.mlp.router.expert_bias", {4}, 2800),
                 stored("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight", {4, 6, 8}, 3000)};
  const HfTensors m = map_megatron_to_hf(set, config, {});
  const std::string p = "model.layers.2.";
  EXPECT_EQ(find(m, p + "enorm.weight").pieces[0].offset, 2000u);
  EXPECT_EQ(find(m, p + "hnorm.weight").pieces[0].offset, 2100u);
  EXPECT_EQ(find(m, p + "eh_proj.weight").shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(find(m, p + "shared_head.norm.weight").pieces[0].offset, 2600u);
  EXPECT_EQ(find(m, p + "self_attn.kv_a_layernorm.weight").pieces[0].offset, 2700u);
  EXPECT_EQ(find(m, p + "mlp.gate.e_score_correction_bias").pieces[0].offset, 2800u);
  EXPECT_EQ(find(m, p + "mlp.experts.3.up_proj.weight").shape, (std::vector<int64_t>{3, 8}));
  // The copies are the trimmed embedding and output layer: vocab 10 of the 12 padded rows.
  const SourceTensor& embed = find(m, p + "embed_tokens.weight");
  EXPECT_EQ(embed.shape, (std::vector<int64_t>{10, 8}));
  EXPECT_EQ(embed.pieces[0].offset, 0u);
  const SourceTensor& head = find(m, p + "shared_head.head.weight");
  EXPECT_EQ(head.shape, (std::vector<int64_t>{10, 8}));
  EXPECT_EQ(head.pieces[0].offset, 1000u);
  // Mixtral's experts split into w1 (gate) and w3 (up), named by its table.
  const nlohmann::ordered_json mixtral = {{"architectures", {"MixtralForCausalLM"}}, {"num_hidden_layers", 1},
                                          {"hidden_size", 8}, {"num_attention_heads", 2}, {"vocab_size", 10}};
  SourceSet experts;
  experts.tensors = {stored("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", {6, 8}, 0)};
  const HfTensors x = map_megatron_to_hf(experts, mixtral, {});
  EXPECT_EQ(find(x, "model.layers.0.block_sparse_moe.experts.1.w1.weight").pieces[0].offset, 0u);
  EXPECT_EQ(find(x, "model.layers.0.block_sparse_moe.experts.1.w3.weight").pieces[0].offset, 3u * 8 * 2);
}

TEST(MegatronNames, VisionTowerQkvRegroupsPerHeadRowsIntoQThenKThenV) {
  // Qwen2.5-VL: the language model under language_model., text sizes in text_config; a vision
  // block's fused qkv is [heads 2 x (q, k, v) x head_dim 2, hidden 4] in Megatron.
  const nlohmann::ordered_json config = {
      {"architectures", {"Qwen2_5_VLForConditionalGeneration"}},
      {"text_config", {{"num_hidden_layers", 1}, {"hidden_size", 8}, {"num_attention_heads", 4},
                       {"num_key_value_heads", 2}, {"vocab_size", 10}}},
      {"vision_config", {{"depth", 1}, {"num_heads", 2}, {"hidden_size", 4}}}};
  SourceSet set;
  set.tensors = {stored("language_model.embedding.word_embeddings.weight", {10, 8}, 0),
                 stored("vision_model.decoder.layers.self_attention.linear_qkv.weight", {1, 12, 4}, 1000),
                 stored("vision_model.projection.encoder.linear_fc2.bias", {8}, 2000)};
  const HfTensors m = map_megatron_to_hf(set, config, {});
  EXPECT_EQ(find(m, "model.embed_tokens.weight").pieces[0].offset, 0u);
  EXPECT_EQ(find(m, "visual.merger.mlp.2.bias").pieces[0].offset, 2000u);
  const SourceTensor& qkv = find(m, "visual.blocks.0.attn.qkv.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{12, 4}));
  // HF rows: q of head 0, q of head 1, k of head 0, ... ; Megatron row of (part p, head h) is (3h + p) x 2.
  ASSERT_EQ(qkv.pieces.size(), 6u);
  const uint64_t row = 4 * 2;  // bytes of a bf16 row of 4
  const int64_t megatron_row[] = {0, 6, 2, 8, 4, 10};
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(qkv.pieces[i].offset, 1000u + static_cast<uint64_t>(megatron_row[i]) * row) << i;
    EXPECT_EQ(qkv.pieces[i].start, (std::vector<int64_t>{static_cast<int64_t>(2 * i), 0})) << i;
  }
  // A key outside both the language model and the tower is named.
  set.tensors.push_back(stored("audio_model.proj.weight", {2, 2}, 3000));
  EXPECT_THROW(map_megatron_to_hf(set, config, {}), Error);
}

}  // namespace
}  // namespace shardmerge
