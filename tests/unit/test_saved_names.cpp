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

}  // namespace
}  // namespace shardmerge
