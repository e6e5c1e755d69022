// Planning without I/O: names, LoRA grouping and scales, dtypes, HF sharding, headers, JSON.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "formats/safetensors.hpp"
#include "plan/build.hpp"
#include "plan/lora.hpp"
#include "plan/peft_names.hpp"
#include "plan/plan_file.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/bytes.hpp"

namespace shardmerge {
namespace {

const auto tensor = [](const std::string& name, std::vector<int64_t> shape, DType dtype = DType::F32) {
  return test::whole_tensor(name, std::move(shape), dtype);
};
const auto source_set = test::one_file_source_set;

TEST(PlanPeftNames, StripsWrappersPrefixesAndGroupsLora) {
  SourceSet set = source_set({
      tensor("base_model.model.model._fsdp_wrapped_module.embed_tokens.base_layer.weight", {10, 4}),
      tensor("base_model.model.model.embed_tokens.lora_embedding_A.default", {2, 10}),
      tensor("base_model.model.model.embed_tokens.lora_embedding_B.default", {4, 2}),
      tensor("base_model.model.model.layers.0.q_proj.base_layer.weight", {4, 4}),
      tensor("base_model.model.model.layers.0.q_proj.base_layer.bias", {4}),
      tensor("base_model.model.model.layers.0.q_proj.lora_A.default.weight", {2, 4}),
      tensor("base_model.model.model.layers.0.q_proj.lora_B.default.weight", {4, 2}),
      tensor("base_model.model.score.original_module.weight", {1, 4}),
      tensor("base_model.model.score.modules_to_save.default.weight", {1, 4}),
      tensor("base_model.model.model.norm.weight", {4}),
  });
  const PeftSplit split = split_peft_names(set);
  std::vector<std::string> names;
  for (const auto& [n, _] : split.base) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.q_proj.weight",
                                             "model.layers.0.q_proj.bias", "score.weight", "model.norm.weight"}));
  ASSERT_EQ(split.lora.size(), 2u);
  EXPECT_EQ(split.lora[0].module, "model.embed_tokens");
  EXPECT_TRUE(split.lora[0].embedding);
  EXPECT_EQ(split.lora[1].module, "model.layers.0.q_proj");
  EXPECT_EQ(split.lora[1].a->shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(split.adapter_names, (std::vector<std::string>{"default"}));
  EXPECT_TRUE(split.unsupported.empty());
}

TEST(PlanPeftNames, FlagsPeftFeaturesThatCannotBeFolded) {
  SourceSet set = source_set({tensor("base_model.model.q.base_layer.weight", {4, 4}),
                              tensor("base_model.model.q.lora_magnitude_vector.default.weight", {4}),
                              tensor("base_model.model.k.ia3_l.default", {4})});
  const PeftSplit split = split_peft_names(set);
  EXPECT_EQ(split.unsupported.size(), 2u);
}

TEST(PlanPeftNames, SavedAdapterNamesHaveNoAdapterSegment) {
  SourceSet set = source_set({tensor("model.q.weight", {4, 4}), tensor("base_model.model.model.q.lora_A.weight", {2, 4}),
                              tensor("base_model.model.model.q.lora_B.weight", {4, 2}),
                              tensor("base_model.model.model.q.base_layer.weight", {4, 4})});
  PeftSplit split;
  add_peft_tensors(split, std::span<const SourceTensor>(set.tensors).first(1), false);
  add_peft_tensors(split, std::span<const SourceTensor>(set.tensors).subspan(1), true);
  ASSERT_EQ(split.lora.size(), 1u);
  EXPECT_EQ(split.lora[0].module, "model.q");
  // The adapter's own copy of the base weight replaces the base model's.
  ASSERT_EQ(split.base.size(), 1u);
  EXPECT_EQ(split.base[0].second->name, "base_model.model.model.q.base_layer.weight");
  EXPECT_EQ(split.replaced, (std::vector<std::string>{"model.q.weight"}));
}

