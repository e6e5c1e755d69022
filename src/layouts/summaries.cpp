#include "layouts/summaries.hpp"

#include <filesystem>

#include "formats/hf_index.hpp"
#include "layouts/megatron.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {

const ZipEntry& TorchFileSummary::record_of(const TensorView& view) const {
  auto it = storage_records.find(view.storage_key);
  if (it == storage_records.end()) throw Error("no storage record data/" + view.storage_key).file(path);
  return it->second;
}

TorchFileSummary summarise_torch_file(const std::string& path) {
  TorchFile f = TorchFile::open(path);
  TorchFileSummary out{f.path(), f.stamp(), {}, {}};
  auto add = [&](const TensorView& v) { out.storage_records.try_emplace(v.storage_key, f.storage_record(v)); };
  for (const StateEntry& e : f.entries()) {
    if (const auto* v = std::get_if<TensorView>(&e.value)) add(*v);
    if (const auto* d = std::get_if<DTensorValue>(&e.value)) add(d->local);
    if (const auto* s = std::get_if<ShardedTensorValue>(&e.value))
      for (const auto& l : s->local_shards) add(l.view);
  }
  out.entries = std::move(f).take_entries();  // not copied: 100k entries are 100+ MB
  return out;
}

SafetensorsSummary summarise_safetensors_file(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  return {path, file_stamp(File::open_read(path)), f.tensors()};
}

HfWeightsSummary summarise_hf_weights(const std::string& dir) {
  const HfWeights w = open_hf_weights(dir);
  HfWeightsSummary out;
  out.dir = dir;
  for (const SafetensorsFile& f : w.files)
    out.files.push_back({f.path(), file_stamp(File::open_read(f.path())), f.tensors()});
  for (const auto& [name, ref] : w.tensors) out.file_of.emplace(name, ref.file);
  return out;
}

AdapterSummary summarise_adapter(const std::string& dir) {
  AdapterSummary out;
  out.dir = dir;
  out.config_path = (fs::path(dir) / "adapter_config.json").string();
  try {
    out.config = nlohmann::json::parse(read_small_file(out.config_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("not valid JSON: ") + e.what()).file(out.config_path);
  }
  const fs::path st = fs::path(dir) / "adapter_model.safetensors";
  const fs::path bin = fs::path(dir) / "adapter_model.bin";
  std::error_code ec;
  if (fs::is_regular_file(st, ec))
    out.weights = summarise_safetensors_file(st.string());
  else if (fs::is_regular_file(bin, ec))
    out.weights = summarise_torch_file(bin.string());
  else
    throw Error("no adapter_model.safetensors or adapter_model.bin").file(dir);
  return out;
}

DcpSummary summarise_dcp(const std::string& dir) {
  return summarise_dcp_items(read_dcp_metadata(dir), [](const std::string&) { return true; });
}

DcpSummary summarise_dcp_items(DcpMetadata metadata, const std::function<bool(const std::string& relative_path)>& in_file) {
  DcpSummary out;
  out.metadata = std::move(metadata);
  const DcpMetadata& meta = out.metadata;
  for (const DcpTensor& t : meta.tensors) {
    if (!merge_reads_items(meta, t)) continue;
    for (const DcpChunk& c : t.chunks) {
      if (!in_file(c.relative_path)) continue;
      const bool stored = c.transforms.empty();
      DcpChunkData data = locate_dcp_chunk_head(meta, t, c);
      out.data_files.try_emplace(c.relative_path, data.stamp);
      (stored ? out.stored_items : out.compressed_items)
          .try_emplace({c.relative_path, c.offset}, DcpItemSummary{std::move(data.view), data.record, data.record_crc32_at});
    }
  }
  return out;
}

}  // namespace shardmerge::layouts
