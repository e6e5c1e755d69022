// The save-time name table (plan/saved_names.hpp) against transformers itself: saved_names.json
// is written by tests/fixtures/fx_saved_names.py from every model class of the pinned
// transformers (run-time state_dict names and shapes, and what its save-time revert makes of
// them, in order). Every class that converts must be in the table, reproduced exactly or marked
// refused; every class whose run-time names look converted must be in the table too.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "plan/saved_names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace shardmerge {
namespace {

using Named = std::vector<std::pair<std::string, std::vector<int64_t>>>;

Named named(const nlohmann::json& rows) {
  Named out;
  for (const auto& r : rows) out.emplace_back(r[0].get<std::string>(), r[1].get<std::vector<int64_t>>());
  return out;
}

nlohmann::json saved_names_json() {
  std::ifstream in(std::filesystem::path(test::fixtures_dir()) / "saved_names.json");
  if (!in) return nullptr;
  return nlohmann::json::parse(in);
}

const SavedNameClass* row_of(const std::string& cls, const std::string& model_type) {
  return saved_name_class(nlohmann::ordered_json{{"architectures", {cls}}, {"model_type", model_type}});
}

// What the table makes of a run-time state dict, in save_pretrained's order.
Named convert(const SavedNameRules& rules, Named runtime) {
  std::stable_sort(runtime.begin(), runtime.end(),
                   [](const auto& a, const auto& b) { return dot_natural_less(a.first, b.first); });
  Named out;
  for (const auto& [name, shape] : runtime)
    for (const SavedPart& p : saved_parts(rules, name, shape))
      out.emplace_back(p.name, std::vector<int64_t>(p.extent.begin() + static_cast<std::ptrdiff_t>(p.drop), p.extent.end()));
  return out;
}

TEST(SavedNames, AgreesWithTransformers) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const nlohmann::json j = saved_names_json();
  if (j.is_null()) GTEST_SKIP() << "saved_names.json was not generated";
  size_t reproduced = 0, refused = 0, as_is = 0;
  for (const auto& [cls, v] : j["classes"].items()) {
    SCOPED_TRACE(cls);
    const Named runtime = named(v["runtime"]), saved = named(v["saved"]);
    Named sorted_runtime = runtime, sorted_saved = saved;
    std::sort(sorted_runtime.begin(), sorted_runtime.end());
    std::sort(sorted_saved.begin(), sorted_saved.end());
    const SavedNameClass* row = row_of(cls, v["model_type"].get<std::string>());
    if (sorted_runtime == sorted_saved) {
      // transformers registers a conversion that changes no name here; the table may omit it
      // (unless its names look converted: checked below with the unconverted classes).
      if (row) {
        EXPECT_TRUE(!row->rules || row->rules->refused || convert(*row->rules, runtime) == saved);
      }
      ++as_is;
      continue;
    }
    ASSERT_NE(row, nullptr) << cls << " (" << v["model_type"] << ") converts on save but has no row in the table";
    ASSERT_NE(row->rules, nullptr) << cls << " converts on save but its row says it does not";
    if (row->rules->refused) {
      ++refused;
      continue;
    }
    EXPECT_EQ(convert(*row->rules, runtime), saved) << cls << ": names, shapes or order differ from transformers'";
    ++reproduced;
  }
  for (const auto& [cls, v] : j["unconverted"].items()) {
    for (const auto& n : v["names"]) {
      if (!looks_like_runtime_name(n[0].get<std::string>(), n[1].get<std::vector<int64_t>>())) continue;
      const SavedNameClass* row = row_of(cls, v["model_type"].get<std::string>());
      EXPECT_TRUE(row && !row->rules) << cls << " keeps run-time-looking names such as " << n[0]
                                      << " on save: the table must say so, or merges of it are refused";
      break;
    }
  }
  std::printf("transformers %s: %zu classes converted as transformers does, %zu refused, %zu convert nothing; "
              "%zu classes could not be built\n",
              j["transformers"].get<std::string>().c_str(), reproduced, refused, as_is, j["unbuildable"].size());
  EXPECT_GT(reproduced, 20u);
}

TEST(SavedNames, SplitsAFusedExpertTensorPartMajor) {
  const SavedNameClass* row = row_of("Qwen3MoeForCausalLM", "qwen3_moe");
  ASSERT_TRUE(row && row->rules);
  const auto parts = saved_parts(*row->rules, "model.layers.3.mlp.experts.gate_up_proj", {2, 8, 5});
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].name, "model.layers.3.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(parts[1].name, "model.layers.3.mlp.experts.1.gate_proj.weight");
  EXPECT_EQ(parts[2].name, "model.layers.3.mlp.experts.0.up_proj.weight");
  EXPECT_EQ(parts[3].start, (std::vector<int64_t>{1, 4, 0}));
  EXPECT_EQ(parts[3].extent, (std::vector<int64_t>{1, 4, 5}));
  EXPECT_THROW(saved_parts(*row->rules, "model.layers.3.mlp.experts.gate_up_proj", {2, 7, 5}), Error);
}