TEST(PlanLora, ScalesFollowPeft) {
  LoraConfig c;
  c.r = 8;
  c.alpha = 16;
  EXPECT_DOUBLE_EQ(lora_scale(c, "model.layers.0.q_proj", 8), 2.0);
  c.use_rslora = true;
  EXPECT_DOUBLE_EQ(lora_scale(c, "model.layers.0.q_proj", 8), 16 / std::sqrt(8.0));
  c.use_rslora = false;
  c.rank_pattern["layers.1.v_proj"] = 4;
  c.alpha_pattern["v_proj"] = 32;
  EXPECT_DOUBLE_EQ(lora_scale(c, "model.layers.1.v_proj", 4), 8.0);
  EXPECT_DOUBLE_EQ(lora_scale(c, "model.layers.0.v_proj", 8), 4.0);
  // "(.*\.)?(key)$": a pattern must match whole trailing name components.
  EXPECT_DOUBLE_EQ(lora_scale(c, "model.layers.0.xv_proj", 8), 2.0);
  // Tensors whose rank disagrees with the config are refused.
  EXPECT_THROW(lora_scale(c, "model.layers.0.q_proj", 16), Error);
}

TEST(PlanLora, ConfigsRefuseWhatCannotBeFoldedExactly) {
  EXPECT_THROW(lora_config_from_adapter_config({{"peft_type", "LORA"}, {"use_dora", true}}, "a.json"), Error);
  EXPECT_THROW(lora_config_from_adapter_config({{"peft_type", "IA3"}}, "a.json"), Error);
  const LoraConfig c = lora_config_from_adapter_config(
      {{"peft_type", "LORA"}, {"r", 8}, {"lora_alpha", 32}, {"use_rslora", true}, {"fan_in_fan_out", true}}, "a.json");
  EXPECT_EQ(c.r, 8);
  EXPECT_EQ(c.alpha, 32);
  EXPECT_TRUE(c.use_rslora && c.fan_in_fan_out);
  const LoraConfig m = lora_config_from_train_meta({{"r", 4}, {"lora_alpha", 8}, {"task_type", "CAUSAL_LM"}}, "meta.json");
  EXPECT_EQ(m.task_type, "CAUSAL_LM");
}

class PlanGroups : public ::testing::Test {
 protected:
  SourceSet set = source_set({
      tensor("base_model.model.model.embed_tokens.weight", {10, 4}),
      tensor("base_model.model.model.q.base_layer.weight", {6, 4}),
      tensor("base_model.model.model.q.lora_A.default.weight", {2, 4}),
      tensor("base_model.model.model.q.lora_B.default.weight", {6, 2}),
      tensor("base_model.model.lm_head.weight", {10, 4}),
  });
  PeftSplit split = split_peft_names(set);
  LoraConfig config = [] {
    LoraConfig c;
    c.r = 2;
    c.alpha = 8;
    c.task_type = "CAUSAL_LM";
    return c;
  }();

  ModelGroups groups(LoraMode mode, bool tied = false) {
    ModelGroupsInput in;
    in.split = &split;
    in.mode = mode;
    in.config = config;
    in.drop_tied_lm_head = tied;
    return make_model_groups(in);
  }
};

TEST_F(PlanGroups, FoldPairsWeightsWithTheirAdapters) {
  const ModelGroups g = groups(LoraMode::Fold);
  ASSERT_EQ(g.model.tensors.size(), 3u);
  EXPECT_FALSE(g.adapter);
  const PlannedTensor& q = g.model.tensors[1];
  EXPECT_EQ(q.name, "model.q.weight");
  ASSERT_TRUE(q.fold);
  EXPECT_DOUBLE_EQ(q.fold->scale, 4.0);
  EXPECT_FALSE(q.fold->fan_in_fan_out);
  EXPECT_FALSE(g.model.tensors[0].fold);
}

TEST_F(PlanGroups, AdapterExportIsPeftFormat) {
  const ModelGroups g = groups(LoraMode::Adapter);
  EXPECT_FALSE(g.model.tensors[1].fold);
  ASSERT_TRUE(g.adapter && g.adapter_config);
  EXPECT_EQ(g.adapter->subdir, "lora_adapter");
  EXPECT_EQ(g.adapter->tensors[0].name, "base_model.model.model.q.lora_A.weight");
  EXPECT_EQ(g.adapter->tensors[1].name, "base_model.model.model.q.lora_B.weight");
  const auto cfg = nlohmann::json::parse(*g.adapter_config->content);
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 2);
  EXPECT_EQ(cfg["lora_alpha"], 8.0);
  EXPECT_EQ(cfg["target_modules"], nlohmann::json::array({"q"}));
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
}

