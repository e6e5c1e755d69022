// Megatron legacy per-rank trees (pipeline/describe.cpp, describe_megatron_legacy) built
// from hostile names: rank directories, VPP chunk prefixes and expert numbers that do not
// parse, or parse to indices that would overflow, are errors naming the tensor or directory.
// The rank files are small torch.save archives written with the repository's writers.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "formats/pickle_writer.hpp"
#include "formats/torch_writer.hpp"
#include "layouts/layout.hpp"
#include "pipeline/describe.hpp"
#include "plan/megatron_tp.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {
namespace {

using Tensors = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// torch.save({name: zeros(shape, dtype=float32), ...}) into <dir>/model.pt.
void write_rank_file(const fs::path& dir, const Tensors& tensors) {
  fs::create_directories(dir);
  pickle::Writer w;
  w.empty_dict().mark();
  std::vector<int64_t> numels;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, shape] = tensors[i];
    std::vector<int64_t> stride(shape.size(), 1);
    int64_t numel = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      stride[d] = numel;
      numel *= shape[d];
    }
    numels.push_back(numel);
    w.str(name).global("torch._utils", "_rebuild_tensor_v2").mark();
    w.mark().str("storage").global("torch", "FloatStorage").str(std::to_string(i)).str("cpu").integer(numel).tuple().binpersid();
    w.integer(0).int_tuple(shape).int_tuple(stride).boolean(false).global("collections", "OrderedDict").empty_tuple().reduce();
    w.tuple().reduce();
  }
  w.setitems();
  TorchArchiveWriter zip((dir / "model.pt").string(), "model");
  zip.add_record("data.pkl", w.finish());
  zip.add_record("byteorder", "little");
  for (size_t i = 0; i < numels.size(); ++i)
    zip.add_record("data/" + std::to_string(i), std::string(static_cast<size_t>(numels[i]) * 4, '\0'));
  zip.finish();
}

using Ranks = std::vector<std::pair<std::string, Tensors>>;

// A legacy role in `root`: each rank directory with its model.pt.
MegatronRole legacy_role(const test::TempDir& root, const Ranks& ranks) {
  MegatronRole role;
  role.path = root.path().string();
  role.layout = "legacy mp_rank";
  for (const auto& [dir, tensors] : ranks) {
    write_rank_file(root.path() / dir, tensors);
    role.mp_rank_dirs.push_back((root.path() / dir).string());
  }
  return role;
}

