#include "reshard/target.hpp"

#include <algorithm>
#include <set>

#include "shardmerge/error.hpp"

namespace shardmerge::reshard {

int64_t TargetMesh::world_size() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<Placement> TargetMesh::placements() const {
  std::vector<Placement> out(shape.size());  // Replicate() by default
  out.back().kind = PlacementKind::Shard;
  out.back().dim = 0;
  return out;
}

std::vector<std::string> TargetMesh::group_names(int64_t rank) const {
  if (shape.size() == 1) return {"0"};
  const int64_t a = rank / fsdp(), b = rank % fsdp();
  return {std::to_string(1 + b), std::to_string(1 + fsdp() + a)};
}

TargetMesh parse_target_mesh(const std::string& mesh, int64_t world_size) {
  if (world_size < 1) throw usage_error("--world_size must be at least 1");
  if (mesh.empty()) return {{world_size}, {"fsdp"}};
  int64_t ddp = 0, fsdp = 0;
  size_t pos = 0;
  while (pos <= mesh.size()) {
    const size_t comma = std::min(mesh.find(',', pos), mesh.size());
    const std::string part = mesh.substr(pos, comma - pos);
    const size_t eq = part.find('=');
    const std::string key = part.substr(0, eq);
    int64_t* slot = key == "ddp" ? &ddp : key == "fsdp" ? &fsdp : nullptr;
    int64_t value = 0;
    if (eq != std::string::npos && eq + 1 < part.size() && part.find_first_not_of("0123456789", eq + 1) == std::string::npos &&
        part.size() - eq - 1 <= 9)
      value = std::stoll(part.substr(eq + 1));
    if (slot == nullptr || *slot != 0 || value < 1)
      throw usage_error("--mesh " + mesh + ": expected ddp=A,fsdp=B with positive sizes");
    *slot = value;
    pos = comma + 1;
  }
  if (ddp == 0 || fsdp == 0) throw usage_error("--mesh " + mesh + ": expected ddp=A,fsdp=B with positive sizes");
  if (ddp * fsdp != world_size)
    throw usage_error("--mesh " + mesh + " has " + std::to_string(ddp * fsdp) + " ranks but --world_size is " +
                      std::to_string(world_size));
  return {{ddp, fsdp}, {"ddp", "fsdp"}};
}

void check_source_mesh(const std::string& tensor, const DTensorValue& d) {
  // The names torch and verl give data-parallel mesh dims; any other named dim (tp, sp, cp,
  // ep, pp, ...) splits the model itself, which a data-parallel target cannot express.
  static const std::set<std::string> data_parallel = {"fsdp", "ddp", "dp", "dp_shard", "dp_replicate"};
  for (const std::string& name : d.mesh.dim_names)
    if (!data_parallel.contains(name))
      throw Error("its mesh has a '" + name + "' dim; only data-parallel meshes (fsdp, ddp) can be resharded").tensor(tensor);
  for (const Placement& p : d.placements)
    if (p.kind == PlacementKind::Partial) throw Error("placement " + p.to_string() + " cannot be resharded").tensor(tensor);
}

bool padded_storage(const std::vector<DTensorValue>& sources, bool otherwise) {
  for (const DTensorValue& d : sources) {
    uint64_t needed = 0;  // elements from the storage start to the end of the local tensor
    if (d.local.numel() > 0) {
      needed = static_cast<uint64_t>(d.local.storage_offset) + 1;
      for (size_t i = 0; i < d.local.size.size(); ++i) needed += static_cast<uint64_t>((d.local.size[i] - 1) * d.local.stride[i]);
    }
    const uint64_t elem = dtype_size(d.local.dtype);
    if (d.local.storage_nbytes > needed * elem) return true;
  }
  // No rank shows padding: the evidence against it is a short rank that stored just its rows.
  for (const DTensorValue& d : sources) {
    if (d.global_size.empty() || d.local.size.empty()) continue;
    int64_t shards = 1;  // mesh dims sharding dim 0
    for (size_t i = 0; i < d.placements.size(); ++i)
      if (d.placements[i].kind != PlacementKind::Replicate && d.placements[i].dim == 0) shards *= d.mesh.shape[i];
    const int64_t chunk = (d.global_size[0] + shards - 1) / shards;
    if (d.local.size[0] < chunk) return false;
  }
  return otherwise;
}

int64_t extra_state_source(int64_t rank, int64_t source_world) { return rank % source_world; }

}  // namespace shardmerge::reshard
