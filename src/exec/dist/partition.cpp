#include "exec/dist/partition.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "shardmerge/error.hpp"
#include "shardmerge/dtype.hpp"

namespace shardmerge::dist {

namespace {

// Bytes of the sources that the tensors of output file `f` read, by owning rank (index
// world_size: sources any process can read), and a source path of each owner, for messages.
std::vector<uint64_t> source_bytes_by_owner(const MergePlan& plan, uint32_t f, int world_size,
                                            std::vector<std::string>& a_path) {
  std::vector<uint64_t> bytes(static_cast<size_t>(world_size) + 1, 0);
  a_path.assign(bytes.size(), "");
  auto visit = [&](const OutputTensor& t, const Slice& s) {
    const SourceFile& src = plan.sources.at(s.file);
    if (src.owner != kAnyOwner && (src.owner < 0 || src.owner >= world_size))
      throw Error("is owned by rank " + std::to_string(src.owner) + " of a merge run by " + std::to_string(world_size) +
                  " processes")
          .file(src.path)
          .tensor(t.name);
    uint64_t n = dtype_size(s.dtype);
    for (int64_t e : s.extent) n *= static_cast<uint64_t>(e);
    const size_t at = src.owner == kAnyOwner ? static_cast<size_t>(world_size) : static_cast<size_t>(src.owner);
    bytes[at] += n;
    if (a_path[at].empty()) a_path[at] = src.path;
  };
  for (const OutputTensor& t : plan.tensors) {
    if (t.file != f) continue;
    for (const Slice& s : t.copies) visit(t, s);
    if (t.lora) {
      for (const Slice& s : t.lora->a) visit(t, s);
      for (const Slice& s : t.lora->b) visit(t, s);
    }
  }
  return bytes;
}

}  // namespace

std::vector<int> assign_files(const MergePlan& plan, int world_size, const std::vector<int>& writers, bool move_slices) {
  if (writers.empty()) throw Error("internal: no process may write the output");
  std::vector<size_t> order(plan.files.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plan.files[a].size > plan.files[b].size; });
  std::vector<uint64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(plan.files.size(), writers[0]);
  for (size_t f : order) {
    std::vector<std::string> a_path;
    const std::vector<uint64_t> by_owner = source_bytes_by_owner(plan, static_cast<uint32_t>(f), world_size, a_path);
    uint64_t owned = 0;
    for (int r = 0; r < world_size; ++r) owned += by_owner[static_cast<size_t>(r)];
    // What writing it costs rank r: what it writes already, plus the bytes others must send it.
    int best = -1;
    uint64_t best_cost = 0;
    for (int r : writers) {
      const uint64_t fetched = owned - by_owner[static_cast<size_t>(r)];
      if (!move_slices && fetched > 0) continue;
      const uint64_t cost = load[static_cast<size_t>(r)] + fetched;
      if (best < 0 || cost < best_cost) best = r, best_cost = cost;
    }
    if (best < 0) {
      std::string holders;
      for (int r = 0; r < world_size; ++r)
        if (by_owner[static_cast<size_t>(r)])
          holders += (holders.empty() ? "" : " and ") + ("rank " + std::to_string(r)) + " (" + a_path[static_cast<size_t>(r)] + ")";
      throw Error("output file " + plan.files[f].name + " needs sources held by " + holders +
                  ", and this launch moves no bytes between processes (torchrun's bootstrap carries control "
                  "messages only, and the processes cannot use NCCL: see --transport): launch with mpirun or srun, or "
                  "put the checkpoint on a filesystem every process sees");
    }
    owner[f] = best;
    load[static_cast<size_t>(best)] += plan.files[f].size;
  }
  return owner;
}

RankShare share_of(const MergePlan& plan, const std::vector<int>& owners, int rank) {
  RankShare share;
  share.plan = plan;
  share.owned_files.resize(plan.files.size());
  for (size_t f = 0; f < owners.size(); ++f) share.owned_files[f] = owners[f] == rank;
  std::erase_if(share.plan.tensors, [&](const OutputTensor& t) { return !share.owned_files[t.file]; });
  return share;
}

uint64_t plan_digest(const MergePlan& plan) {
  // FNV-1a over what decides the output bytes: files and headers, tensors and their slices
  // (by file index and offset: each process may name the same source files differently).
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const unsigned char*>(data)[i];
      h *= 1099511628211ull;
    }
  };
  auto mix_ints = [&](const std::vector<int64_t>& v) { mix(v.data(), v.size() * sizeof(int64_t)); };
  auto mix_slices = [&](const std::vector<Slice>& slices) {
    for (const Slice& s : slices) {
      mix(&s.file, sizeof s.file);
      mix(&s.offset, sizeof s.offset);
      mix(&s.dtype, sizeof s.dtype);
      mix_ints(s.strides);
      mix_ints(s.start);
      mix_ints(s.extent);
    }
  };
  for (const auto& src : plan.sources) mix(&src.size, sizeof src.size);
  for (const auto& f : plan.files) {
    mix(f.name.data(), f.name.size());
    mix(f.header.data(), f.header.size());
  }
  for (const auto& t : plan.tensors) {
    mix(t.name.data(), t.name.size());
    mix(&t.dtype, sizeof t.dtype);
    mix(&t.offset, sizeof t.offset);
    mix_ints(t.shape);
    mix_slices(t.copies);
    if (t.lora) {
      mix(&t.lora->scale, sizeof t.lora->scale);
      mix_slices(t.lora->a);
      mix_slices(t.lora->b);
    }
  }
  return h;
}

}  // namespace shardmerge::dist