std::string legacy_error(const test::TempDir& root, const Ranks& ranks,
                         const nlohmann::ordered_json& config = nlohmann::ordered_json::object()) {
  const MegatronRole role = legacy_role(root, ranks);
  try {
    describe_megatron_legacy(role, config);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(MegatronLegacy, AWellFormedTreeDescribes) {
  test::TempDir root;
  const Tensors rank = {{"decoder.layers.0.self_attention.linear_proj.weight", {4, 2}},
                        {"decoder.final_layernorm.weight", {4}}};
  const SourceSet set =
      describe_megatron_legacy(legacy_role(root, {{"mp_rank_00", rank}, {"mp_rank_01", rank}}), nlohmann::ordered_json::object());
  ASSERT_EQ(set.tensors.size(), 2u);
  EXPECT_EQ(set.tensors[1].name, "decoder.layers.0.self_attention.linear_proj.weight");
  EXPECT_EQ(set.tensors[1].shape, (std::vector<int64_t>{4, 4}));
}

TEST(MegatronLegacy, RankIndicesPastTheDirectoryCountAreRefused) {
  // tp = 2^63 - 1: "tp + 1" and tp * pp * ep overflowed.
  test::TempDir root;
  const std::string what = legacy_error(root, {{"mp_rank_9223372036854775807", {{"decoder.final_layernorm.weight", {4}}}}});
  EXPECT_NE(what.find("rank index past the 1 mp_rank directories"), std::string::npos) << what;
  EXPECT_NE(what.find("mp_rank_9223372036854775807"), std::string::npos) << what;
}

TEST(MegatronLegacy, ExpertNumbersThatDoNotParseAreErrors) {
  const nlohmann::ordered_json moe = {{"num_experts", 2}, {"moe_intermediate_size", 4}};
  {  // SequentialMLP with no number: an empty optional was dereferenced.
    test::TempDir root;
    const std::string what =
        legacy_error(root, {{"mp_rank_00", {{"decoder.layers.0.mlp.experts.local_experts.x.linear_fc2.weight", {4, 4}}}}}, moe);
    EXPECT_NE(what.find("local expert without an expert number"), std::string::npos) << what;
  }
  {  // TEGroupedMLP "weight<j>" with no number: std::stoll threw std::invalid_argument.
    test::TempDir root;
    const std::string what =
        legacy_error(root, {{"mp_rank_00", {{"decoder.layers.0.mlp.experts.linear_fc2.weightx", {4, 4}}}}}, moe);
    EXPECT_NE(what.find("grouped expert weight without an expert number"), std::string::npos) << what;
    EXPECT_NE(what.find("tensor 'decoder.layers.0.mlp.experts.linear_fc2.weightx'"), std::string::npos) << what;
  }
  {  // An expert number past config.json's experts: ep_rank * (E / ep) + j overflowed.
    test::TempDir root;
    const std::string what =
        legacy_error(root, {{"mp_rank_00", {{"decoder.layers.0.mlp.experts.linear_fc2.weight9223372036854775807", {4, 4}}}}}, moe);
    EXPECT_NE(what.find("without an expert number"), std::string::npos) << what;
    test::TempDir root2;
    const std::string past =
        legacy_error(root2, {{"mp_rank_00", {{"decoder.layers.0.mlp.experts.linear_fc2.weight2", {4, 4}}}}}, moe);
    EXPECT_NE(past.find("local expert 2 but each of the 1 EP ranks holds 2"), std::string::npos) << past;
  }
}

TEST(MegatronLegacy, HugeLayerAndChunkNumbersAreNotIndices) {
  // "decoder.layers.<2^63 - 1>." made "layer + 1" overflow; such a name is not a layer.
  test::TempDir root;
  const SourceSet set = describe_megatron_legacy(
      legacy_role(root, {{"mp_rank_00", {{"decoder.layers.9223372036854775807.input_layernorm.weight", {4}},
                                         {"-1.decoder.final_layernorm.weight", {4}}}}}),
      nlohmann::ordered_json::object());
  std::vector<std::string> names;
  for (const auto& t : set.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"-1.decoder.final_layernorm.weight",
                                             "decoder.layers.9223372036854775807.input_layernorm.weight"}));
}

TEST(MegatronLegacy, RowParallelTensorsOfOneDimAreRefused) {
  // Concatenating along dim 1 of a 1-D tensor wrote past the slice's start vector.
  test::TempDir root;
  const Tensors one_dim = {{"decoder.layers.0.self_attention.linear_proj.weight", {4}}};
  const std::string what = legacy_error(root, {{"mp_rank_00", one_dim}, {"mp_rank_01", one_dim}});
  EXPECT_NE(what.find("has 1 dims; its TP shards are concatenated along dim 1"), std::string::npos) << what;
}

