#include "api/verify.hpp"

#include <filesystem>

#include "shardmerge/error.hpp"

namespace shardmerge::api {

VerifyOutcome verify(const VerifyOptions& o) {
  std::error_code ec;
  if (!std::filesystem::is_directory(o.test_hf_dir, ec))
    throw usage_error("--test_hf_dir " + o.test_hf_dir + ": not a directory");
  if (!(o.atol >= 0)) throw usage_error("--atol must be a non-negative number");
  const PlannedMerge pm = plan_merge(to_request(o.merge));
  VerifyOutcome out;
  out.check = verify_against_sources(pm, o.test_hf_dir, o.atol);
  out.role_dir = pm.role_dir;
  out.summary = tree_diff_json(out.check.diff, out.check.summary());
  return out;
}

nlohmann::ordered_json tree_diff_json(const TreeDiff& d, const std::string& what_was_compared) {
  nlohmann::ordered_json j;
  j["equal"] = d.equal();
  if (!what_was_compared.empty()) j["compared"] = what_was_compared;
  j["missing"] = d.missing;
  j["unexpected"] = d.unexpected;
  j["metadata_mismatch"] = d.mismatched_meta;
  if (!what_was_compared.empty()) j["not_covered"] = d.not_covered;
  if (what_was_compared.empty()) j["compared_as_fp32"] = d.compared_as_fp32;
  auto& v = j["tensors"] = nlohmann::ordered_json::object();
  for (const auto& [name, t] : d.values)
    v[name] = {{"elements", t.elements}, {"mismatched", t.mismatched}, {"max_abs_error", t.max_abs_error}};
  return j;
}

}  // namespace shardmerge::api
