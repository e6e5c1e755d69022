#include "layouts/summary_codec.hpp"

#include <nlohmann/json.hpp>

#include "shardmerge/error.hpp"

namespace shardmerge {

// nlohmann's conversions for the summary types, found by argument-dependent lookup.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(FileStamp, size, mtime_ns, ctime_ns, inode, device)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ZipEntry, name, data_offset, size, crc32)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TensorView, dtype, storage_key, storage_nbytes, storage_offset, size, stride, negated,
                                   conjugated)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Placement, kind, dim, split_factor, reduce_op)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DeviceMeshInfo, shape, dim_names, coordinate)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DTensorValue, global_size, local, mesh, placements, shard_order)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ShardedTensorValue::LocalShard, offsets, view)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ShardedTensorValue::ShardMeta, offsets, sizes, placement)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ShardedTensorValue, global_size, dtype, local_shards, all_shards)

void to_json(nlohmann::json& j, const StateEntry& e) {
  j = {{"name", e.name}, {"kind", e.value.index()}};
  std::visit([&](const auto& v) { j["value"] = v; }, e.value);
}

void from_json(const nlohmann::json& j, StateEntry& e) {
  e.name = j.at("name").get<std::string>();
  switch (j.at("kind").get<size_t>()) {
    case 0: e.value = j.at("value").get<TensorView>(); break;
    case 1: e.value = j.at("value").get<DTensorValue>(); break;
    case 2: e.value = j.at("value").get<ShardedTensorValue>(); break;
    default: throw nlohmann::json::other_error::create(501, "unknown state entry kind", &j);
  }
}

namespace layouts {

void to_json(nlohmann::json& j, const TorchFileSummary& s) {
  j = {{"path", s.path}, {"stamp", s.stamp}, {"entries", s.entries}, {"records", s.storage_records}};
}
void from_json(const nlohmann::json& j, TorchFileSummary& s) {
  s.path = j.at("path").get<std::string>();
  s.stamp = j.at("stamp").get<FileStamp>();
  s.entries = j.at("entries").get<std::vector<StateEntry>>();
  s.storage_records = j.at("records").get<std::map<std::string, ZipEntry>>();
}

namespace {

using Items = std::map<std::pair<std::string, uint64_t>, DcpItemSummary>;

nlohmann::json items_json(const Items& items) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [at, item] : items) {
    nlohmann::json e = {{"file", at.first}, {"offset", at.second}, {"view", item.view}, {"record", item.record}};
    if (item.crc32_at) e["crc32_at"] = *item.crc32_at;
    out.push_back(std::move(e));
  }
  return out;
}

Items items_from(const nlohmann::json& j) {
  Items out;
  for (const auto& e : j) {
    DcpItemSummary item{e.at("view").get<TensorView>(), e.at("record").get<ZipEntry>(), std::nullopt};
    if (e.contains("crc32_at")) item.crc32_at = e["crc32_at"].get<uint64_t>();
    out.emplace(std::pair{e.at("file").get<std::string>(), e.at("offset").get<uint64_t>()}, std::move(item));
  }
  return out;
}

}  // namespace

std::string encode_summaries(const NodeSummaries& s) {
  const nlohmann::json j = {{"torch_files", s.torch_files},
                            {"dcp_files", s.dcp.data_files},
                            {"dcp_stored", items_json(s.dcp.stored_items)},
                            {"dcp_compressed", items_json(s.dcp.compressed_items)}};
  const std::vector<uint8_t> cbor = nlohmann::json::to_cbor(j);
  return std::string(cbor.begin(), cbor.end());
}

NodeSummaries decode_summaries(const std::string& blob, const std::string& from) {
  try {
    const nlohmann::json j = nlohmann::json::from_cbor(blob);
    NodeSummaries s;
    s.torch_files = j.at("torch_files").get<std::vector<TorchFileSummary>>();
    s.dcp.data_files = j.at("dcp_files").get<std::map<std::string, FileStamp>>();
    s.dcp.stored_items = items_from(j.at("dcp_stored"));
    s.dcp.compressed_items = items_from(j.at("dcp_compressed"));
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw Error("the file summaries from " + from + " are malformed: " + e.what());
  }
}

}  // namespace layouts
}  // namespace shardmerge
