// Sharding arithmetic: torch.chunk splits, DTensor placements, strided views, tiling checks.
#include <gtest/gtest.h>

#include <limits>

#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"
#include "util/shape.hpp"

namespace shardmerge {
namespace {

std::vector<int64_t> sizes_of_chunks(int64_t length, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 0; k < n; ++k) out.push_back(runs_length(chunk_runs({{0, length}}, n, k)));
  return out;
}

// Flattens runs into the list of global indices they name, in order.
std::vector<int64_t> indices(const Runs& runs) {
  std::vector<int64_t> out;
  for (const auto& r : runs)
    for (int64_t i = r.begin; i < r.end; ++i) out.push_back(i);
  return out;
}

Placement shard(int64_t dim) { return {PlacementKind::Shard, dim, 1, ""}; }
Placement strided(int64_t dim, int64_t sf) { return {PlacementKind::StridedShard, dim, sf, ""}; }
Placement replicate() { return {PlacementKind::Replicate, 0, 1, ""}; }

TEST(ShardingChunk, TorchChunkSemantics) {
  // torch.chunk: pieces of ceil(L/n); the last ones short or empty.
  EXPECT_EQ(sizes_of_chunks(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(sizes_of_chunks(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(sizes_of_chunks(251, 4), (std::vector<int64_t>{63, 63, 63, 62}));
  EXPECT_EQ(sizes_of_chunks(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(sizes_of_chunks(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(indices(chunk_runs({{0, 10}}, 4, 2)), (std::vector<int64_t>{6, 7, 8}));
}

TEST(ShardingChunk, ChunksAcrossRuns) {
  // A sequence made of two runs [0,2) and [5,9): positions 0..5.
  const Runs seq = {{0, 2}, {5, 9}};
  EXPECT_EQ(indices(chunk_runs(seq, 2, 0)), (std::vector<int64_t>{0, 1, 5}));
  EXPECT_EQ(indices(chunk_runs(seq, 2, 1)), (std::vector<int64_t>{6, 7, 8}));
}

TEST(ShardingDTensor, ShardOnOneMeshDim) {
  const auto runs = dtensor_local_runs({251, 32}, {shard(0)}, {4}, {3});
  EXPECT_EQ(indices(runs[0]).front(), 189);
  EXPECT_EQ(runs_length(runs[0]), 62);
  EXPECT_EQ(runs_length(runs[1]), 32);
}

TEST(ShardingDTensor, ReplicateThenShardIsHsdp) {
  for (int64_t replica = 0; replica < 2; ++replica) {
    const auto runs = dtensor_local_runs({10, 4}, {replicate(), shard(0)}, {2, 2}, {replica, 1});
    EXPECT_EQ(indices(runs[0]), (std::vector<int64_t>{5, 6, 7, 8, 9}));
  }
}

TEST(ShardingDTensor, StridedShardMatchesTorchDocstring) {
  // torch's _StridedShard docstring: 9 elements, split_factor 2, 4 chunks ->
  // [0,1,5], [2,3,6], [4,7], [8].
  const std::vector<std::vector<int64_t>> expected = {{0, 1, 5}, {2, 3, 6}, {4, 7}, {8}};
  for (int64_t c = 0; c < 4; ++c)
    EXPECT_EQ(indices(dtensor_local_runs({9}, {strided(0, 2)}, {4}, {c})[0]), expected[static_cast<size_t>(c)]);
}

TEST(ShardingDTensor, FsdpPlusTpRightToLeftOrder) {
  // 8 rows on a (dp=2, tp=2) mesh. [Shard(0), Shard(0)] is left to right: (0,1) -> rows 2-3.
  EXPECT_EQ(indices(dtensor_local_runs({8}, {shard(0), shard(0)}, {2, 2}, {0, 1})[0]), (std::vector<int64_t>{2, 3}));
  // [_StridedShard(0, sf=2), Shard(0)] is FSDP2+TP's right-to-left sharding: (0,1) -> rows 4-5,
  // (1,0) -> rows 2-3 (the table in torch's docstring).
  EXPECT_EQ(indices(dtensor_local_runs({8}, {strided(0, 2), shard(0)}, {2, 2}, {0, 1})[0]), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(indices(dtensor_local_runs({8}, {strided(0, 2), shard(0)}, {2, 2}, {1, 0})[0]), (std::vector<int64_t>{2, 3}));
}

TEST(ShardingDTensor, ExplicitShardOrderAppliesMeshDimsInThatOrder) {
  // Same placements, but mesh dim 1 shards first: (c0, c1) -> rows c1*4 + c0*2.
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> order = {{0, {1, 0}}};
  EXPECT_EQ(indices(dtensor_local_runs({8}, {shard(0), shard(0)}, {2, 2}, {1, 0}, order)[0]), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(indices(dtensor_local_runs({8}, {shard(0), shard(0)}, {2, 2}, {0, 1}, order)[0]), (std::vector<int64_t>{4, 5}));
  // The default order written out explicitly changes nothing.
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> natural = {{0, {0, 1}}};
  EXPECT_EQ(indices(dtensor_local_runs({8}, {shard(0), shard(0)}, {2, 2}, {0, 1}, natural)[0]), (std::vector<int64_t>{2, 3}));
  // An order that names other mesh dims than the placements is refused.
  EXPECT_THROW(dtensor_local_runs({8}, {shard(0), replicate()}, {2, 2}, {0, 0}, {{0, {1}}}), Error);
}

TEST(ShardingDTensor, PartialIsRefused) {
  Placement partial{PlacementKind::Partial, 0, 1, "sum"};
  try {
    dtensor_local_runs({4}, {partial}, {2}, {0});
    FAIL() << "Partial must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Partial"), std::string::npos);
  }
}

TEST(ShardingSlices, ViewToSlicesUsesStridesAndStorageOffset) {
  TensorView v;
  v.dtype = DType::F32;
  v.storage_offset = 3;
  v.size = {3, 4};
  v.stride = {4, 1};
  // The local view holds global rows {0, 1, 5} (a strided shard): two slices.
  const auto slices = view_to_slices(7, 1000, v, {{{0, 2}, {5, 6}}, {{0, 4}}});
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[0].file, 7u);
  EXPECT_EQ(slices[0].offset, 1000u + 3 * 4);
  EXPECT_EQ(slices[0].start, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(slices[0].extent, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(slices[1].offset, 1000u + (3 + 2 * 4) * 4);
  EXPECT_EQ(slices[1].start, (std::vector<int64_t>{5, 0}));
  EXPECT_EQ(slices[1].extent, (std::vector<int64_t>{1, 4}));
  // A local size that disagrees with its placement is an error, not a silent misplacement.
  EXPECT_THROW(view_to_slices(0, 0, v, {{{0, 2}}, {{0, 4}}}), Error);
}

TEST(ShardingSlices, EmptyLocalShardHasNoSlices) {
  TensorView v;
  v.size = {0, 32};
  v.stride = {32, 1};
  EXPECT_TRUE(view_to_slices(0, 0, v, {{}, {{0, 32}}}).empty());
}

Slice box(std::vector<int64_t> start, std::vector<int64_t> extent) {
  Slice s;
  s.start = std::move(start);
  s.extent = std::move(extent);
  s.strides.assign(s.extent.size(), 1);
  return s;
}

TEST(ShardingTiling, AcceptsExactTilingAndNamesProblems) {
  EXPECT_FALSE(check_tiling({4, 6}, {box({0, 0}, {4, 3}), box({0, 3}, {4, 3})}));
  auto overlap = check_tiling({4, 6}, {box({0, 0}, {4, 4}), box({0, 3}, {4, 3})});
  ASSERT_TRUE(overlap);
  EXPECT_EQ(overlap->kind, TilingProblem::Kind::Overlap);
  auto gap = check_tiling({4, 6}, {box({0, 0}, {4, 3}), box({0, 3}, {3, 3})});
  ASSERT_TRUE(gap);
  EXPECT_EQ(gap->kind, TilingProblem::Kind::Gap);
  auto outside = check_tiling({4, 6}, {box({0, 0}, {4, 3}), box({0, 4}, {4, 3})});
  ASSERT_TRUE(outside);
  EXPECT_EQ(outside->kind, TilingProblem::Kind::OutOfBounds);
  EXPECT_FALSE(check_tiling({}, {box({}, {})}));  // a 0-d tensor is one element
}

TEST(ShardingTiling, HugeShapesAndOffsetsCannotWrapAround) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // start + extent past int64: outside, not wrapped to a negative end inside the shape.
  auto far = check_tiling({4}, {box({0}, {2}), box({kMax}, {2})});
  ASSERT_TRUE(far);
  EXPECT_EQ(far->kind, TilingProblem::Kind::OutOfBounds);
  // A whole-tensor piece of 2^64 elements counted as 0 skipped the overlap sweep, and the two
  // halves alone cover 2^64: the file was accepted although every element came twice.
  const int64_t k31 = int64_t{1} << 31, k32 = int64_t{1} << 32;
  auto doubled = check_tiling({k32, k32}, {box({0, 0}, {k32, k32}), box({0, 0}, {k31, k32}), box({k31, 0}, {k31, k32})});
  ASSERT_TRUE(doubled);
  EXPECT_NE(doubled->message.find("more than 2^63 elements"), std::string::npos) << doubled->message;
  // Below the limit, an overlap of big pieces is found as one.
  auto overlap = check_tiling({k31, k31}, {box({0, 0}, {k31, k31}), box({0, 0}, {1, k31})});
  ASSERT_TRUE(overlap);
  EXPECT_EQ(overlap->kind, TilingProblem::Kind::Overlap);
  auto negative = check_tiling({-1, 4}, {});
  ASSERT_TRUE(negative);
  EXPECT_NE(negative->message.find("negative dimension"), std::string::npos);
}

TEST(ShardingTiling, ElementCountsAreChecked) {
  EXPECT_EQ(element_count({3, 0, int64_t{1} << 62, int64_t{1} << 62}), 0u);
  EXPECT_EQ(element_count({int64_t{1} << 32, (int64_t{1} << 32) - 1}), (uint64_t{1} << 32) * ((uint64_t{1} << 32) - 1));
  EXPECT_THROW(element_count({int64_t{1} << 32, int64_t{1} << 32}), Error);
  EXPECT_THROW(element_count({2, -1}), Error);
}

TEST(ShardingSlices, IntersectMovesTheOffset) {
  Slice s;
  s.dtype = DType::BF16;
  s.offset = 100;
  s.strides = {10, 1};
  s.start = {4, 0};
  s.extent = {6, 10};
  auto sub = intersect(s, {6, 2}, {2, 3});
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->offset, 100u + (2 * 10 + 2) * 2);
  EXPECT_EQ(sub->start, (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(sub->extent, (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(intersect(s, {0, 0}, {4, 10}));
}

}  // namespace
}  // namespace shardmerge
