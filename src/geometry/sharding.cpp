#include "geometry/sharding.hpp"

#include <algorithm>
#include <numeric>

#include "shardmerge/error.hpp"

namespace shardmerge {

int64_t runs_length(const Runs& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.size();
  return n;
}

Runs chunk_runs(const Runs& runs, int64_t n, int64_t k) {
  const int64_t length = runs_length(runs);
  const int64_t chunk = (length + n - 1) / n;
  const int64_t lo = std::min(length, k * chunk);
  const int64_t hi = std::min(length, (k + 1) * chunk);
  Runs out;
  int64_t pos = 0;  // position of the current run's first index in the sequence
  for (const auto& r : runs) {
    const int64_t a = std::max(lo, pos), b = std::min(hi, pos + r.size());
    if (a < b) out.push_back({r.begin + (a - pos), r.begin + (b - pos)});
    pos += r.size();
  }
  return out;
}

std::vector<Runs> dtensor_local_runs(const std::vector<int64_t>& global_shape, const std::vector<Placement>& placements,
                                     const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coordinate,
                                     const std::vector<std::pair<int64_t, std::vector<int64_t>>>& shard_order) {
  // Which mesh dims shard each tensor dim, left to right.
  std::vector<std::vector<int64_t>> order(global_shape.size());
  bool strided = false;
  for (size_t m = 0; m < placements.size(); ++m) {
    const Placement& p = placements[m];
    if (p.kind == PlacementKind::Partial)
      throw Error("placement " + p.to_string() + " holds unreduced partial sums; save with Replicate or Shard");
    if (p.kind == PlacementKind::Replicate) continue;
    strided = strided || p.kind == PlacementKind::StridedShard;
    order.at(static_cast<size_t>(p.dim)).push_back(static_cast<int64_t>(m));
  }
  for (const auto& [dim, mesh_dims] : shard_order) {
    if (dim < 0 || dim >= static_cast<int64_t>(order.size())) throw Error("shard_order names tensor dim " + std::to_string(dim));
    auto expected = order[static_cast<size_t>(dim)], given = mesh_dims;
    std::sort(expected.begin(), expected.end());
    std::sort(given.begin(), given.end());
    if (expected != given) throw Error("shard_order for dim " + std::to_string(dim) + " does not match the placements");
    if (strided && mesh_dims != order[static_cast<size_t>(dim)])
      throw Error("a non-default shard_order together with _StridedShard is not supported");
    order[static_cast<size_t>(dim)] = mesh_dims;
  }
  std::vector<Runs> runs;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    Runs dim = global_shape[d] > 0 ? Runs{{0, global_shape[d]}} : Runs{};
    for (int64_t m : order[d]) {
      const Placement& p = placements[static_cast<size_t>(m)];
      const int64_t n = mesh_shape.at(static_cast<size_t>(m)), c = coordinate.at(static_cast<size_t>(m));
      if (p.kind == PlacementKind::Shard) {
        dim = chunk_runs(dim, n, c);
      } else {  // _StridedShard: the split_factor pieces are each chunked, our chunks concatenated
        Runs out;
        for (int64_t j = 0; j < p.split_factor; ++j) {
          Runs piece = chunk_runs(chunk_runs(dim, p.split_factor, j), n, c);
          out.insert(out.end(), piece.begin(), piece.end());
        }
        dim = std::move(out);
      }
    }
    runs.push_back(std::move(dim));
  }
  return runs;
}

Slice view_to_slice(uint32_t file, uint64_t storage_offset_in_file, const TensorView& view,
                    const std::vector<int64_t>& start) {
  Slice s;
  s.file = file;
  s.dtype = view.dtype;
  s.offset = storage_offset_in_file + static_cast<uint64_t>(view.storage_offset) * dtype_size(view.dtype);
  s.strides = view.stride;
  s.start = start;
  s.extent = view.size;
  return s;
}

Slice dense_slice(uint32_t file, uint64_t offset, DType dtype, const std::vector<int64_t>& start,
                  const std::vector<int64_t>& extent) {
  std::vector<int64_t> strides(extent.size(), 1);
  for (size_t d = extent.size(); d-- > 1;) strides[d - 1] = strides[d] * extent[d];
  return {file, offset, dtype, std::move(strides), start, extent};
}

