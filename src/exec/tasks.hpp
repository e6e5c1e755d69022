// How a MergePlan is cut into bounded units of work. Pure arithmetic shared by executors:
//  - Run:  one contiguous source byte range to one contiguous output range (dim-0 concat,
//          whole tensors); no staging beyond a cast buffer, none at all without a cast.
//  - Slab: a row-major-contiguous box of one output tensor gathered from the pieces that
//          intersect it (dim-d>0 concat, strided sources), through bounded staging.
//  - Fold: a whole LoRA-folded tensor, processed slab by slab in fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "shardmerge/plan.hpp"

namespace shardmerge {

struct Box {
  std::vector<int64_t> start;
  std::vector<int64_t> extent;
  uint64_t numel() const;
};

struct Task {
  enum class Kind { Run, Slab, Fold } kind = Kind::Run;
  uint32_t tensor = 0;  // index into MergePlan::tensors
  // Run: `count` elements from source byte `src_offset` of `src_file` to output byte `dst_offset`.
  uint32_t src_file = 0;
  uint64_t src_offset = 0;
  DType src_dtype = DType::F32;
  uint64_t count = 0;
  uint64_t dst_offset = 0;
  // Slab: the box of the output tensor, row-major contiguous, written at `dst_offset`.
  Box box;
};

struct TaskLimits {
  uint64_t run_bytes = 16u << 20;   // source bytes per Run task
  uint64_t slab_bytes = 16u << 20;  // bytes of the widest dtype (source or output) per Slab
};

// True when the box [start, start+extent) of a row-major tensor of `shape` is one run of memory.
bool box_is_contiguous(const std::vector<int64_t>& extent, const std::vector<int64_t>& shape);
// Row-major linear index of the box's first element.
uint64_t linear_index(const std::vector<int64_t>& start, const std::vector<int64_t>& shape);

// Cuts `shape` into row-major-contiguous boxes of at most `max_elems` elements each (at least
// one element): whole leading-dim rows when they fit, deeper splits when one row is too big.
std::vector<Box> slab_boxes(const std::vector<int64_t>& shape, uint64_t max_elems);

std::vector<Task> make_tasks(const MergePlan& plan, const TaskLimits& limits);

// The source files `tasks` read (indices into MergePlan::sources, ascending, each once): a
// run's file, the files of the copies a slab's box overlaps, and those of a fold's copies and
// LoRA A/B slices. Executors open these and no other.
std::vector<uint32_t> source_files_read(const MergePlan& plan, const std::vector<Task>& tasks);

// Source plus output bytes a task moves (a slab counts its widest source dtype).
uint64_t task_bytes(const MergePlan& plan, const Task& task);

// Cuts `tasks` into `parts` consecutive runs of about equal task_bytes, for executors that drive
// several devices: order is kept, so each part still reads its files front to back.
std::vector<std::vector<Task>> split_by_bytes(const MergePlan& plan, const std::vector<Task>& tasks, size_t parts);

}  // namespace shardmerge
