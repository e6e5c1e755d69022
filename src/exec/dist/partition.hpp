// How a plan is shared among processes: whole output files, balanced by bytes, so that each
// process writes its own files and no two write the same one.
#pragma once

#include <cstdint>
#include <vector>

#include "shardmerge/plan.hpp"

namespace shardmerge::dist {

// Owner rank of each output file: largest files first, each to the least-loaded rank, except
// that a file whose tensors read sources of one rank (SourceFile::owner) goes to that rank.
// Throws when a file needs sources of two ranks, or of a rank past `world_size`.
std::vector<int> assign_files(const MergePlan& plan, int world_size);

// The plan restricted to the tensors of the files `rank` owns (same files and sources, so
// offsets stay valid; an executor opens only the sources those tensors read), and the
// matching ownership flags.
struct RankShare {
  MergePlan plan;
  std::vector<bool> owned_files;
};
RankShare share_of(const MergePlan& plan, const std::vector<int>& owners, int rank);

// A digest of everything that decides the output bytes, to check that every process planned
// the same merge.
uint64_t plan_digest(const MergePlan& plan);

}  // namespace shardmerge::dist
