// Per-file summaries: what planning needs of each source file, read from its headers and
// pickles (never tensor data), as plain data. Summarising is the only step of a layout that
// touches files; combining summaries into a SourceSet (layouts/<backend>.cpp) is pure, so a
// plan can be built from summaries alone (unit tests; later, summaries sent between nodes).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "formats/dcp.hpp"
#include "formats/safetensors.hpp"
#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge::layouts {

// A torch.save file: its tensors (name, dtype, shapes, strided view, DTensor placements and
// mesh, ShardedTensor offsets) and the zip records that hold their storages.
struct TorchFileSummary {
  std::string path;
  FileStamp stamp;  // size included
  std::vector<StateEntry> entries;
  std::map<std::string, ZipEntry> storage_records;  // storage key -> record (offset, size, CRC-32, name)

  // The record holding a view's storage; throws an Error naming the file when there is none.
  const ZipEntry& record_of(const TensorView& view) const;
};

struct SafetensorsSummary {
  std::string path;
  FileStamp stamp;
  std::vector<SafetensorsTensor> tensors;  // in data order
};

// A HuggingFace weights directory: every safetensors header, and which file the index (or the
// single model.safetensors) assigns each name to.
struct HfWeightsSummary {
  std::string dir;
  std::vector<SafetensorsSummary> files;  // in data order
  std::map<std::string, size_t> file_of;  // tensor name -> index into files
};

struct AdapterSummary {
  std::string dir;
  std::string config_path;
  nlohmann::json config;  // adapter_config.json
  std::variant<SafetensorsSummary, TorchFileSummary> weights;
};

// The torch.save archive of a DCP item: the chunk as its pickle describes it and its storage
// record, at absolute offsets in the .distcp for a stored item, in decoded bytes for a
// compressed one (of which only the archive's head is decoded).
struct DcpItemSummary {
  TensorView view;
  ZipEntry record;
  std::optional<uint64_t> crc32_at = std::nullopt;  // where record.crc32 is when past the decoded head (it is then 0)
};

// A DCP directory: `.metadata`, the .distcp files that hold model chunks, and the archive of
// every item of those chunks.
struct DcpSummary {
  DcpMetadata metadata;                         // metadata.dir is the directory
  std::map<std::string, FileStamp> data_files;  // relative path -> stamp
  std::map<std::pair<std::string, uint64_t>, DcpItemSummary> stored_items;      // (relative path, item offset)
  std::map<std::pair<std::string, uint64_t>, DcpItemSummary> compressed_items;  // the same for zstd items
};

TorchFileSummary summarise_torch_file(const std::string& path);
SafetensorsSummary summarise_safetensors_file(const std::string& path);
// Validates the index against the headers (missing shards, names in two files).
HfWeightsSummary summarise_hf_weights(const std::string& dir);
AdapterSummary summarise_adapter(const std::string& dir);
// Reads the items of the chunks of the tensors a merge reads (megatron.hpp, merge_reads_items).
DcpSummary summarise_dcp(const std::string& dir);
// The same over metadata already read (metadata.dir: where its .distcp files are), for the chunks
// in the files `in_file` accepts (relative paths): a node summarises the files it holds.
DcpSummary summarise_dcp_items(DcpMetadata metadata, const std::function<bool(const std::string& relative_path)>& in_file);

}  // namespace shardmerge::layouts
