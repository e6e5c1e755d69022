// Reshard's pure rules (reshard/target.hpp), with expectations worked out by hand, and the
// pickle opcodes reshard adds to the writer (bytes as Python's pickle module writes them).
#include <gtest/gtest.h>

#include "formats/pickle.hpp"
#include "formats/pickle_writer.hpp"
#include "reshard/target.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::reshard {
namespace {

TEST(ReshardTarget, OneDimensionalMeshByDefault) {
  const TargetMesh m = parse_target_mesh("", 3);
  EXPECT_EQ(m.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(m.dim_names, (std::vector<std::string>{"fsdp"}));
  ASSERT_EQ(m.placements().size(), 1u);
  EXPECT_EQ(m.placements()[0].to_string(), "Shard(0)");
  EXPECT_EQ(m.fsdp_index(2), 2);
  EXPECT_EQ(m.group_names(2), (std::vector<std::string>{"0"}));
}

TEST(ReshardTarget, HsdpMesh) {
  const TargetMesh m = parse_target_mesh("ddp=2,fsdp=3", 6);
  EXPECT_EQ(m.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m.dim_names, (std::vector<std::string>{"ddp", "fsdp"}));
  EXPECT_EQ(m.placements()[0].to_string(), "Replicate()");
  EXPECT_EQ(m.placements()[1].to_string(), "Shard(0)");
  // Ranks are row-major over (ddp, fsdp): rank 4 is ddp 1, fsdp 1.
  EXPECT_EQ(m.fsdp_index(4), 1);
  EXPECT_EQ(m.fsdp_index(3), 0);
  EXPECT_EQ(parse_target_mesh("fsdp=3,ddp=2", 6).shape, (std::vector<int64_t>{2, 3}));
  // Groups "1".."3" run along ddp (one per fsdp index), "4", "5" along fsdp (one per ddp index).
  EXPECT_EQ(m.group_names(0), (std::vector<std::string>{"1", "4"}));
  EXPECT_EQ(m.group_names(4), (std::vector<std::string>{"2", "5"}));
  // The real HSDP 2x2 fixture's rank 3 pickles ['2', '4'].
  EXPECT_EQ(parse_target_mesh("ddp=2,fsdp=2", 4).group_names(3), (std::vector<std::string>{"2", "4"}));
}

TEST(ReshardTarget, BadMeshesAreUsageErrors) {
  for (const char* bad : {"ddp=2", "ddp=2,fsdp=2", "ddp=0,fsdp=6", "tp=2,fsdp=3", "ddp=2,fsdp=3,", "ddp=2,ddp=3", "ddp=x,fsdp=3"}) {
    try {
      parse_target_mesh(bad, 6);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), ExitCode::usage) << bad;
    }
  }
  EXPECT_THROW(parse_target_mesh("", 0), Error);
}

TEST(ReshardTarget, ExtraStateComesFromRankModuloSourceWorld) {
  EXPECT_EQ(extra_state_source(0, 4), 0);
  EXPECT_EQ(extra_state_source(3, 4), 3);
  EXPECT_EQ(extra_state_source(5, 4), 1);
  EXPECT_EQ(extra_state_source(2, 2), 0);
}

DTensorValue shard(int64_t rows, int64_t cols, int64_t world, int64_t local_rows, uint64_t storage_elems) {
  DTensorValue d;
  d.global_size = {rows, cols};
  d.mesh.shape = {world};
  d.placements.resize(1);
  d.placements[0].kind = PlacementKind::Shard;
  d.local.size = {local_rows, cols};
  d.local.stride = {cols, 1};
  d.local.storage_nbytes = storage_elems * 4;
  return d;
}

TEST(ReshardTarget, PaddingFollowsTheSource) {
  // 10 rows on 4 ranks: chunks of 3, the last rank holds 1 row.
  EXPECT_TRUE(padded_storage({shard(10, 2, 4, 3, 6), shard(10, 2, 4, 1, 6)}, false)) << "short rank stores 3 rows";
  EXPECT_FALSE(padded_storage({shard(10, 2, 4, 3, 6), shard(10, 2, 4, 1, 2)}, true)) << "short rank stores its 1 row";
  EXPECT_TRUE(padded_storage({shard(10, 2, 4, 0, 6)}, false)) << "an empty rank with a 3-row storage";
  // 8 rows on 4 ranks: every rank full, so the source shows nothing either way.
  EXPECT_TRUE(padded_storage({shard(8, 2, 4, 2, 4)}, true));
  EXPECT_FALSE(padded_storage({shard(8, 2, 4, 2, 4)}, false));
}

TEST(ReshardTarget, RefusesModelParallelMeshes) {
  DTensorValue d = shard(8, 2, 4, 2, 4);
  d.mesh.dim_names = {"fsdp"};
  EXPECT_NO_THROW(check_source_mesh("t", d));
  d.mesh.dim_names = {"dp", "tp"};
  EXPECT_THROW(check_source_mesh("t", d), Error);
  d.mesh.dim_names = {"dp_shard_cp"};  // a name that merely contains a data-parallel one
  EXPECT_THROW(check_source_mesh("t", d), Error);
  d.mesh.dim_names = {"fsdp"};
  d.placements[0].kind = PlacementKind::Partial;
  EXPECT_THROW(check_source_mesh("t", d), Error);
}

TEST(ReshardPickleWriter, FloatsAndWideIntegers) {
  pickle::Writer w;
  w.real(0.9);
  const std::string out = w.finish();
  // pickle.dumps(0.9, protocol=2): PROTO 2, BINFLOAT 3FECCCCCCCCCCCCD (big-endian), STOP.
  EXPECT_EQ(out, std::string("\x80\x02G\x3f\xec\xcc\xcc\xcc\xcc\xcc\xcd.", 12));
  pickle::Writer big;
  big.big_integer(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\x01", 9));  // 2**64
  EXPECT_EQ(big.finish(), std::string("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.", 14));
}

}  // namespace
}  // namespace shardmerge::reshard
