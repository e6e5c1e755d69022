// How a plan is shared among processes: whole output files, balanced by bytes, so that each
// process writes its own files and no two write the same one.
#pragma once

#include <cstdint>
#include <vector>

#include "shardmerge/plan.hpp"

namespace shardmerge::dist {

// The writing rank of each output file, one of `writers`: largest files first, each to the
// writer for which (bytes it writes already + bytes of the file's sources that other ranks own,
// SourceFile::owner) is least. Without `move_slices` (a transport with no data plane) a file
// must go to a writer that holds every source it reads; throws when none does, and for a
// source owned by a rank past `world_size`.
std::vector<int> assign_files(const MergePlan& plan, int world_size, const std::vector<int>& writers, bool move_slices);

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
