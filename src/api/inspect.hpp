// `inspect`: what a path (run root, step root, role directory, HF model, PEFT adapter, single
// torch.save or safetensors file) holds and the commands to run next, as a JSON report. Reads
// names, small JSON files, pickles and headers only, never tensor data. A path that holds none of
// these gives kind "unknown" and a warning saying so.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace shardmerge::api {

// `with_tensors`: a "tensor_list" entry with every tensor's name, dtype, shape, placement, bytes.
nlohmann::ordered_json inspect(const std::string& path, bool with_tensors);

}  // namespace shardmerge::api
