#include "exec/tasks.hpp"

#include <algorithm>

#include "util/shape.hpp"

namespace shardmerge {

uint64_t Box::numel() const { return element_count(extent); }

bool box_is_contiguous(const std::vector<int64_t>& extent, const std::vector<int64_t>& shape) {
  // Row-major contiguous: single-element leading dims, then one partial dim, then full dims.
  size_t d = 0;
  while (d < extent.size() && extent[d] == 1) ++d;
  if (d == extent.size()) return true;
  for (size_t k = d + 1; k < extent.size(); ++k)
    if (extent[k] != shape[k]) return false;
  return true;
}

uint64_t linear_index(const std::vector<int64_t>& start, const std::vector<int64_t>& shape) {
  uint64_t idx = 0;
  for (size_t d = 0; d < shape.size(); ++d) idx = idx * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(start[d]);
  return idx;
}

std::vector<Box> slab_boxes(const std::vector<int64_t>& shape, uint64_t max_elems) {
  std::vector<Box> out;
  const size_t ndim = shape.size();
  for (int64_t s : shape)
    if (s == 0) return out;
  if (ndim == 0) return {Box{{}, {}}};
  max_elems = std::max<uint64_t>(max_elems, 1);
  // Split dim k: the shallowest dim whose inner block (dims after k) fits the budget.
  size_t k = ndim - 1;
  uint64_t inner = 1;
  for (size_t d = ndim; d-- > 0;) {
    if (inner * static_cast<uint64_t>(shape[d]) > max_elems) {
      k = d;
      break;
    }
    inner *= static_cast<uint64_t>(shape[d]);
    k = d;
  }
  inner = 1;
  for (size_t d = k + 1; d < ndim; ++d) inner *= static_cast<uint64_t>(shape[d]);
  const auto step = static_cast<int64_t>(std::max<uint64_t>(1, max_elems / inner));
  // Odometer over the dims before k; ranges of `step` along k; full dims after k.
  std::vector<int64_t> prefix(k, 0);
  while (true) {
    for (int64_t a = 0; a < shape[k]; a += step) {
      Box b;
      b.start = prefix;
      b.extent.assign(k, 1);
      b.start.push_back(a);
      b.extent.push_back(std::min(step, shape[k] - a));
      for (size_t d = k + 1; d < ndim; ++d) {
        b.start.push_back(0);
        b.extent.push_back(shape[d]);
      }
      out.push_back(std::move(b));
    }
    size_t d = k;
    while (d > 0) {
      --d;
      if (++prefix[d] < shape[d]) break;
      prefix[d] = 0;
      if (d == 0) return out;
    }
    if (k == 0) return out;
  }
}

std::vector<Task> make_tasks(const MergePlan& plan, const TaskLimits& limits) {
  // Plan order: each tensor's tasks together, so CPU-heavy folds and slabs interleave with the
  // I/O-bound runs of neighbouring tensors and the disk keeps busy while the CPUs compute.
  std::vector<Task> tasks;
  for (uint32_t ti = 0; ti < plan.tensors.size(); ++ti) {
    const OutputTensor& t = plan.tensors[ti];
    const uint64_t out_elem = dtype_size(t.dtype);
    if (t.lora) {
      Task task;
      task.kind = Task::Kind::Fold;
      task.tensor = ti;
      tasks.push_back(task);
      continue;
    }
    bool direct = true;
    for (const Slice& s : t.copies) direct = direct && s.source_contiguous() && box_is_contiguous(s.extent, t.shape);
    if (direct) {
      for (const Slice& s : t.copies) {
        const uint64_t n = s.numel(), src_elem = dtype_size(s.dtype);
        const uint64_t chunk = std::max<uint64_t>(1, limits.run_bytes / std::max(src_elem, out_elem));
        const uint64_t base = t.offset + linear_index(s.start, t.shape) * out_elem;
        for (uint64_t e = 0; e < n; e += chunk) {
          Task task;
          task.kind = Task::Kind::Run;
          task.tensor = ti;
          task.src_file = s.file;
          task.src_offset = s.offset + e * src_elem;
          task.src_dtype = s.dtype;
          task.count = std::min(chunk, n - e);
          task.dst_offset = base + e * out_elem;
          tasks.push_back(task);
        }
      }
      continue;
    }
    uint64_t widest = out_elem;
    for (const Slice& s : t.copies) widest = std::max<uint64_t>(widest, dtype_size(s.dtype));
    for (Box& b : slab_boxes(t.shape, limits.slab_bytes / widest)) {
      Task task;
      task.kind = Task::Kind::Slab;
      task.tensor = ti;
      task.dst_offset = t.offset + linear_index(b.start, t.shape) * out_elem;
      task.box = std::move(b);
      tasks.push_back(std::move(task));
    }
  }
  return tasks;
}

namespace {

// True when the slice's box and `box` share an element (an empty slice shares none).
bool overlaps(const Slice& s, const Box& box) {
  for (size_t d = 0; d < s.start.size(); ++d)
    if (std::max(s.start[d], box.start[d]) >= std::min(s.start[d] + s.extent[d], box.start[d] + box.extent[d]))
      return false;
  return true;
}

}  // namespace

std::vector<uint32_t> source_files_read(const MergePlan& plan, const std::vector<Task>& tasks) {
  std::vector<bool> read(plan.sources.size(), false);
  auto mark = [&](const Slice& s) {
    if (s.numel() > 0) read.at(s.file) = true;
  };
  for (const Task& t : tasks) {
    const OutputTensor& out = plan.tensors[t.tensor];
    switch (t.kind) {
      case Task::Kind::Run: read.at(t.src_file) = true; break;
      case Task::Kind::Slab:
        for (const Slice& s : out.copies)
          if (overlaps(s, t.box)) mark(s);
        break;
      case Task::Kind::Fold:
        for (const auto* slices : {&out.copies, &out.lora->a, &out.lora->b})
          for (const Slice& s : *slices) mark(s);
        break;
    }
  }
  std::vector<uint32_t> files;
  for (uint32_t f = 0; f < read.size(); ++f)
    if (read[f]) files.push_back(f);
  return files;
}

uint64_t task_bytes(const MergePlan& plan, const Task& task) {
  const OutputTensor& out = plan.tensors[task.tensor];
  const uint64_t out_elem = dtype_size(out.dtype);
  switch (task.kind) {
    case Task::Kind::Run: return task.count * (dtype_size(task.src_dtype) + out_elem);
    case Task::Kind::Slab: {
      uint64_t widest = 0;
      for (const Slice& s : out.copies) widest = std::max<uint64_t>(widest, dtype_size(s.dtype));
      return task.box.numel() * (widest + out_elem);
    }
    case Task::Kind::Fold: {
      uint64_t bytes = out.numel() * out_elem;
      for (const auto* slices : {&out.copies, &out.lora->a, &out.lora->b})
        for (const Slice& s : *slices) bytes += s.numel() * dtype_size(s.dtype);
      return bytes;
    }
  }
  return 0;
}

std::vector<std::vector<Task>> split_by_bytes(const MergePlan& plan, const std::vector<Task>& tasks, size_t parts) {
  std::vector<std::vector<Task>> out(std::max<size_t>(parts, 1));
  std::vector<uint64_t> bytes;
  uint64_t total = 0;
  for (const Task& t : tasks) total += bytes.emplace_back(task_bytes(plan, t));
  // A task goes to the part its middle byte falls in.
  uint64_t before = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const double middle = static_cast<double>(before) + static_cast<double>(bytes[i]) / 2;
    const auto part = total == 0 ? 0 : static_cast<size_t>(middle / static_cast<double>(total) * static_cast<double>(out.size()));
    out[std::min(part, out.size() - 1)].push_back(tasks[i]);
    before += bytes[i];
  }
  return out;
}

}  // namespace shardmerge
