// libFuzzer target: the restricted pickle VM with torch's reconstructors, then the tensor
// collector, on arbitrary bytes; and the streamed reading of the same bytes, which must give
// the same entries (or fail too). A shardmerge::Error is the expected way to reject input;
// anything else (a crash, a sanitizer report, another exception, a disagreement) is a bug.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <cstdlib>

#include "formats/torch_pt.hpp"
#include "shardmerge/error.hpp"

namespace {

// The names and shapes of `entries`, or "error" when reading them failed.
std::vector<std::string> summary(const std::vector<shardmerge::StateEntry>* entries) {
  if (!entries) return {"error"};
  std::vector<std::string> out;
  for (const auto& e : *entries) {
    std::string s = e.name;
    for (int64_t d : e.global_shape()) s += "," + std::to_string(d);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::optional<std::vector<shardmerge::StateEntry>> whole, streamed;
  try {
    whole = shardmerge::collect_tensors(shardmerge::parse_torch_pickle(bytes).root());
  } catch (const shardmerge::Error&) {
  }
  try {
    streamed = shardmerge::read_state_entries(bytes);
  } catch (const shardmerge::Error&) {
  }
  if (summary(whole ? &*whole : nullptr) != summary(streamed ? &*streamed : nullptr)) std::abort();
  try {
    const auto doc = shardmerge::parse_torch_pickle(bytes);
    for (const auto& entry : shardmerge::collect_tensors(doc.root())) {
      // Touch what downstream code derives from an entry, so overflow there is found too.
      (void)entry.dtype();
      (void)entry.global_shape();
      if (const auto* view = std::get_if<shardmerge::TensorView>(&entry.value)) {
        (void)view->numel();
        (void)view->is_contiguous();
      }
    }
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
