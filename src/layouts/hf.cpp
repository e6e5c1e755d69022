#include "layouts/hf.hpp"

#include <filesystem>

#include "formats/hf_index.hpp"
#include "formats/torch_pt.hpp"
#include "plan/sharding.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {
namespace {

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

void add_safetensors_file(SourceSet& set, const SafetensorsFile& f, const std::string& path) {
  const auto fi = static_cast<uint32_t>(set.files.size());
  const FileStamp stamp = file_stamp(File::open_read(path));
  set.files.push_back({path, stamp.size, stamp});
  for (const auto& t : f.tensors()) {
    SourceTensor s;
    s.name = t.name;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.origin = "whole tensor";
    s.pieces.push_back({fi, t.file_offset, t.dtype, row_major_strides(t.shape), std::vector<int64_t>(t.shape.size(), 0), t.shape});
    set.tensors.push_back(std::move(s));
  }
}

}  // namespace

SourceSet describe_hf_weights(const std::string& dir) {
  HfWeights w = open_hf_weights(dir);
  SourceSet set;
  set.description = "HuggingFace safetensors, " + std::to_string(w.files.size()) + " file(s)";
  for (const auto& f : w.files) add_safetensors_file(set, f, f.path());  // in data order
  // The index decides which file holds a name (a stale shard may hold a stray copy).
  std::erase_if(set.tensors, [&](const SourceTensor& t) {
    auto it = w.tensors.find(t.name);
    return it == w.tensors.end() || w.path_of(it->second) != set.files[t.pieces.front().file].path;
  });
  return set;
}

AdapterSources describe_adapter(const std::string& dir) {
  AdapterSources out;
  out.config_path = (fs::path(dir) / "adapter_config.json").string();
  try {
    out.config = nlohmann::json::parse(read_small_file(out.config_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("not valid JSON: ") + e.what()).file(out.config_path);
  }
  const fs::path st = fs::path(dir) / "adapter_model.safetensors";
  const fs::path bin = fs::path(dir) / "adapter_model.bin";
  std::error_code ec;
  if (fs::is_regular_file(st, ec)) {
    add_safetensors_file(out.tensors, SafetensorsFile::open(st.string()), st.string());
  } else if (fs::is_regular_file(bin, ec)) {
    TorchFile f = TorchFile::open(bin.string());
    out.tensors.files.push_back({bin.string(), f.file_size(), f.stamp()});
    for (const auto& e : f.entries()) {
      const auto* v = std::get_if<TensorView>(&e.value);
      if (!v) throw Error("adapter tensors must be plain tensors").file(bin.string()).tensor(e.name);
      SourceTensor s;
      s.name = e.name;
      s.dtype = v->dtype;
      s.shape = v->size;
      s.origin = "whole tensor";
      s.pieces.push_back(view_to_slice(0, f.storage_offset_in_file(*v), *v, std::vector<int64_t>(v->size.size(), 0)));
      out.tensors.records.push_back(record_check(0, f.storage_record(*v), e.name));
      out.tensors.tensors.push_back(std::move(s));
    }
  } else {
    throw Error("no adapter_model.safetensors or adapter_model.bin").file(dir);
  }
  out.tensors.description = "PEFT adapter";
  return out;
}

}  // namespace shardmerge::layouts
