// JSON files beside a checkpoint with fields of the wrong type: every reader says which file
// and which field (util/json_fields.hpp), instead of letting nlohmann's context-free
// type_error ("type must be string, but is number") escape.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "layouts/layout.hpp"
#include "plan/lora.hpp"
#include "plan/megatron_names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/json_fields.hpp"

namespace shardmerge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The message of the shardmerge::Error that `read` throws; any other exception fails the test.
template <typename F>
std::string error_of(F&& read) {
  try {
    read();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no shardmerge::Error";
  return "";
}

TEST(JsonFields, TypedOptionalFields) {
  const json j = {{"s", "x"}, {"i", 3}, {"b", true}, {"d", 0.5}, {"n", nullptr}, {"big", 18446744073709551615ull}};
  EXPECT_EQ(json_field<std::string>(j, "s", "f.json"), "x");
  EXPECT_EQ(json_field<int64_t>(j, "i", "f.json"), 3);
  EXPECT_EQ(json_field<double>(j, "i", "f.json"), 3.0);
  EXPECT_EQ(json_field<bool>(j, "b", "f.json"), true);
  EXPECT_FALSE(json_field<bool>(j, "missing", "f.json"));
  EXPECT_FALSE(json_field<bool>(j, "n", "f.json"));
  EXPECT_FALSE(json_field<bool>(json::array(), "b", "f.json"));
  EXPECT_EQ(error_of([&] { json_field<int64_t>(j, "big", "/c/f.json"); }),
            "/c/f.json: 'big' is 18446744073709551615, not an integer");
  EXPECT_EQ(error_of([&] { json_field<bool>(j, "s", "/c/f.json", "parent"); }), "/c/f.json: 'parent.s' is \"x\", not a boolean");
}

TEST(JsonFields, IntegersMustFitTheirType) {
  const json j = {{"neg", -1}, {"pos", 5}, {"big", 4294967296ull}, {"small", -2147483649ll}};
  EXPECT_EQ(error_of([&] { json_field<uint64_t>(j, "neg", "f.json"); }), "f.json: 'neg' is -1, not a non-negative integer");
  EXPECT_EQ(json_field<uint64_t>(j, "pos", "f.json"), 5u);
  EXPECT_EQ(json_field<uint32_t>(json{{"v", int64_t{7}}}, "v", "f.json"), 7u);  // a signed 7 built in code
  EXPECT_EQ(error_of([&] { json_field<uint32_t>(j, "big", "f.json"); }),
            "f.json: 'big' is 4294967296, not an integer in [0, 4294967295]");
  EXPECT_EQ(error_of([&] { json_field<int32_t>(j, "small", "f.json"); }),
            "f.json: 'small' is -2147483649, not an integer in [-2147483648, 2147483647]");
  EXPECT_EQ(json_field<int64_t>(j, "small", "f.json"), -2147483649ll);
}

TEST(JsonFields, AdapterConfigAndTrainMetaNameFileAndField) {
  const std::string source = "/ckpt/lora_adapter/adapter_config.json";
  EXPECT_EQ(error_of([&] { lora_config_from_adapter_config({{"peft_type", 3}}, source); }),
            source + ": 'peft_type' is 3, not a string");
  EXPECT_EQ(error_of([&] { lora_config_from_adapter_config({{"use_dora", "no"}}, source); }),
            source + ": 'use_dora' is \"no\", not a boolean");
  EXPECT_EQ(error_of([&] { lora_config_from_adapter_config({{"rank_pattern", {{"q_proj", "8"}}}}, source); }),
            source + ": 'rank_pattern.q_proj' is \"8\", not an integer");
  EXPECT_EQ(error_of([&] { lora_config_from_adapter_config({{"alpha_pattern", {{"q_proj", {1}}}}}, source); }),
            source + ": 'alpha_pattern.q_proj' is [1], not a number");
  EXPECT_EQ(error_of([&] { lora_config_from_train_meta({{"r", 8}, {"use_rslora", 1}}, "/ckpt/lora_train_meta.json"); }),
            "/ckpt/lora_train_meta.json: 'use_rslora' is 1, not a boolean");
  // PEFT writes null for options it leaves unset.
  EXPECT_NO_THROW(lora_config_from_adapter_config({{"use_dora", nullptr}, {"rank_pattern", {{"q_proj", nullptr}}}}, source));
}

TEST(JsonFields, MegatronManifestNamesFileAndField) {
  test::TempDir d;
  const fs::path role = d.path() / "actor";
  fs::create_directories(role / "model" / "dist_ckpt");
  std::ofstream(role / "ckpt_contents.json") << R"({"contents": {"model": {"format": 7, "path": "model/dist_ckpt"}}})";
  const std::string what = error_of([&] { layouts::detect(role.string()); });
  EXPECT_EQ(what, (role / "ckpt_contents.json").string() + ": 'contents.model.format' is 7, not a string");
  // Found by fuzz_json_sidecars: a manifest that is not an object was indexed as one.
  std::ofstream(role / "ckpt_contents.json") << "5";
  const auto layout = layouts::detect(role.string());
  bool warned = false;
  for (const auto& w : layout.warnings) warned = warned || w == (role / "ckpt_contents.json").string() + ": not a JSON object; ignored";
  EXPECT_TRUE(warned);
}

TEST(JsonFields, AnHfConfigThatIsNotAJsonObjectIsReportedWithItsPath) {
  test::TempDir d;
  std::ofstream(d.path() / "config.json") << R"({"architectures": ["Qwen2ForCausalLM"],)";
  const layouts::HfTree broken = layouts::read_hf_tree(d.path().string());
  EXPECT_FALSE(broken.has_config);
  EXPECT_EQ(broken.config_problem.rfind((d.path() / "config.json").string() + ": not valid JSON (", 0), 0u)
      << broken.config_problem;
  std::ofstream(d.path() / "config.json") << "[1, 2]";
  const layouts::HfTree array = layouts::read_hf_tree(d.path().string());
  EXPECT_FALSE(array.has_config);
  EXPECT_EQ(array.config_problem, (d.path() / "config.json").string() + ": not a JSON object");
  std::ofstream(d.path() / "config.json") << "{}";
  EXPECT_TRUE(layouts::read_hf_tree(d.path().string()).config_problem.empty());
}

TEST(JsonFields, ImplausibleWorldSizesAreIgnoredNotAllocated) {
  // fsdp_config.json {"world_size": 10^11} sized a table of 10^11 rank files: std::bad_alloc.
  test::TempDir d;
  std::ofstream(d.path() / "fsdp_config.json") << R"({"world_size": 100000000000})";
  std::ofstream(d.path() / "model_world_size_1_rank_0.pt") << "";
  std::ofstream(d.path() / "model_world_size_99999999999_rank_0.pt") << "";
  const auto layout = layouts::detect(d.path().string());
  const auto& role = std::get<layouts::FsdpRole>(layout.info);
  EXPECT_EQ(role.world_size, 1);
  EXPECT_EQ(role.world_size_source, "rank file names");
  int ignored = 0;
  for (const auto& w : layout.warnings) ignored += w.find("is not a plausible job size; ignored") != std::string::npos;
  EXPECT_EQ(ignored, 2);
}

TEST(JsonFields, HfConfigForTheMegatronMapping) {
  SourceSet empty;
  const json base = {{"architectures", {"Qwen2ForCausalLM"}}, {"num_hidden_layers", 1}, {"hidden_size", 8},
                     {"num_attention_heads", 2}, {"vocab_size", 4}};
  json tie = base;
  tie["tie_word_embeddings"] = "yes";
  EXPECT_EQ(error_of([&] { map_megatron_to_hf(empty, nlohmann::ordered_json(tie), {}); }),
            "config.json: 'tie_word_embeddings' is \"yes\", not a boolean");
  json arch = base;
  arch["architectures"] = {1};
  EXPECT_NE(error_of([&] { map_megatron_to_hf(empty, nlohmann::ordered_json(arch), {}); }).find("no Megatron -> HF mapping"),
            std::string::npos);
}

}  // namespace
}  // namespace shardmerge
