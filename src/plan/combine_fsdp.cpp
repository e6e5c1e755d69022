#include "plan/combine.hpp"

#include <optional>
#include <string>
#include <unordered_map>

#include "geometry/sharding.hpp"
#include "layouts/names.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
// Summaries and roles are layouts' types; the combine step reads them, nothing else.
using namespace layouts;

namespace {

struct Candidate {
  int64_t rank = 0;
  Slice slice;
};

struct Gathered {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  int64_t first_rank = 0;
  std::vector<Candidate> candidates;
  std::string origin;
  bool replicated_plain = false;
};

std::string mesh_string(const DeviceMeshInfo& mesh) {
  std::string s = "(";
  for (size_t i = 0; i < mesh.shape.size(); ++i) {
    if (i) s += ", ";
    s += (mesh.dim_names.size() > i ? mesh.dim_names[i] + "=" : "") + std::to_string(mesh.shape[i]);
  }
  return s + ")";
}

std::string placements_string(const std::vector<Placement>& ps) {
  std::string s;
  for (const auto& p : ps) s += (s.empty() ? "" : ", ") + p.to_string();
  return "[" + s + "]";
}

}  // namespace

SourceSet combine_fsdp(const FsdpRole& role, const std::vector<RankFileSummary>& files) {
  layouts::check_fsdp_role(role);
  SourceSet set;
  std::unordered_map<int64_t, uint32_t> file_index;  // rank -> SourceSet::files index
  for (const auto& f : files) {
    if (!file_index.try_emplace(f.rank, static_cast<uint32_t>(set.files.size())).second)
      throw Error("two summaries of rank " + std::to_string(f.rank)).file(f.file.path);
    set.files.push_back({f.file.path, f.file.stamp.size, f.file.stamp});
  }

  std::vector<std::string> order;
  std::unordered_map<std::string, Gathered> by_name;
  std::optional<DTensorValue> example;  // for the description line
  size_t dtensors = 0, sharded = 0, plain = 0;

  for (const auto& f : files) {
    const uint32_t fi = file_index.at(f.rank);
    for (const StateEntry& e : f.file.entries) {
      try {
        auto [it, fresh] = by_name.try_emplace(e.name);
        Gathered& g = it->second;
        if (fresh) {
          order.push_back(e.name);
          g.dtype = e.dtype();
          g.shape = e.global_shape();
          g.first_rank = f.rank;
        } else if (g.dtype != e.dtype() || g.shape != e.global_shape()) {
          throw Error("rank " + std::to_string(f.rank) + " has it as " + std::string(dtype_name(e.dtype())) + " " +
                      shape_string(e.global_shape()) + " but rank " + std::to_string(g.first_rank) + " as " +
                      std::string(dtype_name(g.dtype)) + " " + shape_string(g.shape));
        }
        auto check = [&](const TensorView& v) { set.records.push_back(record_check(fi, f.file.record_of(v), e.name)); };
        if (const auto* v = std::get_if<TensorView>(&e.value)) {
          check(*v);
          // A plain tensor in a rank file is the whole tensor on every rank (persistent buffers,
          // world size 1, full state dicts): a replica, never a shard to concatenate.
          g.candidates.push_back({f.rank, view_to_slice(fi, f.file.record_of(*v).data_offset, *v,
                                                        std::vector<int64_t>(v->size.size(), 0))});
          g.replicated_plain = true;
          g.origin = role.world_size > 1 ? "replicated (plain tensor on every rank)" : "whole tensor";
          if (fresh) ++plain;
        } else if (const auto* d = std::get_if<DTensorValue>(&e.value)) {
          check(d->local);
          const auto runs = dtensor_local_runs(d->global_size, d->placements, d->mesh.shape,
                                             d->mesh.coordinate_of(f.rank), d->shard_order);
          for (Slice& s : view_to_slices(fi, f.file.record_of(d->local).data_offset, d->local, runs))
            g.candidates.push_back({f.rank, std::move(s)});
          g.origin = "DTensor " + placements_string(d->placements) + " on mesh " + mesh_string(d->mesh);
          if (!example) example = *d;
          if (fresh) ++dtensors;
        } else {
          const auto& st = std::get<ShardedTensorValue>(e.value);
          for (const auto& local : st.local_shards) {
            check(local.view);
            g.candidates.push_back({f.rank, view_to_slice(fi, f.file.record_of(local.view).data_offset, local.view,
                                                          local.offsets)});
          }
          g.origin = "ShardedTensor, " + std::to_string(st.all_shards.size()) + " shards";
          if (fresh) ++sharded;
        }
      } catch (Error& err) {
        err.tensor(e.name).file(f.file.path);
        throw;
      }
    }
  }

  std::string missing_files;
  for (int64_t r : role.missing_ranks) missing_files += (missing_files.empty() ? "" : ", ") + rank_file_name("model", role.world_size, r);

  for (const std::string& name : order) {
    Gathered& g = by_name.at(name);
    SourceTensor t;
    t.name = name;
    t.dtype = g.dtype;
    t.shape = g.shape;
    t.origin = g.origin;
    // Identical boxes from several ranks are replicas (HSDP, Replicate dims, plain buffers):
    // read the lowest rank's copy once.
    std::vector<int64_t> ranks;
    for (auto& c : g.candidates) {
      bool duplicate = false;
      for (const Slice& kept : t.pieces)
        if (kept.start == c.slice.start && kept.extent == c.slice.extent) duplicate = true;
      if (duplicate) continue;
      t.pieces.push_back(c.slice);
      ranks.push_back(c.rank);
    }
    if (auto problem = check_tiling(t.shape, t.pieces)) {
      std::string msg = "rank files do not cover the tensor exactly once: " + problem->message;
      if (problem->kind == TilingProblem::Kind::Overlap)
        msg += " (ranks " + std::to_string(ranks[problem->first]) + " and " + std::to_string(ranks[problem->second]) + ")";
      if (problem->kind == TilingProblem::Kind::Gap && !missing_files.empty()) msg += "; missing rank files: " + missing_files;
      throw Error(msg).tensor(name).file(role.path);
    }
    set.tensors.push_back(std::move(t));
  }

  std::string desc = "FSDP" + (role.fsdp_version ? std::to_string(role.fsdp_version) : std::string("")) +
                     " world_size=" + std::to_string(role.world_size);
  if (example) desc += " mesh=" + mesh_string(example->mesh);
  desc += ", " + std::to_string(order.size()) + " tensors (" + std::to_string(dtensors) + " DTensor, " +
          std::to_string(sharded) + " ShardedTensor, " + std::to_string(plain) + " plain)";
  set.description = desc;
  if (!role.missing_ranks.empty())
    set.notes.push_back("rank files missing but not needed (their data has replicas): " + missing_files);
  if (plain > 0 && role.world_size > 1)
    set.notes.push_back(std::to_string(plain) + " plain tensor(s) are replicated on every rank and taken once "
                        "(verl's merger concatenates them)");
  return set;
}

}  // namespace shardmerge