// PEFT's save_pretrained writes target_modules as the shortest suffixes that match no other
// module: leaf names would match a vision block ("0" -> visual.blocks.0) or a convolution
// ("proj" -> visual.patch_embed.proj), and PEFT then refuses or wraps them on load.
TEST(PlanLora, AdapterTargetModulesMatchOnlyTheAdaptedModules) {
  std::vector<SourceTensor> tensors;
  for (const std::string m : {"model.visual.blocks.0.attn.proj", "model.visual.merger.mlp.0", "model.visual.merger.mlp.2",
                              "model.language_model.layers.0.self_attn.q_proj"}) {
    tensors.push_back(tensor("base_model.model." + m + ".base_layer.weight", {4, 4}));
    tensors.push_back(tensor("base_model.model." + m + ".lora_A.default.weight", {2, 4}));
    tensors.push_back(tensor("base_model.model." + m + ".lora_B.default.weight", {4, 2}));
  }
  tensors.push_back(tensor("base_model.model.model.visual.patch_embed.proj.weight", {4, 4}));
  tensors.push_back(tensor("base_model.model.model.visual.blocks.0.norm1.weight", {4}));
  tensors.push_back(tensor("base_model.model.model.language_model.layers.2.input_layernorm.weight", {4}));
  const SourceSet set = source_set(tensors);
  const PeftSplit split = split_peft_names(set);
  ModelGroupsInput in;
  in.split = &split;
  in.mode = LoraMode::Adapter;
  LoraConfig c;
  c.alpha = 8;
  in.config = c;
  const auto cfg = nlohmann::json::parse(*make_model_groups(in).adapter_config->content);
  // "2" would also match the decoder layer model.language_model.layers.2
  EXPECT_EQ(cfg["target_modules"], nlohmann::json::array({"attn.proj", "mlp.0", "mlp.2", "q_proj"}));
}

TEST_F(PlanGroups, BothAndDrop) {
  const ModelGroups both = groups(LoraMode::Both);
  EXPECT_TRUE(both.model.tensors[1].fold);
  EXPECT_TRUE(both.adapter);
  const ModelGroups drop = groups(LoraMode::Drop);
  EXPECT_FALSE(drop.model.tensors[1].fold);
  EXPECT_FALSE(drop.adapter);
}

TEST_F(PlanGroups, TiedLmHeadIsDropped) {
  EXPECT_EQ(groups(LoraMode::Drop, true).model.tensors.size(), 2u);
  EXPECT_EQ(groups(LoraMode::Drop, false).model.tensors.size(), 3u);
}

TEST_F(PlanGroups, ZeroAlphaSaysHowToPassIt) {
  config.alpha = 0;
  try {
    groups(LoraMode::Fold);
    FAIL() << "alpha 0 must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--lora-alpha"), std::string::npos);
  }
  EXPECT_NO_THROW(groups(LoraMode::Drop));  // nothing to scale
}

TEST(PlanBuild, DTypesShardsOffsetsAndIndex) {
  // Sizes as F32 bytes: 24, 24, 8, 24, 8, 8 with a 40-byte limit: huggingface_hub's greedy split.
  SourceSet set = source_set({tensor("a", {6}), tensor("b", {6}), tensor("c", {2}), tensor("d", {6}),
                              tensor("e", {2}), tensor("step", {2}, DType::I64), tensor("huge", {20})});
  PlanInput in = test::one_group_input(set);
  OutputOptions opt;
  opt.dtype_policy = DTypePolicy::Keep;
  opt.max_shard_size = 40;
  const MergePlan plan = build_plan(in, opt);
  // Greedy, in order: [a] [b c] [d e]; huge is larger than the limit and becomes a shard of its
  // own at once, while the open shard stays open; step closes [d e] and ends up last.
  ASSERT_EQ(plan.files.size(), 5u);
  EXPECT_EQ(plan.files[0].name, "model-00001-of-00005.safetensors");
  auto file_of = [&](const std::string& name) {
    for (const auto& t : plan.tensors)
      if (t.name == name) return plan.files[t.file].name;
    return std::string();
  };
  EXPECT_EQ(file_of("a"), plan.files[0].name);
  EXPECT_EQ(file_of("b"), plan.files[1].name);
  EXPECT_EQ(file_of("c"), plan.files[1].name);
  EXPECT_EQ(file_of("e"), plan.files[2].name);
  EXPECT_EQ(file_of("huge"), plan.files[3].name);
  EXPECT_EQ(file_of("step"), plan.files[4].name);
  // Every file's header parses as strict safetensors, and tensors sit where the header says.
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    const std::string& h = plan.files[f].header;
    const uint64_t n = load_le<uint64_t>(h.data());
    ASSERT_EQ(h.size(), 8 + n);
    EXPECT_EQ(n % 8, 0u);
    const SafetensorsFile st = SafetensorsFile::from_header(h.substr(8), plan.files[f].size);
    EXPECT_EQ(st.metadata().at("format"), "pt");
    for (const auto& t : plan.tensors) {
      if (t.file != f) continue;
      const SafetensorsTensor* placed = st.find(t.name);
      ASSERT_NE(placed, nullptr) << t.name;
      EXPECT_EQ(placed->file_offset, t.offset);
      EXPECT_EQ(placed->nbytes, t.nbytes);
    }
  }
  ASSERT_EQ(plan.sidecars.size(), 1u);
  EXPECT_EQ(plan.sidecars[0].name, "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(*plan.sidecars[0].content);
  EXPECT_EQ(index["metadata"]["total_size"], 24 + 24 + 8 + 24 + 8 + 16 + 80);
  EXPECT_EQ(index["weight_map"]["c"], file_of("c"));
}

