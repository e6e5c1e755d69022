// The checkpoint's tensors as `verify` sees them: assembled element by element from each
// source file's own metadata (DTensor placements and mesh coordinates, ShardedTensor offsets,
// DCP chunk offsets, whole safetensors tensors), by index arithmetic written here and nowhere
// else. It deliberately shares nothing with the merge plan's slice arithmetic (geometry/sharding,
// plan/regions, exec/tasks, exec/gather), so a planning error cannot agree with itself.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"
#include "layouts/layout.hpp"
#include "shardmerge/dtype.hpp"
#include "util/file.hpp"

namespace shardmerge {

// One local tensor (a rank's share, a DCP chunk, a whole tensor). Local element
// (i_0, ..., i_{n-1}) is global element (global_index[0][i_0], ..., global_index[n-1][i_{n-1}])
// and its bytes are at storage_offset_in_file + (storage_offset + sum_k i_k * stride[k]) * size.
struct ReferencePiece {
  uint32_t file = 0;  // index into ReferenceSources::files
  uint64_t storage_offset_in_file = 0;
  int64_t storage_offset = 0;
  std::vector<int64_t> stride;
  std::vector<std::vector<int64_t>> global_index;
  std::string holder;              // for messages: "rank 3", "chunk at [0, 64]"
  std::optional<ZipEntry> record;  // the zip record of a torch.save storage (CRC-checked); none in safetensors
};

struct ReferenceTensor {
  std::string name;  // as saved
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<ReferencePiece> pieces;
};

struct ReferenceSources {
  std::vector<std::string> files;
  std::vector<ReferenceTensor> tensors;  // in checkpoint order
  std::map<std::string, size_t> kinds;   // what the metadata was, e.g. "DTensor placements" -> tensors
  std::string route() const;             // "the rank files' DTensor placements (12 source tensors), ..."
};

// verl FSDP rank files. Replicas (HSDP, Replicate mesh dims, plain tensors on every rank) are
// the pieces whose global indices equal a lower rank's: they are read once, from that rank.
ReferenceSources reference_from_fsdp(const layouts::FsdpRole& role);
// A torch_dist (DCP) directory: every model chunk of `.metadata` at its offsets. Compressed
// items are decoded into `scratch_dir`.
ReferenceSources reference_from_dcp(const std::string& dist_ckpt_dir, const std::string& scratch_dir);
// Legacy Megatron per-rank files (model/mp_rank_<tp>[_<pp>][_<ep>]/model.pt), TP/PP/VPP/EP
// reassembled by the rules of the legacy merger (research notes, verl-megatron §5.3/§5.4) into
// per-layer Megatron names; `config` is the HF config.json (expert counts). verify/reference_legacy.cpp.
ReferenceSources reference_from_megatron_legacy(const layouts::MegatronRole& role,
                                                const nlohmann::ordered_json& config);
// Whole tensors of safetensors files (HF weights, PEFT adapters); appended to `into`.
void add_safetensors_reference(ReferenceSources& into, const std::vector<std::string>& paths, const std::string& kind);

// A torch.save storage view as a piece whose dim d holds `global_index[d]`; checks the sizes.
ReferencePiece torch_piece(uint32_t file, const ZipEntry& record, const TensorView& view,
                           std::vector<std::vector<int64_t>> global_index, std::string holder);
// [first, first + n)
std::vector<int64_t> index_range(int64_t first, int64_t n);

// Reads every zip record that holds a piece's bytes, once, in bounded blocks, and compares its
// CRC-32 with the zip directory's; a mismatch is an Error naming file, record and tensor.
// Returns the number of records checked.
uint64_t check_record_crcs(const ReferenceSources& sources);

// Reads elements of one ReferenceTensor by global index, through a small read window per piece
// (bounded memory: nothing is held whole). Not thread-safe; one per thread.
class ElementFetcher {
 public:
  ElementFetcher(const ReferenceSources& sources, const ReferenceTensor& tensor);
  // Copies element `index` (one global index per dim) into `out` and returns how many pieces
  // hold it: 1 when the sources cover it exactly once, 0 for a gap, more for an overlap.
  int fetch(const int64_t* index, uint8_t* out);
  // `count` consecutive elements along the last dim from `index` (a 0-d tensor: its one
  // element) into `out`; returns how many of them are not held by exactly one piece.
  uint64_t fetch_run(const int64_t* index, int64_t count, uint8_t* out);

 private:
  // Global index -> local index along one dim of one piece: a range, or a table (-1: not held).
  struct DimMap {
    int64_t begin = 0, size = 0;
    std::vector<int32_t> table;
    int64_t local(int64_t global) const;
  };
  struct Window {
    uint64_t begin = 0;
    std::vector<uint8_t> bytes;
  };
  const uint8_t* bytes_at(size_t piece, uint64_t offset);
  void copy_element(size_t piece, int64_t element, uint8_t* out);
  void copy_elements(size_t piece, int64_t element, int64_t n, uint8_t* out);  // dense in storage

  const ReferenceTensor& tensor_;
  std::vector<std::shared_ptr<File>> files_;            // per piece
  std::vector<std::vector<DimMap>> dims_;               // per piece, per dim
  std::vector<Window> windows_;                         // per piece
  std::vector<std::pair<size_t, int64_t>> candidates_;  // fetch_run: pieces holding the row, row start
  std::vector<uint16_t> holders_;                       // fetch_run: holders per element
  size_t element_size_;
  uint64_t window_bytes_;
};

}  // namespace shardmerge
