// Safe defaults of the planner: LoRA modes never put folded weights beside an adapter, a
// recorded lora_alpha is replaced only on request, the default dtype never casts between the
// 16-bit types (and any explicit cast that does is warned about), config.json states the dtype
// written, and an --hf_model_path config must describe the weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "plan/build.hpp"
#include "plan/hf_config_check.hpp"
#include "plan/lora.hpp"
#include "plan/peft_names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace shardmerge {
namespace {

const auto tensor = [](const std::string& name, std::vector<int64_t> shape, DType dtype = DType::F32) {
  return test::whole_tensor(name, std::move(shape), dtype);
};
const auto source_set = test::one_file_source_set;

class LoraModes : public ::testing::Test {
 protected:
  SourceSet set = source_set({
      tensor("base_model.model.model.embed_tokens.weight", {10, 4}),
      tensor("base_model.model.model.q.base_layer.weight", {6, 4}),
      tensor("base_model.model.model.q.lora_A.default.weight", {2, 4}),
      tensor("base_model.model.model.q.lora_B.default.weight", {6, 2}),
  });
  PeftSplit split = split_peft_names(set);
  LoraConfig config = [] {
    LoraConfig c;
    c.r = 2;
    c.alpha = 8;
    c.source = "actor/lora_train_meta.json";
    return c;
  }();

  ModelGroups groups(LoraMode mode, std::optional<double> alpha = std::nullopt, bool force = false) {
    ModelGroupsInput in;
    in.split = &split;
    in.mode = mode;
    in.config = config;
    in.alpha_override = alpha;
    in.force_alpha = force;
    return make_model_groups(in);
  }

