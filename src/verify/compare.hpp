// Tensor comparison for `verify` and `diff`: bitwise (NaN equals NaN) or within an absolute
// tolerance, with per-tensor counts and the largest absolute error.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "formats/hf_index.hpp"
#include "shardmerge/executor.hpp"
#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

struct TensorDiff {
  uint64_t elements = 0;
  uint64_t mismatched = 0;
  double max_abs_error = 0;  // over mismatched floating-point elements
  void merge(const TensorDiff& other);
};

// Compares n elements of `dtype`; with atol == 0 values must be bit-identical (or both NaN).
TensorDiff compare_elements(const uint8_t* a, const uint8_t* b, DType dtype, size_t n, double atol);

// Everything `verify` and `diff` report.
struct TreeDiff {
  std::vector<std::string> missing;      // expected but absent from the tree under test
  std::vector<std::string> unexpected;   // present in the tree under test only
  std::vector<std::string> mismatched_meta;  // "name: shape/dtype A vs B"
  std::vector<std::string> not_covered;      // verify: "name: N element(s) held by no source piece or by several"
  std::map<std::string, TensorDiff> values;  // per compared tensor
  std::vector<std::string> compared_as_fp32;  // diff --atol: "name: bfloat16 vs float32" (not a difference)
  bool equal() const;
  std::vector<std::string> report(size_t max_lines) const;
};

// An OutputSink that, instead of writing, compares every byte an executor produces with the
// same tensor in a reference HF tree: one executor checked against another's output (the
// executor tests). `verify` does not use it: it must not share the plan it checks.
class CompareSink : public OutputSink {
 public:
  CompareSink(const MergePlan& plan, const HfWeights& reference, double atol);
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override;
  // Names, shapes and dtypes; call before running the executor.
  TreeDiff check_metadata() const;
  TreeDiff result() const;

 private:
  struct Target {
    uint64_t offset = 0;     // of the planned tensor in its planned file
    uint64_t nbytes = 0;
    std::string name;
    DType dtype = DType::BF16;
    const HfWeights::Ref* ref = nullptr;  // null: no comparable reference tensor
  };
  const MergePlan& plan_;
  const HfWeights& reference_;
  double atol_;
  std::vector<std::vector<Target>> by_file_;  // planned file -> targets sorted by offset
  std::vector<File> ref_files_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, TensorDiff> values_;
};

// `diff A B`: every tensor of two HF trees, streamed through bounded buffers. With atol > 0,
// floating-point tensors whose dtypes differ are compared by value, both sides as fp32.
TreeDiff diff_trees(const HfWeights& a, const HfWeights& b, double atol);

}  // namespace shardmerge