TEST(MegatronLegacyTp, EachParameterHasItsSplit) {
  // megatron-core's layers: ColumnParallelLinear (QKV, fc1), RowParallelLinear (proj, fc2; the
  // bias is added after the all-reduce, so every rank holds all of it), VocabParallelEmbedding.
  const std::vector<std::pair<std::string, LegacyTpSplit>> cases = {
      {"embedding.word_embeddings.weight", LegacyTpSplit::Dim0},
      {"decoder.layers.0.input_layernorm.weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.self_attention.linear_qkv.weight", LegacyTpSplit::Dim0},
      {"decoder.layers.0.self_attention.linear_qkv.bias", LegacyTpSplit::Dim0},
      {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.self_attention.q_layernorm.weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.self_attention.linear_proj.weight", LegacyTpSplit::Dim1},
      {"decoder.layers.0.self_attention.linear_proj.bias", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.linear_fc1.weight", LegacyTpSplit::GateUp},
      {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.linear_fc2.weight", LegacyTpSplit::Dim1},
      {"decoder.layers.0.mlp.linear_fc2.bias", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.router.weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.router.expert_bias", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.shared_experts.linear_fc1.weight", LegacyTpSplit::GateUp},
      {"decoder.layers.0.mlp.shared_experts.gate_weight", LegacyTpSplit::Replicated},
      {"decoder.layers.0.mlp.experts.3.linear_fc1.weight", LegacyTpSplit::GateUp},
      {"decoder.layers.0.mlp.experts.3.linear_fc2.weight", LegacyTpSplit::Dim1},
      {"decoder.final_layernorm.weight", LegacyTpSplit::Replicated},
      {"output_layer.weight", LegacyTpSplit::Dim0},
  };
  for (const auto& [name, split] : cases) {
    EXPECT_EQ(to_string(legacy_tp_split(name, {8, 8}, 2, 16)), std::string(to_string(split))) << name;
    EXPECT_EQ(legacy_tp_split(name, {8, 8}, 1, 16), LegacyTpSplit::Replicated) << name;
  }
  // Expert-TP 1: the shard already has all moe_intermediate_size rows (fc1: gate and up).
  EXPECT_EQ(legacy_tp_split("decoder.layers.0.mlp.experts.3.linear_fc1.weight", {32, 8}, 2, 16), LegacyTpSplit::Replicated);
  EXPECT_EQ(legacy_tp_split("decoder.layers.0.mlp.experts.3.linear_fc2.weight", {8, 16}, 2, 16), LegacyTpSplit::Replicated);
  // A shared expert is not an expert of the router: its fc1 of 2 * moe_ffn rows is still split.
  EXPECT_EQ(legacy_tp_split("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", {32, 8}, 2, 16), LegacyTpSplit::GateUp);
  // A critic's value head [1, H] is on every rank whole.
  EXPECT_EQ(legacy_tp_split("output_layer.weight", {1, 8}, 2, 0), LegacyTpSplit::Replicated);
}

TEST(MegatronLegacyTp, AParameterNoRuleCoversIsAnErrorWithSeveralTpRanks) {
  for (const char* name : {"decoder.layers.0.self_attention.linear_q_down_proj.weight", "weight", "decoder.layers.0.mlp.linear_fc1"}) {
    try {
      legacy_tp_split(name, {8, 8}, 2, 0);
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no rule for how"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
    EXPECT_EQ(legacy_tp_split(name, {8, 8}, 1, 0), LegacyTpSplit::Replicated) << name;
  }
}

TEST(MegatronLegacy, RowParallelBiasesAreOneCopy) {
  // Every TP rank holds the whole bias of linear_proj and linear_fc2: concatenating the copies
  // wrote a bias tp times too long.
  test::TempDir root;
  const Tensors rank = {{"decoder.layers.0.self_attention.linear_proj.weight", {4, 2}},
                        {"decoder.layers.0.self_attention.linear_proj.bias", {4}},
                        {"decoder.layers.0.mlp.linear_fc2.bias", {4}}};
  const SourceSet set =
      describe_megatron_legacy(legacy_role(root, {{"mp_rank_00", rank}, {"mp_rank_01", rank}}), nlohmann::ordered_json::object());
  ASSERT_EQ(set.tensors.size(), 3u);
  for (const SourceTensor& t : set.tensors) {
    if (t.name.find(".bias") == std::string::npos) continue;
    EXPECT_EQ(t.shape, (std::vector<int64_t>{4})) << t.name;
    ASSERT_EQ(t.pieces.size(), 1u) << t.name;
  }
}

}  // namespace
}  // namespace shardmerge::layouts
