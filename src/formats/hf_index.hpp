// The weights of a HuggingFace model directory: model.safetensors, or the shards named by
// model.safetensors.index.json, as one name -> tensor map.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "formats/safetensors.hpp"

namespace shardmerge {

struct HfWeights {
  std::string dir;
  std::vector<SafetensorsFile> files;
  struct Ref {
    size_t file;  // index into files
    const SafetensorsTensor* tensor;
  };
  std::map<std::string, Ref> tensors;  // sorted by name

  const std::string& path_of(const Ref& r) const { return files[r.file].path(); }
};

// Reads every header (not the data). Throws when the index names a missing shard, a shard
// lacks a tensor the index assigns to it, or two files hold the same name.
HfWeights open_hf_weights(const std::string& dir);

}  // namespace shardmerge
