#include "exec/dist/partition.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "shardmerge/error.hpp"

namespace shardmerge::dist {

namespace {

// The one rank that can write output file `f` (kAnyOwner when every source it reads is on a
// shared filesystem), from the owners of the sources its tensors read.
int32_t writer_of(const MergePlan& plan, uint32_t f, int world_size) {
  int32_t owner = kAnyOwner;
  uint32_t owner_source = 0;
  auto visit = [&](const OutputTensor& t, const Slice& s) {
    const SourceFile& src = plan.sources.at(s.file);
    if (src.owner == kAnyOwner) return;
    if (src.owner >= world_size)
      throw Error("is owned by rank " + std::to_string(src.owner) + " of a merge run by " + std::to_string(world_size) +
                  " processes")
          .file(src.path);
    if (owner != kAnyOwner && owner != src.owner)
      throw Error("output file " + plan.files[f].name + " needs sources held by rank " + std::to_string(owner) + " (" +
                  plan.sources[owner_source].path + ") and rank " + std::to_string(src.owner) +
                  "; no single process can write it (slices are not moved between processes)")
          .tensor(t.name)
          .file(src.path);
    owner = src.owner;
    owner_source = s.file;
  };
  for (const OutputTensor& t : plan.tensors) {
    if (t.file != f) continue;
    for (const Slice& s : t.copies) visit(t, s);
    if (t.lora) {
      for (const Slice& s : t.lora->a) visit(t, s);
      for (const Slice& s : t.lora->b) visit(t, s);
    }
  }
  return owner;
}

}  // namespace

std::vector<int> assign_files(const MergePlan& plan, int world_size) {
  std::vector<size_t> order(plan.files.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plan.files[a].size > plan.files[b].size; });
  std::vector<uint64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(plan.files.size(), 0);
  for (size_t f : order) {
    const int32_t fixed = writer_of(plan, static_cast<uint32_t>(f), world_size);
    const auto r = fixed != kAnyOwner ? static_cast<size_t>(fixed)
                                      : static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[f] = static_cast<int>(r);
    load[r] += plan.files[f].size;
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