TEST(SavedNames, RenamesMatchWholeSegmentsOnly) {
  const SavedNameClass* row = row_of("MixtralForCausalLM", "mixtral");
  ASSERT_TRUE(row && row->rules);
  EXPECT_EQ(saved_parts(*row->rules, "model.layers.0.mlp.gate.weight", {4, 8}).front().name,
            "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(saved_parts(*row->rules, "model.layers.0.mlp.gate_proj.weight", {4, 8}).front().name,
            "model.layers.0.mlp.gate_proj.weight");
  const SavedNameClass* vl = row_of("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl");
  ASSERT_TRUE(vl && vl->rules);
  EXPECT_EQ(saved_parts(*vl->rules, "model.visual.blocks.0.attn.qkv.weight", {6, 2}).front().name,
            "visual.blocks.0.attn.qkv.weight");
  EXPECT_EQ(saved_parts(*vl->rules, "model.language_models.x", {1}).front().name, "model.language_models.x");
}

TEST(SavedNames, NaturalOrderIsTransformers) {
  EXPECT_TRUE(dot_natural_less("model.layers.2.x", "model.layers.10.x"));
  EXPECT_TRUE(dot_natural_less("lm_head.weight", "model.embed_tokens.weight"));
  EXPECT_TRUE(dot_natural_less("a.shard_2", "a.shard_11"));
  EXPECT_TRUE(dot_natural_less("a.b", "a.b2"));
  EXPECT_TRUE(dot_natural_less("a.7", "a.b"));  // numbers before words
  EXPECT_FALSE(dot_natural_less("a.b", "a.b"));
}

TEST(SavedNames, KeepsTransformersFp32Tensors) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const nlohmann::json j = saved_names_json();
  if (j.is_null()) GTEST_SKIP() << "saved_names.json was not generated";
  ASSERT_TRUE(j.contains("fp32")) << "saved_names.json predates the fp32 lists: regenerate the fixtures";
  size_t classes = 0;
  for (const auto& [cls, v] : j["fp32"].items()) {
    SCOPED_TRACE(cls);
    std::vector<std::string> theirs = v["patterns"].get<std::vector<std::string>>(), ours;
    const auto patterns = fp32_module_patterns(cls);
    for (std::string_view p : patterns) ours.emplace_back(p);
    std::sort(theirs.begin(), theirs.end());
    std::sort(ours.begin(), ours.end());
    EXPECT_EQ(ours, theirs) << cls << " keeps other modules in float32 than the table says";
    // The names transformers' own matcher selects, among all the class's saved names.
    std::vector<std::string> selected;
    const nlohmann::json& names = j["classes"].contains(cls) ? j["classes"][cls]["saved"] : nlohmann::json::array();
    for (const auto& n : names)
      if (kept_in_fp32(patterns, n[0].get<std::string>())) selected.push_back(n[0].get<std::string>());
    std::vector<std::string> expected = v["tensors"].get<std::vector<std::string>>();
    if (names.empty()) selected = expected;  // saved as at run time: only the selected names were recorded
    for (const std::string& n : expected) EXPECT_TRUE(kept_in_fp32(patterns, n)) << n;
    EXPECT_EQ(selected, expected);
    ++classes;
  }
  for (const auto& [cls, v] : j["classes"].items()) {
    const bool keeps_none = !j["fp32"].contains(cls);
    EXPECT_TRUE(!keeps_none || fp32_module_patterns(cls).empty()) << cls << " keeps nothing in float32";
  }
  std::printf("transformers %s: %zu classes keep modules in float32, as the table says\n",
              j["transformers"].get<std::string>().c_str(), classes);
}

TEST(SavedNames, Fp32PatternsMatchAsTransformersSearches) {
  const std::vector<std::string_view> p = {"gate.weight", "e_score_correction_bias", "attn_hc.*scale"};
  EXPECT_TRUE(kept_in_fp32(p, "model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(kept_in_fp32(p, "model.layers.1.mlp.gate_weight"));  // '.' is any character
  EXPECT_TRUE(kept_in_fp32(p, "model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(kept_in_fp32(p, "model.attn_hc.base.scale"));
  EXPECT_FALSE(kept_in_fp32(p, "model.layers.1.mlp.experts.0.gate_proj.weight"));
  EXPECT_FALSE(kept_in_fp32(p, "model.layers.1.mlp.gate.bias"));
  EXPECT_FALSE(kept_in_fp32({}, "model.layers.1.mlp.gate.weight"));
}

}  // namespace
}  // namespace shardmerge
