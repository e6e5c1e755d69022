// SourceSets built from per-file summaries alone (src/layouts/summaries.hpp and the combine_*
// functions of src/plan/combine_*.cpp): no file exists anywhere. The expected
// slices are written out by hand from the placement semantics (torch.chunk, _StridedShard,
// ShardedTensor offsets, DCP chunk boxes, Megatron TP rules), not computed by the code.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layouts/fsdp.hpp"
#include "plan/combine.hpp"
#include "layouts/names.hpp"
#include "layouts/summaries.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::layouts {
namespace {

constexpr DType F32 = DType::F32;
constexpr DType BF16 = DType::BF16;

FileStamp stamp(uint64_t size) { return {size, 1000 + static_cast<int64_t>(size), 7, size * 3, 2049}; }

// A dense view of storage `key` (its record holds exactly the view).
TensorView dense(DType dtype, std::vector<int64_t> size, const std::string& key = "0") {
  TensorView v;
  v.dtype = dtype;
  v.storage_key = key;
  v.size = std::move(size);
  v.stride.assign(v.size.size(), 1);
  for (size_t d = v.size.size(); d-- > 1;) v.stride[d - 1] = v.stride[d] * v.size[d];
  v.storage_nbytes = v.numel() * dtype_size(dtype);
  return v;
}

DTensorValue dtensor(std::vector<int64_t> global, TensorView local, std::vector<int64_t> mesh,
                     std::vector<Placement> placements, std::vector<std::string> dim_names = {}) {
  DTensorValue d;
  d.global_size = std::move(global);
  d.local = std::move(local);
  d.mesh.shape = std::move(mesh);
  d.mesh.dim_names = std::move(dim_names);
  d.placements = std::move(placements);
  return d;
}

Placement shard(int64_t dim) { return {PlacementKind::Shard, dim, 1, ""}; }
Placement strided_shard(int64_t dim, int64_t sf) { return {PlacementKind::StridedShard, dim, sf, ""}; }
Placement replicate() { return {PlacementKind::Replicate, 0, 1, ""}; }

// A torch.save file summary whose storage `key` sits at `data_offset`.
TorchFileSummary torch_file(const std::string& path, uint64_t size, std::vector<StateEntry> entries,
                            std::map<std::string, ZipEntry> records) {
  return {path, stamp(size), std::move(entries), std::move(records)};
}

ZipEntry record(const std::string& key, uint64_t offset, uint64_t size, uint32_t crc) {
  return {"archive/data/" + key, offset, size, crc};
}

FsdpRole fsdp_role(int64_t world_size, const std::vector<int64_t>& missing = {}) {
  FsdpRole role;
  role.path = "/ckpt/actor";
  role.world_size = world_size;
  role.fsdp_version = 2;
  for (int64_t r = 0; r < world_size; ++r) {
    const bool gone = std::find(missing.begin(), missing.end(), r) != missing.end();
    role.rank_files.push_back(gone ? "" : role.path + "/" + rank_file_name("model", world_size, r));
  }
  role.missing_ranks = missing;
  return role;
}

// Rank r holds `local` of tensor "w" at byte 4096 * (r + 1) of its file.
RankFileSummary rank(const FsdpRole& role, int64_t r, StateEntry entry) {
  auto view_of = [](const StateEntry& e) -> const TensorView& {
    if (const auto* d = std::get_if<DTensorValue>(&e.value)) return d->local;
    if (const auto* s = std::get_if<ShardedTensorValue>(&e.value)) return s->local_shards.front().view;
    return std::get<TensorView>(e.value);
  };
  const TensorView v = view_of(entry);
  const uint64_t at = 4096 * static_cast<uint64_t>(r + 1);
  return {r, torch_file(role.rank_files[static_cast<size_t>(r)], 1 << 20, {std::move(entry)},
                        {{v.storage_key, record(v.storage_key, at, v.storage_nbytes, 100 + static_cast<uint32_t>(r))}})};
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

// ---- FSDP -------------------------------------------------------------------------------

// FSDP2 Shard(0) of a [10, 4] tensor over 4 ranks: torch.chunk gives rows 3, 3, 3, 1.
TEST(CombineFsdp, Fsdp2ShardZeroOverFourRanks) {
  const FsdpRole role = fsdp_role(4);
  const int64_t rows[] = {3, 3, 3, 1};
  std::vector<RankFileSummary> ranks;
  for (int64_t r = 0; r < 4; ++r)
    ranks.push_back(rank(role, r, {"w", dtensor({10, 4}, dense(F32, {rows[r], 4}), {4}, {shard(0)}, {"fsdp"})}));
  const SourceSet set = combine_fsdp(role, ranks);

  ASSERT_EQ(set.files.size(), 4u);
  for (size_t r = 0; r < 4; ++r) {
    EXPECT_EQ(set.files[r].path, role.rank_files[r]);
    EXPECT_EQ(set.files[r].size, 1u << 20);
    EXPECT_EQ(set.files[r].planned, stamp(1 << 20));
    EXPECT_FALSE(set.files[r].compressed);
  }
  ASSERT_EQ(set.tensors.size(), 1u);
  const SourceTensor& t = set.tensors[0];
  EXPECT_EQ(t.shape, (std::vector<int64_t>{10, 4}));
  EXPECT_EQ(t.origin, "DTensor [Shard(0)] on mesh (fsdp=4)");
  const std::vector<Slice> expected = {{0, 4096, F32, {4, 1}, {0, 0}, {3, 4}},
                                       {1, 8192, F32, {4, 1}, {3, 0}, {3, 4}},
                                       {2, 12288, F32, {4, 1}, {6, 0}, {3, 4}},
                                       {3, 16384, F32, {4, 1}, {9, 0}, {1, 4}}};
  EXPECT_EQ(t.pieces, expected);
  ASSERT_EQ(set.records.size(), 4u);
  EXPECT_EQ(set.records[3], (RecordCheck{3, 16384, 16, 103, "archive/data/0", "w"}));
  EXPECT_TRUE(set.notes.empty());
}

TEST(CombineFsdp, Fsdp2ShardZeroOverTwoAndThreeRanks) {
  // [5, 2] over 2 ranks: rows 3 + 2; over 3 ranks: rows 2 + 2 + 1.
  for (const auto& rows : {std::vector<int64_t>{3, 2}, std::vector<int64_t>{2, 2, 1}}) {
    const auto w = static_cast<int64_t>(rows.size());
    const FsdpRole role = fsdp_role(w);
    std::vector<RankFileSummary> ranks;
    for (int64_t r = 0; r < w; ++r)
      ranks.push_back(rank(role, r, {"w", dtensor({5, 2}, dense(BF16, {rows[r], 2}), {w}, {shard(0)})}));
    const SourceSet set = combine_fsdp(role, ranks);
    std::vector<Slice> expected;
    int64_t at = 0;
    for (int64_t r = 0; r < w; ++r) {
      expected.push_back({static_cast<uint32_t>(r), 4096 * static_cast<uint64_t>(r + 1), BF16, {2, 1}, {at, 0}, {rows[r], 2}});
      at += rows[r];
    }
    EXPECT_EQ(set.tensors.at(0).pieces, expected) << "world size " << w;
  }
}

// HSDP: mesh (replicate=2, shard=2), [Replicate(), Shard(0)]. Rank r sits at (r / 2, r % 2):
// ranks 0 and 2 hold rows [0, 3), ranks 1 and 3 rows [3, 6). The lowest rank's copy is read.
TEST(CombineFsdp, HsdpReplicasAreReadOnce) {
  const FsdpRole role = fsdp_role(4);
  std::vector<RankFileSummary> ranks;
  for (int64_t r = 0; r < 4; ++r)
    ranks.push_back(rank(role, r, {"w", dtensor({6, 2}, dense(F32, {3, 2}), {2, 2}, {replicate(), shard(0)},
                                                 {"dp_replicate", "dp_shard"})}));
  const SourceSet set = combine_fsdp(role, ranks);
  const std::vector<Slice> expected = {{0, 4096, F32, {2, 1}, {0, 0}, {3, 2}}, {1, 8192, F32, {2, 1}, {3, 0}, {3, 2}}};
  EXPECT_EQ(set.tensors.at(0).pieces, expected);
  EXPECT_EQ(set.files.size(), 4u);
  EXPECT_NE(set.description.find("mesh=(dp_replicate=2, dp_shard=2)"), std::string::npos) << set.description;
}

// Rank 0 gone: its rows are rank 2's too, which is read instead, and a note says so.
TEST(CombineFsdp, AMissingRankWithReplicasIsANote) {
  const FsdpRole role = fsdp_role(4, {0});
  std::vector<RankFileSummary> ranks;
  for (int64_t r = 1; r < 4; ++r)
    ranks.push_back(rank(role, r, {"w", dtensor({6, 2}, dense(F32, {3, 2}), {2, 2}, {replicate(), shard(0)})}));
  const SourceSet set = combine_fsdp(role, ranks);
  ASSERT_EQ(set.files.size(), 3u);
  EXPECT_EQ(set.files[1].path, role.rank_files[2]);
  // files: rank 1 -> 0, rank 2 -> 1, rank 3 -> 2
  const std::vector<Slice> expected = {{0, 8192, F32, {2, 1}, {3, 0}, {3, 2}}, {1, 12288, F32, {2, 1}, {0, 0}, {3, 2}}};
  EXPECT_EQ(set.tensors.at(0).pieces, expected);
  ASSERT_EQ(set.notes.size(), 1u);
  EXPECT_EQ(set.notes[0], "rank files missing but not needed (their data has replicas): model_world_size_4_rank_0.pt");
}

TEST(CombineFsdp, AMissingRankWithoutReplicasNamesTheTensorAndTheFile) {
  const FsdpRole role = fsdp_role(2, {1});
  const std::vector<RankFileSummary> ranks = {
      rank(role, 0, {"model.embed_tokens.weight", dtensor({4, 2}, dense(F32, {2, 2}), {2}, {shard(0)})})};
  const std::string msg = error_of([&] { combine_fsdp(role, ranks); });
  EXPECT_NE(msg.find("model.embed_tokens.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing rank files: model_world_size_2_rank_1.pt"), std::string::npos) << msg;
}

// FSDP2 over TP: mesh (dp=2, tp=2), [_StridedShard(0, sf=2), Shard(0)] on an [8, 2] tensor.
// TP splits rows [0, 4) | [4, 8), FSDP splits each half again: (dp, tp) = (0, 0) -> [0, 2),
// (1, 0) -> [2, 4), (0, 1) -> [4, 6), (1, 1) -> [6, 8); rank = 2 * dp + tp.
TEST(CombineFsdp, StridedShardUnderTensorParallel) {
  const FsdpRole role = fsdp_role(4);
  std::vector<RankFileSummary> ranks;
  for (int64_t r = 0; r < 4; ++r)
    ranks.push_back(rank(role, r, {"w", dtensor({8, 2}, dense(F32, {2, 2}), {2, 2}, {strided_shard(0, 2), shard(0)})}));
  const SourceSet set = combine_fsdp(role, ranks);
  const std::vector<Slice> expected = {{0, 4096, F32, {2, 1}, {0, 0}, {2, 2}},
                                       {1, 8192, F32, {2, 1}, {4, 0}, {2, 2}},
                                       {2, 12288, F32, {2, 1}, {2, 0}, {2, 2}},
                                       {3, 16384, F32, {2, 1}, {6, 0}, {2, 2}}};
  EXPECT_EQ(set.tensors.at(0).pieces, expected);
}

// _StridedShard(0, sf=2) alone on mesh (2): rows split [0, 4) | [4, 8), each chunked in two;
// rank 0 holds rows 0-1 and 4-5 (two runs of its local view), rank 1 rows 2-3 and 6-7.
TEST(CombineFsdp, StridedShardSplitsALocalViewIntoRuns) {
  const FsdpRole role = fsdp_role(2);
  std::vector<RankFileSummary> ranks;
  for (int64_t r = 0; r < 2; ++r)
    ranks.push_back(rank(role, r, {"w", dtensor({8, 3}, dense(F32, {4, 3}), {2}, {strided_shard(0, 2)})}));
  const SourceSet set = combine_fsdp(role, ranks);
  // Local rows 2-3 start 2 * 3 * 4 = 24 bytes into the storage.
  const std::vector<Slice> expected = {{0, 4096, F32, {3, 1}, {0, 0}, {2, 3}},
                                       {0, 4096 + 24, F32, {3, 1}, {4, 0}, {2, 3}},
                                       {1, 8192, F32, {3, 1}, {2, 0}, {2, 3}},
                                       {1, 8192 + 24, F32, {3, 1}, {6, 0}, {2, 3}}};
  std::vector<Slice> got = set.tensors.at(0).pieces;
  EXPECT_EQ(got, expected);
}

// FSDP1 SHARDED_STATE_DICT: ShardedTensor local shards at their own offsets.
TEST(CombineFsdp, ShardedTensorOffsets) {
  FsdpRole role = fsdp_role(2);
  role.fsdp_version = 1;
  auto entry = [](std::vector<int64_t> offsets, int64_t rows) {
    ShardedTensorValue st;
    st.global_size = {5, 3};
    st.dtype = BF16;
    st.local_shards.push_back({offsets, dense(BF16, {rows, 3})});
    st.all_shards = {{{0, 0}, {3, 3}, "rank:0/cpu"}, {{3, 0}, {2, 3}, "rank:1/cpu"}};
    return StateEntry{"w", st};
  };
  const SourceSet set = combine_fsdp(role, {rank(role, 0, entry({0, 0}, 3)), rank(role, 1, entry({3, 0}, 2))});
  const std::vector<Slice> expected = {{0, 4096, BF16, {3, 1}, {0, 0}, {3, 3}}, {1, 8192, BF16, {3, 1}, {3, 0}, {2, 3}}};
  EXPECT_EQ(set.tensors.at(0).pieces, expected);
  EXPECT_EQ(set.tensors.at(0).origin, "ShardedTensor, 2 shards");
}

// A plain tensor on every rank is a replica: rank 0's copy, and a note.
TEST(CombineFsdp, PlainTensorsAreReplicas) {
  const FsdpRole role = fsdp_role(2);
  const SourceSet set =
      combine_fsdp(role, {rank(role, 0, {"rotary.inv_freq", dense(F32, {4})}), rank(role, 1, {"rotary.inv_freq", dense(F32, {4})})});
  const std::vector<Slice> expected = {{0, 4096, F32, {1}, {0}, {4}}};
  EXPECT_EQ(set.tensors.at(0).pieces, expected);
  EXPECT_EQ(set.tensors.at(0).origin, "replicated (plain tensor on every rank)");
  ASSERT_EQ(set.notes.size(), 1u);
  EXPECT_NE(set.notes[0].find("1 plain tensor(s) are replicated on every rank"), std::string::npos);
}

// ---- Megatron dist_ckpt ------------------------------------------------------------------

// decoder.w [2, 6] bf16 in two [1, 6] chunks: one stored in __0_0.distcp, one a zstd item of
// __1_0.distcp; plus an optimizer state that is skipped.
DcpSummary two_chunk_dcp(std::vector<std::string> second_transforms) {
  DcpSummary s;
  s.metadata.dir = "/ckpt/actor/dist_ckpt";
  DcpTensor t{"decoder.w", BF16, {2, 6}, {}};
  t.chunks.push_back({{0, 0}, {1, 6}, "__0_0.distcp", 100, 900, {}});
  t.chunks.push_back({{1, 0}, {1, 6}, "__1_0.distcp", 40, 50, std::move(second_transforms)});
  s.metadata.tensors.push_back(t);
  s.metadata.tensors.push_back({"optimizer.state.exp_avg.decoder.w", DType::F32, {2, 6}, {}});
  s.metadata.bytes_items = {"rng_state"};
  s.data_files = {{"__0_0.distcp", stamp(2000)}, {"__1_0.distcp", stamp(100)}};
  s.stored_items[{"__0_0.distcp", 100}] = {dense(BF16, {1, 6}), record("0", 612, 12, 0xabc)};
  // Decoded, the second item's storage record holds 8 bf16 elements from byte 704; the chunk
  // starts at element 2. Its CRC-32 is in a data descriptor past the decoded head, at 724.
  TensorView packed = dense(BF16, {1, 6});
  packed.storage_offset = 2;
  packed.storage_nbytes = 16;
  s.compressed_items[{"__1_0.distcp", 40}] = {packed, record("0", 704, 16, 0), 724};
  return s;
}

TEST(CombineMegatronDist, ACompressedItemIsASourceOfItsOwnAddressingItsDecodedArchive) {
  const SourceSet set = combine_dcp(two_chunk_dcp({"stream.zstd/1"}));
  ASSERT_EQ(set.files.size(), 2u);
  EXPECT_EQ(set.files[0].path, "/ckpt/actor/dist_ckpt/__0_0.distcp");
  EXPECT_EQ(set.files[0].size, 2000u);
  EXPECT_FALSE(set.files[0].compressed);
  EXPECT_EQ(set.files[1].path, "/ckpt/actor/dist_ckpt/__1_0.distcp");
  EXPECT_EQ(set.files[1].size, 100u);
  EXPECT_EQ(set.files[1].planned, stamp(100));
  // The executor needs the decoded bytes up to the end of the storage record's CRC-32: 724 + 4.
  EXPECT_EQ(set.files[1].compressed, (CompressedItem{"zstd", 40, 50, 728}));
  ASSERT_EQ(set.tensors.size(), 1u);
  const std::vector<Slice> expected = {{0, 612, BF16, {6, 1}, {0, 0}, {1, 6}}, {1, 708, BF16, {6, 1}, {1, 0}, {1, 6}}};
  EXPECT_EQ(set.tensors[0].pieces, expected);
  ASSERT_EQ(set.records.size(), 2u);  // the compressed one's CRC-32 is read when decoded
  EXPECT_EQ(set.records[0], (RecordCheck{0, 612, 12, 0xabc, "archive/data/0", "decoder.w"}));
  EXPECT_EQ(set.records[1], (RecordCheck{1, 704, 16, 0, "archive/data/0", "decoder.w", 724}));
  for (const SourceFile& f : set.files) EXPECT_EQ(f.path.find("scratch"), std::string::npos) << f.path;
  EXPECT_EQ(set.notes, (std::vector<std::string>{"1 optimizer/scheduler/rng tensors in the tree are ignored",
                                                 "1 non-tensor items (extra states, rng) are ignored"}));
}

TEST(CombineMegatronDist, ACompressedItemWhoseHeadGivesItsStorageCrcNeedsOnlyTheStorageDecoded) {
  DcpSummary s = two_chunk_dcp({"stream.zstd/1"});
  auto& item = s.compressed_items.at({"__1_0.distcp", 40});
  item.record.crc32 = 0xdef;
  item.crc32_at.reset();
  const SourceSet set = combine_dcp(s);
  EXPECT_EQ(set.files[1].compressed, (CompressedItem{"zstd", 40, 50, 720}));
  ASSERT_EQ(set.records.size(), 2u);
  EXPECT_EQ(set.records[1], (RecordCheck{1, 704, 16, 0xdef, "archive/data/0", "decoder.w"}));
}

TEST(CombineMegatronDist, UnknownTransformsAndItemsPastTheFileAreRefused) {
  std::string msg = error_of([] { combine_dcp(two_chunk_dcp({"stream.lz4/1"})); });
  EXPECT_NE(msg.find("storage transform 'stream.lz4/1'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("decoder.w"), std::string::npos) << msg;
  DcpSummary s = two_chunk_dcp({"stream.zstd/1"});
  s.data_files["__1_0.distcp"].size = 89;  // the item is [40, 90)
  msg = error_of([&] { combine_dcp(s); });
  EXPECT_NE(msg.find("runs past the end of the file"), std::string::npos) << msg;
  EXPECT_NE(msg.find("__1_0.distcp"), std::string::npos) << msg;
}

// ---- Megatron legacy mp_rank files -------------------------------------------------------

// TP=2: QKV column-parallel (dim 0), linear_proj row-parallel (dim 1), fc1 [gate_r; up_r],
// the final norm replicated (rank 0's copy).
TEST(CombineMegatronLegacy, TensorParallelShardsAreReassembled) {
  MegatronRole role;
  role.path = "/ckpt/actor";
  role.layout = "legacy mp_rank";
  role.mp_rank_dirs = {"/ckpt/actor/model/mp_rank_00", "/ckpt/actor/model/mp_rank_01"};
  std::vector<TorchFileSummary> files;
  for (int r = 0; r < 2; ++r) {
    std::vector<StateEntry> entries = {{"decoder.layers.0.self_attention.linear_qkv.weight", dense(F32, {6, 4}, "q")},
                                       {"decoder.layers.0.self_attention.linear_proj.weight", dense(F32, {4, 3}, "p")},
                                       {"decoder.layers.0.mlp.linear_fc1.weight", dense(F32, {4, 4}, "f")},
                                       {"decoder.final_layernorm.weight", dense(F32, {4}, "n")}};
    const uint64_t base = 10000 * static_cast<uint64_t>(r + 1);
    files.push_back(torch_file(role.mp_rank_dirs[static_cast<size_t>(r)] + "/model.pt", 1 << 16, entries,
                               {{"q", record("q", base, 96, 1)},
                                {"p", record("p", base + 1000, 48, 2)},
                                {"f", record("f", base + 2000, 64, 3)},
                                {"n", record("n", base + 3000, 16, 4)}}));
  }
  const SourceSet set = combine_megatron_legacy(role, nlohmann::ordered_json::object(), files);
  ASSERT_EQ(set.files.size(), 2u);
  EXPECT_EQ(set.files[1].path, "/ckpt/actor/model/mp_rank_01/model.pt");
  std::map<std::string, const SourceTensor*> by_name;
  for (const SourceTensor& t : set.tensors) by_name[t.name] = &t;
  ASSERT_EQ(by_name.size(), 4u);

  const SourceTensor& qkv = *by_name.at("decoder.layers.0.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{12, 4}));
  EXPECT_EQ(qkv.pieces, (std::vector<Slice>{{0, 10000, F32, {4, 1}, {0, 0}, {6, 4}}, {1, 20000, F32, {4, 1}, {6, 0}, {6, 4}}}));

  const SourceTensor& proj = *by_name.at("decoder.layers.0.self_attention.linear_proj.weight");
  EXPECT_EQ(proj.shape, (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(proj.pieces, (std::vector<Slice>{{0, 11000, F32, {3, 1}, {0, 0}, {4, 3}}, {1, 21000, F32, {3, 1}, {0, 3}, {4, 3}}}));

  // fc1: rank r's rows 0-1 are gate rows [2r, 2r + 2), its rows 2-3 up rows [4 + 2r, 6 + 2r);
  // local row 2 is 2 * 4 * 4 = 32 bytes into the storage.
  const SourceTensor& fc1 = *by_name.at("decoder.layers.0.mlp.linear_fc1.weight");
  EXPECT_EQ(fc1.shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(fc1.pieces, (std::vector<Slice>{{0, 12000, F32, {4, 1}, {0, 0}, {2, 4}},
                                            {0, 12032, F32, {4, 1}, {4, 0}, {2, 4}},
                                            {1, 22000, F32, {4, 1}, {2, 0}, {2, 4}},
                                            {1, 22032, F32, {4, 1}, {6, 0}, {2, 4}}}));

  const SourceTensor& norm = *by_name.at("decoder.final_layernorm.weight");
  EXPECT_EQ(norm.pieces, (std::vector<Slice>{{0, 13000, F32, {1}, {0}, {4}}}));
  EXPECT_EQ(set.records.size(), 8u);
}

// ---- HF weights and PEFT adapters --------------------------------------------------------

TEST(CombineHf, TheIndexDecidesWhichFileHoldsAName) {
  HfWeightsSummary w;
  w.dir = "/base";
  w.files.push_back({"/base/model-00001-of-00002.safetensors", stamp(500), {{"a", BF16, {2, 3}, 80, 12}}});
  // A stale shard still holds a copy of "a"; the index puts "a" in file 0.
  w.files.push_back({"/base/model-00002-of-00002.safetensors", stamp(600),
                     {{"a", BF16, {2, 3}, 96, 12}, {"b", F32, {3}, 108, 12}}});
  w.file_of = {{"a", 0}, {"b", 1}};
  const SourceSet set = combine_hf_weights(w);
  ASSERT_EQ(set.files.size(), 2u);
  EXPECT_EQ(set.files[1].planned, stamp(600));
  ASSERT_EQ(set.tensors.size(), 2u);
  EXPECT_EQ(set.tensors[0].name, "a");
  EXPECT_EQ(set.tensors[0].pieces, (std::vector<Slice>{{0, 80, BF16, {3, 1}, {0, 0}, {2, 3}}}));
  EXPECT_EQ(set.tensors[1].name, "b");
  EXPECT_EQ(set.tensors[1].pieces, (std::vector<Slice>{{1, 108, F32, {1}, {0}, {3}}}));
}

TEST(CombineAdapter, SafetensorsAndTorchBinAdapters) {
  AdapterSummary st;
  st.dir = "/adapter";
  st.config_path = "/adapter/adapter_config.json";
  st.config = {{"r", 8}, {"lora_alpha", 16}};
  st.weights = SafetensorsSummary{"/adapter/adapter_model.safetensors", stamp(300),
                                  {{"base_model.model.q.lora_A.weight", F32, {8, 4}, 64, 128}}};
  AdapterSources a = combine_adapter(st);
  EXPECT_EQ(a.config, st.config);
  EXPECT_EQ(a.config_path, "/adapter/adapter_config.json");
  EXPECT_EQ(a.tensors.tensors.at(0).pieces, (std::vector<Slice>{{0, 64, F32, {4, 1}, {0, 0}, {8, 4}}}));
  EXPECT_TRUE(a.tensors.records.empty());

  AdapterSummary bin = st;
  bin.weights = torch_file("/adapter/adapter_model.bin", 4000, {{"base_model.model.q.lora_B.weight", dense(F32, {4, 8}, "3")}},
                           {{"3", record("3", 1536, 128, 9)}});
  a = combine_adapter(bin);
  EXPECT_EQ(a.tensors.files.at(0).path, "/adapter/adapter_model.bin");
  EXPECT_EQ(a.tensors.tensors.at(0).pieces, (std::vector<Slice>{{0, 1536, F32, {8, 1}, {0, 0}, {4, 8}}}));
  EXPECT_EQ(a.tensors.records, (std::vector<RecordCheck>{{0, 1536, 128, 9, "archive/data/3", "base_model.model.q.lora_B.weight"}}));

  bin.weights = torch_file("/adapter/adapter_model.bin", 4000,
                           {{"x", dtensor({4}, dense(F32, {2}), {2}, {shard(0)})}}, {{"0", record("0", 64, 8, 1)}});
  const std::string msg = error_of([&] { combine_adapter(bin); });
  EXPECT_NE(msg.find("adapter tensors must be plain tensors"), std::string::npos) << msg;
}

}  // namespace
}  // namespace shardmerge::layouts
