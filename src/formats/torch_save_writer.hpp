// One torch.save file written the way torch 2.15 writes it: a protocol-2 pickle whose tensors
// refer to storage records, plus the archive around them (TorchArchiveWriter). Plain tensors
// and DTensors (on a DeviceMesh pickled once per file) are emitted opcode by opcode; the
// caller emits everything around them with pickle(). Storage bytes stream at write() time from
// the fill functions given to add_storage(), so no tensor is held in memory.
// Used by the synthetic checkpoints and by reshard.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "formats/pickle_writer.hpp"
#include "formats/torch_pt.hpp"
#include "shardmerge/dtype.hpp"

namespace shardmerge {

// A DeviceMesh as a rank of it pickles it: `rank`'s coordinate is row-major over `shape`.
struct MeshOut {
  std::vector<int64_t> shape;
  std::vector<std::string> dim_names;
  // DeviceMesh._dim_group_names: names of the saving job's process groups, which a loading job
  // resolves if it can and otherwise skips with a warning (DeviceMesh.__setstate__).
  std::vector<std::string> group_names;
  int64_t rank = 0;
};

struct DTensorOut {
  DType dtype = DType::F32;
  std::vector<int64_t> global_size;
  std::vector<Placement> placements;  // one per mesh dim: Shard(d) or Replicate()
  std::vector<int64_t> local_size;
  std::string storage_key;            // from add_storage
  int64_t storage_numel = 0;          // may exceed the local size (FSDP2's padded shards)
};

class TorchSaveWriter {
 public:
  TorchSaveWriter() = default;

  pickle::Writer& pickle() { return w_; }
  // GLOBAL module name the first time, BINGET of its memo afterwards; returns the memo index.
  uint32_t global(const std::string& module, const std::string& name);
  // A storage record of `nbytes` bytes, produced at write() time by `fill(buf, n)` called for
  // consecutive pieces. Returns its key ("0", "1", ... in order of creation, as torch numbers them).
  std::string add_storage(uint64_t nbytes, std::function<void(char*, size_t)> fill);
  // torch._utils._rebuild_tensor_v2 over storage `key` (requires_grad False, no hooks).
  void tensor(DType dtype, const std::string& key, int64_t storage_numel, int64_t storage_offset,
              const std::vector<int64_t>& size, const std::vector<int64_t>& stride);
  // A DTensor on `mesh`, its local tensor contiguous over the start of storage `d.storage_key`.
  // Every DTensor of one file must be on the same mesh (it is pickled once, then memoized).
  void dtensor(const DTensorOut& d, const MeshOut& mesh);
  // STOP, then the archive (named after the file's stem, as torch.save names it) with every
  // storage streamed; returns the file's size.
  uint64_t write(const std::string& path);

 private:
  struct Storage {
    uint64_t nbytes;
    std::function<void(char*, size_t)> fill;
  };
  void storage_ref(const std::string& cls, const std::string& key, int64_t numel);
  void mesh(const MeshOut& m);
  void reduce_memoized(std::optional<uint32_t>& memo, const std::string& module, const std::string& name,
                       const std::string& arg);

  pickle::Writer w_;
  std::map<std::string, uint32_t> globals_;
  std::optional<uint32_t> mesh_memo_, layout_memo_, device_memo_;
  std::vector<Storage> storages_;
};

// Row-major strides of `shape`, in elements.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

}  // namespace shardmerge
