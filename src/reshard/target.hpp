// The target layout of a reshard, as pure rules: the mesh (1-D "fsdp", or HSDP ("ddp", "fsdp")),
// each target rank's placements and fsdp index, which source mesh dims can be resharded, whose
// storage is padded, and which source rank's extra state (RNG) a target rank takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "formats/torch_pt.hpp"

namespace shardmerge::reshard {

struct TargetMesh {
  std::vector<int64_t> shape;           // {F} or {D, F}
  std::vector<std::string> dim_names;   // {"fsdp"} or {"ddp", "fsdp"}
  int64_t world_size() const;
  int64_t fsdp() const { return shape.back(); }
  // Rank r's coordinate along the fsdp dim (row-major ranks: fsdp is the fastest dim).
  int64_t fsdp_index(int64_t rank) const { return rank % fsdp(); }
  // Shard(0), after Replicate() on the ddp dim.
  std::vector<Placement> placements() const;
  // DeviceMesh._dim_group_names of rank `rank`: the names torch 2.15 gives this mesh's process
  // groups in a job whose first mesh it is (as verl builds its FSDP mesh first). A 1-D mesh
  // over every rank is the default group, "0". For (D, F), torch creates one group per mesh
  // dim and per coordinate of the other dim, numbered from 1 in that order: the ddp groups
  // (one per fsdp index b) are "1".."F", the fsdp groups (one per ddp index a) "F+1".."F+D".
  // A DTensor's collectives (full_tensor, redistribute) resolve its mesh's groups by these
  // names, and optimizer.load_state_dict keeps the loaded state's mesh, so they must exist in
  // the loading job.
  std::vector<std::string> group_names(int64_t rank) const;
};

// `mesh` is empty (a 1-D fsdp mesh of `world_size`) or "ddp=A,fsdp=B" with A*B == world_size;
// anything else is a usage error.
TargetMesh parse_target_mesh(const std::string& mesh, int64_t world_size);

// Refuses (Error naming `tensor`) a source DTensor whose mesh has a named dim other than data
// parallelism ("fsdp", "ddp", "dp", "dp_shard", "dp_replicate"; unnamed dims are FSDP's
// default mesh), or a Partial placement: a 1-D or (ddp, fsdp) target cannot hold them.
void check_source_mesh(const std::string& tensor, const DTensorValue& d);

// Whether target storages are padded to ceil(dim0 / F) rows. torch pads where the source shows
// it: a rank whose storage holds more elements than its local tensor needs. A source with no
// short rank shows nothing either way; then `otherwise` decides (FSDP2 pads parameters; the
// optimizer's zeros_like state is not padded).
bool padded_storage(const std::vector<DTensorValue>& sources, bool otherwise);

// The source rank whose extra_state (LR scheduler, RNG) target rank `rank` takes: rank mod the
// source world size, so every target rank gets a real RNG state of the saving job and
// ranks that existed before keep their own.
int64_t extra_state_source(int64_t rank, int64_t source_world);

}  // namespace shardmerge::reshard
