// `verify` (verl's `test`): does an HF directory hold exactly what merging this checkpoint
// gives? Every tensor is compared with the checkpoint assembled from its own metadata,
// independently of the merge plan (verify/reference_verify.hpp). A difference is a result, not
// an error: summary["equal"] is false.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "api/options.hpp"
#include "verify/compare.hpp"
#include "verify/reference_verify.hpp"

namespace shardmerge::api {

struct VerifyOptions {
  MergeOptions merge;
  std::string test_hf_dir;
  double atol = 0;  // floating-point differences accepted (0: bitwise)
};

struct VerifyOutcome {
  nlohmann::ordered_json summary;  // what `verify --json` prints
  ReferenceCheck check;
  std::string role_dir;  // the checkpoint directory the local_dir resolved to
};

VerifyOutcome verify(const VerifyOptions& o);

// A comparison as JSON: verify's (`what_was_compared` is its one line on its route) or diff's
// (`what_was_compared` empty).
nlohmann::ordered_json tree_diff_json(const TreeDiff& d, const std::string& what_was_compared);

}  // namespace shardmerge::api
