#include "formats/hf_index.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace shardmerge {

HfWeights open_hf_weights(const std::string& dir) {
  HfWeights w;
  w.dir = dir;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;
  std::set<std::string> file_names;
  std::error_code ec;
  if (fs::is_regular_file(index_path, ec)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_small_file(index_path.string()));
      for (const auto& [name, file] : index.at("weight_map").items()) {
        weight_map[name] = file.get<std::string>();
        file_names.insert(file.get<std::string>());
      }
    } catch (const nlohmann::json::exception& e) {
      throw Error(std::string("not a valid safetensors index: ") + e.what()).file(index_path.string());
    }
  } else if (fs::is_regular_file(fs::path(dir) / "model.safetensors", ec)) {
    file_names.insert("model.safetensors");
  } else {
    throw Error("no model.safetensors or model.safetensors.index.json").file(dir);
  }
  for (const auto& name : file_names) {
    if (name.find('/') != std::string::npos || name.find("..") != std::string::npos)
      throw Error("index names a shard outside the directory: '" + name + "'").file(index_path.string());
    w.files.push_back(SafetensorsFile::open((fs::path(dir) / name).string()));
  }
  // SafetensorsFile owns its tensors; now that `files` no longer grows, pointers are stable.
  for (size_t i = 0; i < w.files.size(); ++i) {
    const std::string base = fs::path(w.files[i].path()).filename().string();
    for (const auto& t : w.files[i].tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(t.name);
        if (it == weight_map.end() || it->second != base) continue;  // the index decides where a tensor lives
      }
      if (!w.tensors.emplace(t.name, HfWeights::Ref{i, &t}).second)
        throw Error("tensor '" + t.name + "' is stored in two files").file(dir);
    }
  }
  for (const auto& [name, file] : weight_map)
    if (!w.tensors.count(name)) throw Error("index assigns '" + name + "' to " + file + ", which does not hold it").file(dir);
  return w;
}

}  // namespace shardmerge