TEST(PlanBuild, CastsFloatsOnlyAndRewritesConfigDtype) {
  SourceSet set = source_set({tensor("w", {4, 4}), tensor("n", {4}, DType::I64), tensor("h", {4}, DType::BF16)});
  OutputGroup g;
  g.file_stem = "model";
  for (const auto& t : set.tensors) g.tensors.push_back({t.name, &t, std::nullopt, false});
  layouts::HfTree hf;
  hf.path = "/nonexistent/hf";
  hf.has_config = true;
  hf.config = {{"architectures", {"Qwen2ForCausalLM"}}, {"dtype", "float32"}};
  hf.sidecar_files = {"config.json", "tokenizer.json"};
  PlanInput in;
  in.sources = &set;
  in.groups.push_back(g);
  in.hf = &hf;
  const MergePlan plan = build_plan(in, OutputOptions{});
  ASSERT_EQ(plan.files.size(), 1u);
  EXPECT_EQ(plan.files[0].name, "model.safetensors");
  EXPECT_EQ(plan.tensors[0].dtype, DType::BF16);
  EXPECT_EQ(plan.tensors[1].dtype, DType::I64);
  EXPECT_EQ(plan.tensors[2].dtype, DType::BF16);
  ASSERT_EQ(plan.sidecars.size(), 2u);
  const auto cfg = nlohmann::json::parse(*plan.sidecars[0].content);
  EXPECT_EQ(cfg["dtype"], "bfloat16");
  EXPECT_FALSE(plan.sidecars[1].content);
  EXPECT_EQ(plan.sidecars[1].source, "/nonexistent/hf/tokenizer.json");
  // auto takes config.json's dtype
  OutputOptions opt;
  opt.dtype_policy = DTypePolicy::Auto;
  EXPECT_EQ(build_plan(in, opt).tensors[0].dtype, DType::F32);
  const auto j = plan_to_json(plan, nlohmann::ordered_json::object());
  EXPECT_EQ(j["tensors"][0]["ops"][0]["op"], "cast");
  EXPECT_EQ(j["tensors"][0]["copies"][0]["file"], "/nonexistent/rank0.pt");
  EXPECT_EQ(j["tensors"][1]["ops"].size(), 0u);
}

TEST(PlanBuild, ComplexTensorsAreRefusedWhateverTheDtypePolicy) {
  for (const DType complex : {DType::C32, DType::C64, DType::C128}) {
    SourceSet set = source_set({tensor("w", {4}), tensor("z", {4}, complex)});
    const PlanInput in = test::one_group_input(set);
    for (const DTypePolicy policy : {DTypePolicy::Fixed, DTypePolicy::Keep}) {
      OutputOptions opt;
      opt.dtype_policy = policy;
      try {
        build_plan(in, opt);
        ADD_FAILURE() << dtype_name(complex) << " planned";
      } catch (const Error& e) {
        EXPECT_EQ(e.tensor(), "z");
        EXPECT_NE(std::string(e.what()).find(std::string(dtype_name(complex)) + "; complex tensors are not supported"),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace shardmerge
