#include "plan/regions.hpp"

#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {

Region whole(const SourceTensor& src, std::vector<int64_t> dst_start) {
  return Region{&src, std::vector<int64_t>(src.shape.size(), 0), src.shape, std::move(dst_start), 0};
}

SourceTensor assemble(std::string name, DType dtype, std::vector<int64_t> shape, const std::vector<Region>& regions,
                      std::string origin) {
  SourceTensor out;
  out.name = std::move(name);
  out.dtype = dtype;
  out.shape = std::move(shape);
  out.origin = std::move(origin);
  for (const Region& r : regions) {
    if (r.src->dtype != dtype)
      throw Error("combines " + std::string(dtype_name(r.src->dtype)) + " tensor '" + r.src->name + "' into a " +
                  std::string(dtype_name(dtype)) + " tensor")
          .tensor(out.name);
    for (size_t d = 0; d < r.drop; ++d)
      if (r.extent[d] != 1) throw Error("internal: dropping a dim of extent " + std::to_string(r.extent[d])).tensor(out.name);
    for (const Slice& piece : r.src->pieces) {
      auto sub = intersect(piece, r.start, r.extent);
      if (!sub) continue;
      Slice s = *sub;
      s.start.clear();
      for (size_t d = r.drop; d < r.start.size(); ++d) s.start.push_back(r.dst_start[d - r.drop] + sub->start[d] - r.start[d]);
      s.extent.erase(s.extent.begin(), s.extent.begin() + static_cast<std::ptrdiff_t>(r.drop));
      s.strides.erase(s.strides.begin(), s.strides.begin() + static_cast<std::ptrdiff_t>(r.drop));
      out.pieces.push_back(std::move(s));
    }
  }
  if (auto problem = check_tiling(out.shape, out.pieces))
    throw Error("the parts do not make up the tensor exactly: " + problem->message).tensor(out.name);
  return out;
}

}  // namespace shardmerge
