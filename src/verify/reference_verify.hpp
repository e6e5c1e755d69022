// `verify` and `merge --verify`: every tensor of an HF tree compared, element by element, with
// the checkpoint assembled independently of the merge plan (verify/reference_assembly.hpp).
// From the plan it takes only what is policy, not arithmetic: which names are written, their
// dtypes, which weights get a LoRA fold and its scale. Where each element comes from, the
// casts and the folds are recomputed here.
#pragma once

#include <cstdint>
#include <string>

#include "pipeline/planner.hpp"
#include "verify/compare.hpp"

namespace shardmerge {

struct ReferenceCheck {
  TreeDiff diff;
  size_t tensors = 0;     // compared tensors
  uint64_t elements = 0;  // compared elements
  size_t folds = 0;       // LoRA folds recomputed
  uint64_t records = 0;   // zip records whose CRC-32 was checked
  std::string route;      // what the sources were assembled from
  // One line that says exactly what was compared, e.g. "verified 24 tensors (0.1 M elements)
  // against the rank files' DTensor placements (24 tensors), independently of the merge plan".
  std::string summary() const;
};

// `atol`: floating-point differences accepted on top (0: bitwise for copies and casts).
ReferenceCheck verify_against_sources(const PlannedMerge& planned, const std::string& hf_dir, double atol = 0);

}  // namespace shardmerge