std::vector<Slice> view_to_slices(uint32_t file, uint64_t storage_offset_in_file, const TensorView& view,
                                  const std::vector<Runs>& runs) {
  const size_t ndim = view.size.size();
  for (size_t d = 0; d < ndim; ++d)
    if (runs_length(runs[d]) != view.size[d])
      throw Error("local size " + std::to_string(view.size[d]) + " on dim " + std::to_string(d) +
                  " does not match the " + std::to_string(runs_length(runs[d])) + " elements its placement assigns");
  std::vector<Slice> out;
  for (const auto& r : runs)
    if (r.empty()) return out;  // an empty local shard
  // Odometer over one run per dim; `local` tracks where each run starts in the local view.
  std::vector<size_t> idx(ndim, 0);
  const uint64_t elem = dtype_size(view.dtype);
  while (true) {
    Slice s = view_to_slice(file, storage_offset_in_file, view, {});
    for (size_t d = 0; d < ndim; ++d) {
      int64_t local = 0;
      for (size_t j = 0; j < idx[d]; ++j) local += runs[d][j].size();
      const Interval& r = runs[d][idx[d]];
      s.offset += static_cast<uint64_t>(local * view.stride[d]) * elem;
      s.start.push_back(r.begin);
      s.extent[d] = r.size();
    }
    out.push_back(std::move(s));
    size_t d = ndim;
    while (d > 0) {
      --d;
      if (++idx[d] < runs[d].size()) break;
      idx[d] = 0;
      if (d == 0) return out;
    }
    if (ndim == 0) return out;
  }
}

std::optional<TilingProblem> check_tiling(const std::vector<int64_t>& shape, const std::vector<Slice>& slices) {
  const size_t ndim = shape.size();
  // Shapes come from metadata (DCP .metadata, DTensor specs) that nothing else bounds. With at
  // most 2^63 - 1 elements (torch's own limit) every in-bounds piece's count fits 64 bits,
  // and their sum fits the 128-bit `covered`.
  int64_t total = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(total, d, &total))
      return TilingProblem{TilingProblem::Kind::OutOfBounds, 0, 0,
                           "tensor shape " + shape_string(shape) + " has a negative dimension or more than 2^63 elements"};
  unsigned __int128 covered = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    bool in_bounds = s.start.size() == ndim && s.extent.size() == ndim;
    // start + extent <= shape, written so that neither side can overflow.
    for (size_t d = 0; in_bounds && d < ndim; ++d)
      in_bounds = s.start[d] >= 0 && s.extent[d] >= 0 && s.start[d] <= shape[d] && s.extent[d] <= shape[d] - s.start[d];
    if (!in_bounds)
      return TilingProblem{TilingProblem::Kind::OutOfBounds, i, i,
                           "piece at " + shape_string(s.start) + " of size " + shape_string(s.extent) +
                               " lies outside the tensor's shape " + shape_string(shape)};
    covered += s.numel();
  }
  // Sweep along dim 0 so that only pieces whose dim-0 ranges meet are compared.
  std::vector<size_t> order(slices.size());
  std::iota(order.begin(), order.end(), 0);
  auto lo = [&](size_t i) { return ndim ? slices[i].start[0] : 0; };
  auto hi = [&](size_t i) { return ndim ? slices[i].start[0] + slices[i].extent[0] : 1; };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lo(a) < lo(b); });
  for (size_t a = 0; a < order.size(); ++a) {
    const Slice& sa = slices[order[a]];
    if (sa.numel() == 0) continue;
    for (size_t b = a + 1; b < order.size() && lo(order[b]) < hi(order[a]); ++b) {
      const Slice& sb = slices[order[b]];
      if (sb.numel() == 0) continue;
      bool meet = true;
      for (size_t d = 0; meet && d < ndim; ++d)
        meet = sa.start[d] < sb.start[d] + sb.extent[d] && sb.start[d] < sa.start[d] + sa.extent[d];
      if (meet)
        return TilingProblem{TilingProblem::Kind::Overlap, order[a], order[b],
                             "pieces at " + shape_string(sa.start) + " and " + shape_string(sb.start) + " overlap"};
    }
  }
  if (covered != static_cast<uint64_t>(total))
    return TilingProblem{TilingProblem::Kind::Gap, 0, 0,
                         "pieces cover " + std::to_string(static_cast<uint64_t>(covered)) + " of " + std::to_string(total) +
                             " elements"};
  return std::nullopt;
}

}  // namespace shardmerge
