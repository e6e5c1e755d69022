#include "reshard/row_moves.hpp"

#include <algorithm>
#include <string>

#include "shardmerge/error.hpp"

namespace shardmerge::reshard {

namespace {

// A run of global rows and where it sits in its source rank's local tensor.
struct Held {
  int64_t begin, end, source, source_row;
};

}  // namespace

std::vector<TargetRows> plan_row_moves(const std::string& tensor, const std::vector<int64_t>& global_shape,
                                       const std::vector<std::vector<Runs>>& source_runs, int64_t target_fsdp) {
  if (target_fsdp < 1) throw Error("reshard: target fsdp size must be >= 1");
  if (global_shape.empty()) throw Error(tensor + ": a 0-dim tensor cannot be sharded along dim 0");
  const int64_t dim0 = global_shape[0];
  std::vector<Held> held;
  for (size_t r = 0; r < source_runs.size(); ++r) {
    const auto& runs = source_runs[r];
    if (runs.size() != global_shape.size())
      throw Error(tensor + ": rank " + std::to_string(r) + " describes " + std::to_string(runs.size()) + " dims, tensor has " +
                  std::to_string(global_shape.size()));
    for (size_t d = 1; d < runs.size(); ++d) {
      const bool whole = global_shape[d] == 0 ? runs[d].empty()
                                              : runs[d].size() == 1 && runs[d][0].begin == 0 && runs[d][0].end == global_shape[d];
      if (!whole)
        throw Error(tensor + ": rank " + std::to_string(r) + " holds part of dim " + std::to_string(d) +
                    "; only dim-0 sharding can be resharded");
    }
    int64_t local = 0;
    for (const auto& run : runs[0]) {
      held.push_back({run.begin, run.end, static_cast<int64_t>(r), local});
      local += run.size();
    }
  }
  // Lowest rank first among runs that start at the same row, so replicas resolve to rank order.
  std::stable_sort(held.begin(), held.end(), [](const Held& a, const Held& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.source < b.source;
  });

  std::vector<TargetRows> out(static_cast<size_t>(target_fsdp));
  const int64_t chunk = (dim0 + target_fsdp - 1) / target_fsdp;
  for (int64_t f = 0; f < target_fsdp; ++f) {
    TargetRows& t = out[static_cast<size_t>(f)];
    const int64_t lo = std::min(dim0, f * chunk), hi = std::min(dim0, (f + 1) * chunk);
    t.rows = hi - lo;
    t.padded_rows = chunk;
    int64_t row = lo;  // first global row of this target not yet covered
    while (row < hi) {
      // Among runs holding `row`, the lowest rank's (held is sorted by begin, then rank).
      const Held* best = nullptr;
      for (const auto& h : held) {
        if (h.begin > row) break;
        if (h.end > row && (best == nullptr || h.source < best->source)) best = &h;
      }
      if (best == nullptr) throw Error(tensor + ": no source rank holds row " + std::to_string(row) + " of dim 0");
      const int64_t end = std::min(hi, best->end);
      t.moves.push_back({best->source, best->source_row + (row - best->begin), row - lo, end - row});
      row = end;
    }
  }
  return out;
}

}  // namespace shardmerge::reshard