  // Every directory of the output that holds model weights, and whether they are folded.
  static std::map<std::string, bool> folded_dirs(const ModelGroups& g) {
    std::map<std::string, bool> dirs;
    dirs[g.model.subdir] = std::any_of(g.model.tensors.begin(), g.model.tensors.end(), [](auto& t) { return t.fold; });
    if (g.unfolded)
      dirs[g.unfolded->subdir] =
          std::any_of(g.unfolded->tensors.begin(), g.unfolded->tensors.end(), [](auto& t) { return t.fold; });
    return dirs;
  }
};

TEST_F(LoraModes, TheDefaultFoldsAndWritesNoAdapter) {
  EXPECT_EQ(ModelGroupsInput{}.mode, LoraMode::Fold);
  const ModelGroups g = groups(LoraMode::Fold);
  EXPECT_TRUE(g.model.tensors[1].fold);
  EXPECT_FALSE(g.adapter || g.adapter_config || g.unfolded);
  EXPECT_EQ(g.model_dirs(), std::vector<std::string>{""});
  // One line says so and how to get verl's layout.
  const auto note = std::find_if(g.notes.begin(), g.notes.end(), [](auto& n) { return n.find("folded") == 0; });
  ASSERT_NE(note, g.notes.end());
  EXPECT_NE(note->find("no adapter"), std::string::npos) << *note;
  EXPECT_NE(note->find("--lora adapter"), std::string::npos) << *note;
}

TEST_F(LoraModes, AdapterIsVerlsLayoutOverTheUnfoldedBase) {
  const ModelGroups g = groups(LoraMode::Adapter);
  EXPECT_FALSE(g.model.tensors[1].fold);
  ASSERT_TRUE(g.adapter && g.adapter_config);
  EXPECT_FALSE(g.unfolded);
  EXPECT_EQ(g.adapter->subdir, "lora_adapter");
  EXPECT_EQ(g.adapter_config->name, "lora_adapter/adapter_config.json");
}

TEST_F(LoraModes, BothNeverPutsTheAdapterBesideFoldedWeights) {
  const ModelGroups g = groups(LoraMode::Both);
  ASSERT_TRUE(g.unfolded && g.adapter && g.adapter_config);
  const auto dirs = folded_dirs(g);
  EXPECT_EQ(dirs, (std::map<std::string, bool>{{"", true}, {"unfolded", false}}));
  // The adapter sits in the unfolded model's directory, whose weights it applies to.
  EXPECT_EQ(g.adapter->subdir, "unfolded/lora_adapter");
  EXPECT_EQ(g.adapter_config->name, "unfolded/lora_adapter/adapter_config.json");
  EXPECT_EQ(g.model_dirs(), (std::vector<std::string>{"", "unfolded"}));
  ASSERT_EQ(g.unfolded->tensors.size(), g.model.tensors.size());
  for (size_t i = 0; i < g.model.tensors.size(); ++i) {
    EXPECT_EQ(g.unfolded->tensors[i].name, g.model.tensors[i].name);
    EXPECT_EQ(g.unfolded->tensors[i].source, g.model.tensors[i].source);
  }
}

TEST_F(LoraModes, EveryModeKeepsAdaptersAwayFromFoldedWeights) {
  for (const LoraMode mode : {LoraMode::Fold, LoraMode::Adapter, LoraMode::Both, LoraMode::Drop}) {
    const ModelGroups g = groups(mode);
    if (!g.adapter) continue;
    const std::string adapter_parent = g.adapter->subdir.substr(0, g.adapter->subdir.rfind("lora_adapter"));
    const std::string model_dir = adapter_parent.empty() ? "" : adapter_parent.substr(0, adapter_parent.size() - 1);
    EXPECT_FALSE(folded_dirs(g).at(model_dir)) << "mode " << static_cast<int>(mode);
  }
}

TEST_F(LoraModes, ARecordedAlphaIsReplacedOnlyOnRequest) {
  try {
    groups(LoraMode::Fold, 16.0);
    FAIL() << "--lora-alpha 16 over a recorded 8 must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
    const std::string what = e.what();
    for (const char* part : {"--lora-alpha 16", "lora_alpha=8", "actor/lora_train_meta.json", "--force-lora-alpha"})
      EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
  }
  EXPECT_DOUBLE_EQ(groups(LoraMode::Fold, 16.0, true).model.tensors[1].fold->scale, 8.0);  // 16 / r
  EXPECT_DOUBLE_EQ(groups(LoraMode::Fold, 8.0).model.tensors[1].fold->scale, 4.0);         // the same value: no conflict
  EXPECT_NO_THROW(groups(LoraMode::Drop, 16.0));                                           // nothing is scaled
  config.alpha = 0;  // older verl wrote 0: --lora-alpha is how to give it
  EXPECT_DOUBLE_EQ(groups(LoraMode::Fold, 16.0).model.tensors[1].fold->scale, 8.0);
  config.alpha.reset();
  EXPECT_DOUBLE_EQ(groups(LoraMode::Fold, 16.0).model.tensors[1].fold->scale, 8.0);
}

// --- dtypes ----------------------------------------------------------------------------------

MergePlan plan_of(const SourceSet& set, const layouts::HfTree& hf, OutputOptions opt) {
  PlanInput in = test::one_group_input(set);
  in.hf = &hf;
  return build_plan(in, opt);
}

layouts::HfTree hf_with_dtype(const std::string& dtype) {
  layouts::HfTree hf;
  hf.path = "/nonexistent/hf";
  hf.has_config = true;
  hf.config = {{"dtype", dtype}};
  hf.sidecar_files = {"config.json"};
  return hf;
}

std::string config_dtype_written(const MergePlan& plan) {
  for (const Sidecar& s : plan.sidecars)
    if (s.name == "config.json") return nlohmann::json::parse(*s.content)["dtype"];
  return "";
}

OutputOptions fixed(DType t) {
  OutputOptions o;
  o.dtype_policy = DTypePolicy::Fixed;
  o.dtype = t;
  return o;
}

TEST(PlanDTypeDefault, Fp32BecomesBf16AsInVerl) {
  EXPECT_EQ(OutputOptions{}.dtype_policy, DTypePolicy::Default);
  const SourceSet set = source_set({tensor("w", {4}), tensor("step", {1}, DType::I64)});
  const MergePlan plan = plan_of(set, hf_with_dtype("float32"), OutputOptions{});
  EXPECT_EQ(plan.tensors[0].dtype, DType::BF16);
  EXPECT_EQ(plan.tensors[1].dtype, DType::I64);
  EXPECT_EQ(config_dtype_written(plan), "bfloat16");
  EXPECT_TRUE(plan.warnings.empty());
}

TEST(PlanDTypeDefault, SixteenBitCheckpointsKeepTheirDtype) {
  for (const DType t : {DType::F16, DType::BF16}) {
    const SourceSet set = source_set({tensor("w", {4}, t), tensor("norm", {4}, DType::F32)});
    const MergePlan plan = plan_of(set, hf_with_dtype("bfloat16"), OutputOptions{});
    EXPECT_EQ(plan.tensors[0].dtype, t);
    EXPECT_EQ(plan.tensors[1].dtype, t);  // one float dtype per model
    EXPECT_EQ(config_dtype_written(plan), dtype_name(t));
    EXPECT_TRUE(plan.warnings.empty()) << plan.warnings.front();
  }
}

TEST(PlanDTypeDefault, BothSixteenBitTypesMustBeChosenBetween) {
  const SourceSet set = source_set({tensor("a", {4}, DType::F16), tensor("b", {4}, DType::BF16)});
  try {
    plan_of(set, hf_with_dtype("float16"), OutputOptions{});
    FAIL() << "mixed fp16/bf16 planned under the default";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'a'"), std::string::npos) << what;
    EXPECT_NE(what.find("'b'"), std::string::npos) << what;
    EXPECT_NE(what.find("--dtype"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(plan_of(set, hf_with_dtype("float16"), fixed(DType::F32)));
}

TEST(PlanDTypeWarning, ExplicitSixteenBitCastsWarnInOneLine) {
  const SourceSet set = source_set({tensor("w", {4}, DType::F16), tensor("v", {4}, DType::F16)});
  const MergePlan bf16 = plan_of(set, hf_with_dtype("float16"), fixed(DType::BF16));
  EXPECT_EQ(bf16.tensors[0].dtype, DType::BF16);
  EXPECT_EQ(config_dtype_written(bf16), "bfloat16");
  ASSERT_EQ(bf16.warnings.size(), 1u);
  for (const char* part : {"--dtype bfloat16", "2 float16 tensor(s)", "'w'", "--dtype default keeps float16"})
    EXPECT_NE(bf16.warnings[0].find(part), std::string::npos) << part << " not in: " << bf16.warnings[0];
  EXPECT_EQ(bf16.warnings[0].find('\n'), std::string::npos);
  // auto: the config names bf16 while the weights are fp16
  OutputOptions automatic;
  automatic.dtype_policy = DTypePolicy::Auto;
  const MergePlan from_config = plan_of(set, hf_with_dtype("bfloat16"), automatic);
  ASSERT_EQ(from_config.warnings.size(), 1u);
  EXPECT_NE(from_config.warnings[0].find("--dtype auto"), std::string::npos) << from_config.warnings[0];
  // bf16 -> fp16 as well; widening and fp32 -> 16-bit are not warned about
  const SourceSet b = source_set({tensor("w", {4}, DType::BF16)});
  EXPECT_EQ(plan_of(b, hf_with_dtype("bfloat16"), fixed(DType::F16)).warnings.size(), 1u);
  EXPECT_TRUE(plan_of(b, hf_with_dtype("bfloat16"), fixed(DType::F32)).warnings.empty());
  const SourceSet f = source_set({tensor("w", {4})});
  EXPECT_TRUE(plan_of(f, hf_with_dtype("float32"), fixed(DType::F16)).warnings.empty());
}

TEST(PlanDTypeKeep, ConfigStatesTheDtypeWritten) {
  OutputOptions keep;
  keep.dtype_policy = DTypePolicy::Keep;
  const SourceSet f32 = source_set({tensor("w", {4}), tensor("step", {1}, DType::I64)});
  EXPECT_EQ(config_dtype_written(plan_of(f32, hf_with_dtype("bfloat16"), keep)), "float32");
  const SourceSet mixed = source_set({tensor("w", {4}), tensor("h", {4}, DType::BF16)});
  const MergePlan plan = plan_of(mixed, hf_with_dtype("bfloat16"), keep);
  for (const Sidecar& s : plan.sidecars) EXPECT_FALSE(s.name == "config.json" && s.content) << "mixed: config rewritten";
}

TEST(PlanBuild, BothWritesConfigAndTokenizerIntoEachModelDir) {
  const SourceSet set = source_set({tensor("w", {4})});
  layouts::HfTree hf = hf_with_dtype("float32");
  hf.sidecar_files = {"config.json", "tokenizer.json"};
  OutputGroup root, unfolded;
  root.file_stem = unfolded.file_stem = "model";
  unfolded.subdir = kUnfoldedDir;
  root.tensors.push_back({"w", &set.tensors[0], std::nullopt, false});
  unfolded.tensors = root.tensors;
  PlanInput in;
  in.sources = &set;
  in.groups = {root, unfolded};
  in.hf = &hf;
  in.model_dirs = {"", kUnfoldedDir};
  const MergePlan plan = build_plan(in, OutputOptions{});
  std::vector<std::string> files, sidecars;
  for (const auto& f : plan.files) files.push_back(f.name);
  for (const auto& s : plan.sidecars) sidecars.push_back(s.name);
  EXPECT_EQ(files, (std::vector<std::string>{"model.safetensors", "unfolded/model.safetensors"}));
  EXPECT_EQ(sidecars, (std::vector<std::string>{"config.json", "tokenizer.json", "unfolded/config.json",
                                                "unfolded/tokenizer.json"}));
  EXPECT_EQ(nlohmann::json::parse(*plan.sidecars[2].content)["dtype"], "bfloat16");
}

// --- --hf_model_path config vs weights ---------------------------------------------------------

class ConfigCheck : public ::testing::Test {
 protected:
  // hidden 32, 4 heads of 8, 2 KV heads, 2 layers, vocab 251
  std::vector<std::pair<std::string, std::vector<int64_t>>> weights = {
      {"model.embed_tokens.weight", {251, 32}},
      {"model.layers.0.self_attn.q_proj.weight", {32, 32}},
      {"model.layers.0.self_attn.k_proj.weight", {16, 32}},
      {"model.layers.1.self_attn.q_proj.weight", {32, 32}},
      {"model.layers.1.mlp.down_proj.weight", {32, 64}},
      {"lm_head.weight", {251, 32}},
  };
  nlohmann::ordered_json config = {{"vocab_size", 251},       {"hidden_size", 32},        {"num_hidden_layers", 2},
                                   {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"model_type", "qwen2"}};

  void check() {
    std::vector<NamedShape> shapes;
    for (const auto& [name, shape] : weights) shapes.emplace_back(name, &shape);
    check_config_matches_weights(config, "/given/config.json", shapes, "/ckpt/actor");
  }

  // The error for `field` set to `value`: a data error naming the file, the field, both values and a tensor.
  void expect_refused(const char* field, int64_t value, const std::string& implied, const std::string& tensor) {
    const auto saved = config[field];
    config[field] = value;
    try {
      check();
      ADD_FAILURE() << field << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), ExitCode::failure);
      const std::string what = e.what();
      for (const std::string& part : {std::string("/given/config.json"), std::string(field) + "=" + std::to_string(value),
                                      std::string(field) + "=" + implied, tensor, std::string("/ckpt/actor")})
        EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
    }
    config[field] = saved;
  }
};

TEST_F(ConfigCheck, AMatchingConfigPasses) { EXPECT_NO_THROW(check()); }

TEST_F(ConfigCheck, EachDisagreeingFieldIsNamedWithBothValues) {
  expect_refused("vocab_size", 256, "251", "model.embed_tokens.weight");
  expect_refused("hidden_size", 64, "32", "model.embed_tokens.weight");
  expect_refused("num_hidden_layers", 4, "2", "model.layers.1.");
  expect_refused("num_key_value_heads", 4, "2", "model.layers.0.self_attn.k_proj.weight");
  config["head_dim"] = 8;
  expect_refused("num_attention_heads", 8, "4", "model.layers.0.self_attn.q_proj.weight");
}

TEST_F(ConfigCheck, ANestedTextConfigIsTheDecoders) {
  config = {{"model_type", "qwen2_5_vl"}, {"text_config", config}, {"vision_config", {{"hidden_size", 16}}}};
  EXPECT_NO_THROW(check());
  config["text_config"]["num_hidden_layers"] = 3;
  EXPECT_THROW(check(), Error);
}

TEST_F(ConfigCheck, MultiTokenPredictionLayersFollowTheDecoders) {
  weights.push_back({"model.layers.2.eh_proj.weight", {32, 64}});  // one MTP layer: HF layer 2
  EXPECT_THROW(check(), Error);
  config["num_nextn_predict_layers"] = 1;
  EXPECT_NO_THROW(check());
  config["num_hidden_layers"] = 3;
  EXPECT_THROW(check(), Error);
}

TEST_F(ConfigCheck, LatentAttentionHeadsAreNopePlusRopeRows) {
  // DeepSeek-V2-Lite: no q_lora_rank, so q_proj is [heads x (nope + rope), hidden]; no k_proj.
  weights = {{"model.embed_tokens.weight", {251, 32}}, {"model.layers.0.self_attn.q_proj.weight", {4 * 24, 32}},
             {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {16 + 8, 32}}};
  config = {{"vocab_size", 251}, {"hidden_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
            {"num_key_value_heads", 4}, {"head_dim", 8}, {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8}};
  EXPECT_NO_THROW(check());
  expect_refused("num_attention_heads", 3, "4", "model.layers.0.self_attn.q_proj.weight");
}

TEST_F(ConfigCheck, OnlyTheDecodersLayersCount) {
  weights.push_back({"model.vision_tower.encoder.layers.11.mlp.fc1.weight", {64, 32}});  // a multimodal model's tower
  EXPECT_NO_THROW(check());
  for (auto& [name, shape] : weights)  // transformers 5 names a multimodal decoder model.language_model.*
    if (name.rfind("model.", 0) == 0 && name.find("vision") == std::string::npos)
      name = "model.language_model." + name.substr(6);
  EXPECT_NO_THROW(check());
  expect_refused("num_hidden_layers", 3, "2", "model.language_model.layers.1.");
}

TEST_F(ConfigCheck, FieldsTheConfigDoesNotStateAreNotChecked) {
  config = {{"model_type", "custom"}};
  EXPECT_NO_THROW(check());
}

}  // namespace
}  // namespace shardmerge
