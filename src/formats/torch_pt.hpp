// torch.save files as data: which tensors a file holds, their dtypes, shapes and strides,
// and where their bytes are. DTensor (FSDP2, FSDP1 with a device mesh) and ShardedTensor
// (FSDP1 without one) are decoded into their local pieces and global metadata. Nothing is
// executed and no tensor bytes are read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "formats/pickle.hpp"
#include "formats/zip.hpp"
#include "shardmerge/dtype.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge {

// A strided view into one storage record (`<archive>/data/<key>`) of a torch.save archive.
struct TensorView {
  DType dtype = DType::F32;
  std::string storage_key;
  uint64_t storage_nbytes = 0;  // from the persistent id; the record must be exactly this big
  int64_t storage_offset = 0;   // in elements
  std::vector<int64_t> size;
  std::vector<int64_t> stride;  // in elements
  // torch's lazy .neg() / .conj() bits: the stored bytes are not negated (conjugated).
  // collect_tensors refuses views with either bit set.
  bool negated = false;
  bool conjugated = false;

  uint64_t numel() const;
  bool is_contiguous() const;  // row-major dense
};

enum class PlacementKind { Shard, StridedShard, Replicate, Partial };

struct Placement {
  PlacementKind kind = PlacementKind::Replicate;
  int64_t dim = 0;           // Shard / StridedShard
  int64_t split_factor = 1;  // StridedShard
  std::string reduce_op;     // Partial
  std::string to_string() const;  // "Shard(0)", "_StridedShard(0, sf=2)", "Replicate()", "Partial(sum)"
};

struct DeviceMeshInfo {
  std::vector<int64_t> shape;
  std::vector<std::string> dim_names;  // empty when the mesh has none
  std::vector<int64_t> coordinate;     // this rank's coordinate; empty when the pickle lacks it
  // Rank `rank`'s coordinate: as the pickle records it, else the rank's row-major position in
  // the mesh (how torch and verl number meshes: arange(W).view(shape)).
  std::vector<int64_t> coordinate_of(int64_t rank) const;
};

struct DTensorValue {
  std::vector<int64_t> global_size;
  TensorView local;
  DeviceMeshInfo mesh;
  std::vector<Placement> placements;  // one per mesh dim
  // DTensorSpec.shard_order (torch >= 2.9): per sharded tensor dim, the mesh dims in the
  // order they shard it. Empty means left to right, torch's default.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> shard_order;
};

// FSDP1 SHARDED_STATE_DICT without a device mesh (torch.distributed._shard).
struct ShardedTensorValue {
  struct LocalShard {
    std::vector<int64_t> offsets;
    TensorView view;
  };
  struct ShardMeta {
    std::vector<int64_t> offsets;
    std::vector<int64_t> sizes;
    std::string placement;  // e.g. "rank:1/cpu"
  };
  std::vector<int64_t> global_size;
  DType dtype = DType::F32;
  std::vector<LocalShard> local_shards;
  std::vector<ShardMeta> all_shards;
};

struct StateEntry {
  std::string name;  // dotted path in the saved object ("model.layers.0.mlp.up_proj.weight")
  std::variant<TensorView, DTensorValue, ShardedTensorValue> value;

  DType dtype() const;
  std::vector<int64_t> global_shape() const;
  bool is_plain() const { return std::holds_alternative<TensorView>(value); }
};

class TorchFile {
 public:
  // Reads the zip directory and data.pkl of `path`; throws an Error naming the file.
  static TorchFile open(const std::string& path);

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return stamp_.size; }
  const FileStamp& stamp() const { return stamp_; }  // when it was opened
  const std::vector<StateEntry>& entries() const { return entries_; }
  std::vector<StateEntry> take_entries() && { return std::move(entries_); }
  // Absolute file offset of the first byte of a view's storage record.
  uint64_t storage_offset_in_file(const TensorView& view) const;
  // The zip record that holds a view's storage (its CRC-32 is checked as the merge reads it).
  const ZipEntry& storage_record(const TensorView& view) const;

 private:
  std::string path_;
  FileStamp stamp_;
  std::unordered_map<std::string, ZipEntry> storage_records_;  // key -> record
  std::vector<StateEntry> entries_;
};

// The pickle layer of a torch.save file, exposed for tests and for DCP items (whose chunks are
// embedded torch.save archives): parse with torch's reconstructors on the allowlist, then
// collect every tensor reachable from the root, named by its dotted path.
pickle::Document parse_torch_pickle(std::string_view data);
std::vector<StateEntry> collect_tensors(const pickle::Value& root);
// parse_torch_pickle then collect_tensors, streamed (the same entries, in bounded memory).
std::vector<StateEntry> read_state_entries(std::string_view pickle_bytes);
// One value of such a parse decoded as collect_tensors decodes it (named `name`), or nullopt
// when it is no tensor.
std::optional<StateEntry> tensor_entry(const pickle::Value& v, const std::string& name);

}  // namespace shardmerge
