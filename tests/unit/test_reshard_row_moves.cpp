// Reshard planning along dim 0: applying the planned row moves to source local tensors (whose
// rows hold their global row index) must give every target rank exactly its torch.chunk piece.
#include <gtest/gtest.h>

#include "geometry/sharding.hpp"
#include "reshard/row_moves.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::reshard {
namespace {

// The global rows each source rank holds, for a DTensor on `mesh` with `placements`.
std::vector<std::vector<Runs>> source_runs(const std::vector<int64_t>& shape, const std::vector<Placement>& placements,
                                           const std::vector<int64_t>& mesh) {
  std::vector<std::vector<Runs>> out;
  int64_t ranks = 1;
  for (int64_t m : mesh) ranks *= m;
  for (int64_t r = 0; r < ranks; ++r) {
    std::vector<int64_t> coord(mesh.size());
    int64_t rest = r;
    for (size_t d = mesh.size(); d-- > 0;) {
      coord[d] = rest % mesh[d];
      rest /= mesh[d];
    }
    out.push_back(dtensor_local_runs(shape, placements, mesh, coord));
  }
  return out;
}

// Applies the plan and checks target f's local rows are global rows [f*c, min(dim0, (f+1)*c)),
// c = ceil(dim0 / F), written by hand here rather than through chunk_runs.
void expect_targets(int64_t dim0, const std::vector<std::vector<Runs>>& sources, int64_t fsdp) {
  std::vector<std::vector<int64_t>> local(sources.size());
  for (size_t r = 0; r < sources.size(); ++r)
    for (const auto& run : sources[r][0])
      for (int64_t g = run.begin; g < run.end; ++g) local[r].push_back(g);
  const auto plan = plan_row_moves("t", {dim0, 3}, sources, fsdp);
  ASSERT_EQ(plan.size(), static_cast<size_t>(fsdp));
  const int64_t c = (dim0 + fsdp - 1) / fsdp;
  for (int64_t f = 0; f < fsdp; ++f) {
    const auto& t = plan[static_cast<size_t>(f)];
    const int64_t lo = std::min(dim0, f * c), hi = std::min(dim0, (f + 1) * c);
    EXPECT_EQ(t.rows, hi - lo) << "target " << f;
    EXPECT_EQ(t.padded_rows, c);
    std::vector<int64_t> got(static_cast<size_t>(t.rows), -1);
    for (const auto& m : t.moves)
      for (int64_t i = 0; i < m.rows; ++i) {
        ASSERT_EQ(got.at(static_cast<size_t>(m.target_row + i)), -1) << "row written twice";
        got[static_cast<size_t>(m.target_row + i)] = local.at(static_cast<size_t>(m.source)).at(static_cast<size_t>(m.source_row + i));
      }
    for (int64_t i = 0; i < t.rows; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], lo + i) << "target " << f << " row " << i;
  }
}

Placement placement(PlacementKind kind, int64_t dim = 0, int64_t split_factor = 1) {
  Placement p;
  p.kind = kind;
  p.dim = dim;
  p.split_factor = split_factor;
  return p;
}
const Placement shard0 = placement(PlacementKind::Shard);
const Placement replicate = placement(PlacementKind::Replicate);

TEST(ReshardRowMoves, FourToTwo) { expect_targets(10, source_runs({10, 3}, {shard0}, {4}), 2); }
TEST(ReshardRowMoves, TwoToFour) { expect_targets(10, source_runs({10, 3}, {shard0}, {2}), 4); }
TEST(ReshardRowMoves, EightToThreeUneven) {
  for (int64_t dim0 : {1, 5, 7, 9, 24, 25}) expect_targets(dim0, source_runs({dim0, 3}, {shard0}, {8}), 3);
}
TEST(ReshardRowMoves, EmptyTensor) { expect_targets(0, source_runs({0, 3}, {shard0}, {4}), 3); }
TEST(ReshardRowMoves, HsdpSourceReadsOneReplica) {
  const auto sources = source_runs({9, 3}, {replicate, shard0}, {2, 2});
  expect_targets(9, sources, 4);
  for (const auto& t : plan_row_moves("t", {9, 3}, sources, 4))
    for (const auto& m : t.moves) EXPECT_LT(m.source, 2) << "the first ddp replica (ranks 0, 1) holds every row";
}
TEST(ReshardRowMoves, StridedShardSource) {
  expect_targets(12, source_runs({12, 3}, {placement(PlacementKind::StridedShard, 0, 2), shard0}, {2, 2}), 3);
}
TEST(ReshardRowMoves, RefusesOtherDimSharding) {
  EXPECT_THROW(plan_row_moves("t", {4, 6}, source_runs({4, 6}, {placement(PlacementKind::Shard, 1)}, {2}), 2), Error);
}
TEST(ReshardRowMoves, RefusesMissingRows) {
  auto sources = source_runs({8, 3}, {shard0}, {4});
  sources.pop_back();
  EXPECT_THROW(plan_row_moves("t", {8, 3}, sources, 2), Error);
}

}  // namespace
}  // namespace shardmerge::reshard
