// libFuzzer target: the restricted pickle VM with torch's reconstructors, then the tensor
// collector, on arbitrary bytes. A shardmerge::Error is the expected way to reject input;
// anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "formats/torch_pt.hpp"
#include "shardmerge/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto doc = shardmerge::parse_torch_pickle(std::string_view(reinterpret_cast<const char*>(data), size));
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
