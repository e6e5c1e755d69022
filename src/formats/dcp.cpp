#include "formats/dcp.hpp"

#include <zstd.h>

#include <filesystem>

#include "formats/torch_item_head.hpp"
#include "formats/zip.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"
#include "util/shape.hpp"
#include "util/zstd_frame.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

using pickle::Kind;
using pickle::Value;

constexpr uint64_t kMaxMetadataBytes = 2ull << 30;

// Dataclasses pickle their fields as a BUILD dict.
const Value* field(const Value* obj, std::string_view name) {
  if (!obj || obj->kind != Kind::Object || !obj->state) return nullptr;
  if (obj->state->kind == Kind::Dict) return obj->state->get(name);
  return nullptr;
}

const Value& require(const Value* obj, std::string_view name, const std::string& what) {
  if (const Value* v = field(obj, name)) return *v;
  throw Error("DCP metadata: " + what + " has no '" + std::string(name) + "'");
}

std::vector<int64_t> ints(const Value& v, const std::string& what) {
  std::vector<int64_t> out;
  for (const Value* x : v.as_sequence()) {
    if (x->kind != Kind::Int) throw Error("DCP metadata: " + what + " holds a " + pickle::kind_name(x->kind));
    out.push_back(x->integer);
  }
  return out;
}

DType tensor_dtype(const Value& props, const std::string& fqn) {
  // TensorProperties pickles as a tuple (dtype, layout, requires_grad, memory_format, pin_memory[, ...]).
  const Value* dtype = nullptr;
  if (props.state && props.state->kind == Kind::Tuple && !props.state->items.empty()) dtype = props.state->items[0];
  if (!dtype) dtype = field(&props, "dtype");
  if (dtype && dtype->kind == Kind::Global && dtype->text == "torch")
    if (auto t = dtype_from_torch_name(dtype->name)) return *t;
  throw Error("DCP metadata: tensor '" + fqn + "' has no dtype we know");
}

std::string key_of(const std::string& fqn, const std::vector<int64_t>& offsets) {
  return fqn + "@" + shape_string(offsets);
}

// A decompressed item is a torch.save archive of the chunk's tensor: its storage plus a few
// small records (data.pkl, byteorder, version, ...), zip headers and 64-byte alignment
// padding, about 1.6 kB in torch 2.x. More than this beyond the storage is not a chunk.
constexpr uint64_t kItemArchiveOverhead = 1 << 20;

// The most bytes the torch.save archive of `chunk` can take: what .metadata declares.
uint64_t declared_item_bound(const DcpTensor& tensor, const DcpChunk& chunk) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(element_count(chunk.sizes), uint64_t{dtype_size(tensor.dtype)}, &bytes) ||
      __builtin_add_overflow(bytes, kItemArchiveOverhead, &bytes))
    throw Error("chunk of shape " + shape_string(chunk.sizes) + " has more than 2^64 bytes");
  return bytes;
}

// Streams the one zstd frame in [offset, offset + length) of `in` into a new file, writing no
// more than `max_output` bytes (a frame that decompresses to more is refused as it streams,
// so a small frame cannot fill the disk).
void zstd_decompress_to(const File& in, uint64_t offset, uint64_t length, const std::string& out_path,
                        uint64_t max_output) {
  ZstdFrameReader frame(in, offset, length);
  const std::string bound = " bytes that a torch.save of the chunk .metadata describes can take";
  if (const auto declared = frame.declared_size(); declared && *declared > max_output)
    throw frame.fail("its frame declares " + std::to_string(*declared) + " bytes, more than the " + std::to_string(max_output) + bound);
  File out = File::create(out_path, /*overwrite=*/true);
  std::string buf(ZSTD_DStreamOutSize(), '\0');
  while (const size_t n = frame.read(buf.data(), buf.size())) {
    if (frame.decoded() > max_output) throw frame.fail("decompresses to more than the " + std::to_string(max_output) + bound);
    out.write_exact(frame.decoded() - n, buf.data(), n);
  }
  if (const auto declared = frame.declared_size(); declared && *declared != frame.decoded())
    throw frame.fail("its frame declares " + std::to_string(*declared) + " bytes but holds " + std::to_string(frame.decoded()));
}

}  // namespace

DcpMetadata read_dcp_metadata(const std::string& dir) {
  const std::string path = (fs::path(dir) / ".metadata").string();
  try {
    return parse_dcp_metadata(read_small_file(path, kMaxMetadataBytes), dir);
  } catch (Error& e) {
    e.file(path);
    throw;
  }
}

DcpMetadata parse_dcp_metadata(std::string_view data, const std::string& dir) {
  DcpMetadata meta;
  meta.dir = dir;
  const pickle::Document doc = parse_torch_pickle(data);
  const Value& root = doc.root();
  if (!root.is_instance_of("torch.distributed.checkpoint.metadata", "Metadata"))
    throw Error("not a torch.distributed.checkpoint Metadata pickle");

  std::map<std::string, const Value*> storage;  // "fqn@[offsets]" -> _StorageInfo
  for (const auto& [k, v] : require(&root, "storage_data", "Metadata").entries) {
    const std::string fqn = require(k, "fqn", "MetadataIndex").as_str();
    const Value* off = field(k, "offset");
    storage[key_of(fqn, off && off->kind != Kind::None ? ints(*off, "MetadataIndex.offset") : std::vector<int64_t>{})] = v;
  }
  if (const Value* mcore = field(&root, "mcore_data"); mcore && mcore->kind == Kind::Dict)
    for (const auto& [k, v] : mcore->entries)
      if (k->kind == Kind::Str && v->kind == Kind::Dict)
        if (const Value* shape = v->get("nd_reformulated_orig_global_shape"); shape && shape->is_sequence())
          meta.reformulated_shapes[k->text] = ints(*shape, "nd_reformulated_orig_global_shape");

  for (const auto& [k, v] : require(&root, "state_dict_metadata", "Metadata").entries) {
    const std::string fqn = k->as_str();
    if (v->is_instance_of("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")) {
      meta.bytes_items.push_back(fqn);
      continue;
    }
    if (!v->is_instance_of("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"))
      throw Error("DCP metadata: entry '" + fqn + "' is neither tensor nor bytes metadata");
    DcpTensor t;
    t.fqn = fqn;
    t.dtype = tensor_dtype(require(v, "properties", "TensorStorageMetadata"), fqn);
    t.size = ints(require(v, "size", "TensorStorageMetadata"), "size");
    for (const Value* c : require(v, "chunks", "TensorStorageMetadata").as_sequence()) {
      DcpChunk chunk;
      chunk.offsets = ints(require(c, "offsets", "ChunkStorageMetadata"), "chunk offsets");
      chunk.sizes = ints(require(c, "sizes", "ChunkStorageMetadata"), "chunk sizes");
      auto it = storage.find(key_of(fqn, chunk.offsets));
      if (it == storage.end())
        throw Error("DCP metadata: no storage entry for the chunk at " + shape_string(chunk.offsets)).tensor(fqn);
      const Value* info = it->second;
      chunk.relative_path = require(info, "relative_path", "_StorageInfo").as_str();
      if (chunk.relative_path.find('/') != std::string::npos || chunk.relative_path.find("..") != std::string::npos)
        throw Error("DCP metadata: item path '" + chunk.relative_path + "' leaves the checkpoint directory").tensor(fqn);
      chunk.offset = static_cast<uint64_t>(require(info, "offset", "_StorageInfo").as_int());
      chunk.length = static_cast<uint64_t>(require(info, "length", "_StorageInfo").as_int());
      if (const Value* tr = field(info, "transform_descriptors"); tr && tr->kind != Kind::None)
        for (const Value* d : tr->as_sequence()) chunk.transforms.push_back(d->as_str());
      t.chunks.push_back(std::move(chunk));
    }
    meta.tensors.push_back(std::move(t));
  }
  return meta;
}

DcpItemCoding item_coding(const DcpChunk& chunk) {
  if (chunk.transforms.empty()) return DcpItemCoding::Stored;
  if (chunk.transforms.size() != 1 || chunk.transforms[0].rfind("stream.zstd", 0) != 0)
    throw Error("item uses storage transform '" + chunk.transforms[0] + "', which shardmerge does not know");
  return DcpItemCoding::Zstd;
}

void check_item_within(const DcpChunk& chunk, uint64_t file_size) {
  if (chunk.offset > file_size || chunk.length > file_size - chunk.offset)
    throw Error("item [" + std::to_string(chunk.offset) + ", +" + std::to_string(chunk.length) +
                ") runs past the end of the file (truncated?)");
}

namespace {

// Checks a chunk's tensor, as its item's pickle describes it, against what .metadata says.
void check_chunk_view(const TensorView& view, const DcpTensor& tensor, const DcpChunk& chunk) {
  if (view.dtype != tensor.dtype)
    throw Error("chunk is " + std::string(dtype_name(view.dtype)) + " but .metadata says " + std::string(dtype_name(tensor.dtype)));
  if (view.size != chunk.sizes)
    throw Error("chunk tensor has shape " + shape_string(view.size) + " but .metadata says " + shape_string(chunk.sizes));
}

// The chunk's tensor in the torch.save archive at [base, base + length) of `file`, checked
// against what .metadata says of it.
DcpChunkData read_item_archive(const File& file, uint64_t base, uint64_t length, const DcpTensor& tensor,
                               const DcpChunk& chunk) {
  DcpChunkData out;
  out.path = file.path();
  out.stamp = file_stamp(file);
  const TorchArchive archive = TorchArchive::read(file, base, length);
  const ZipEntry& pkl = archive.record("data.pkl");
  const pickle::Document doc = parse_torch_pickle(read_record_checked(file, pkl));
  const std::vector<StateEntry> entries = collect_tensors(doc.root());
  if (entries.size() != 1 || !entries[0].is_plain()) throw Error("item is not a torch.save of one plain tensor");
  out.view = std::get<TensorView>(entries[0].value);
  const ZipEntry& rec = archive.record("data/" + out.view.storage_key);
  if (rec.size != out.view.storage_nbytes)
    throw Error("item's storage record has " + std::to_string(rec.size) + " bytes, its pickle says " +
                std::to_string(out.view.storage_nbytes));
  out.record = rec;
  check_chunk_view(out.view, tensor, chunk);
  return out;
}

// Opens the chunk's .distcp, checks that its item lies within, and runs `read(file, coding)`;
// errors name the tensor and the file.
template <class Read>
DcpChunkData read_chunk(const DcpMetadata& meta, const DcpTensor& tensor, const DcpChunk& chunk, Read&& read) {
  const std::string path = (fs::path(meta.dir) / chunk.relative_path).string();
  try {
    const File file = File::open_read(path);
    check_item_within(chunk, file.size());
    return read(file, item_coding(chunk));
  } catch (Error& e) {
    e.tensor(tensor.fqn).file(path);
    throw;
  }
}

}  // namespace

DcpChunkData locate_dcp_chunk(const DcpMetadata& meta, const DcpTensor& tensor, const DcpChunk& chunk,
                              const std::string& scratch_dir) {
  return read_chunk(meta, tensor, chunk, [&](const File& file, DcpItemCoding coding) {
    if (coding == DcpItemCoding::Stored) return read_item_archive(file, chunk.offset, chunk.length, tensor, chunk);
    fs::create_directories(scratch_dir);
    const std::string decoded = (fs::path(scratch_dir) / (chunk.relative_path + "." + std::to_string(chunk.offset) + ".item")).string();
    zstd_decompress_to(file, chunk.offset, chunk.length, decoded, declared_item_bound(tensor, chunk));
    const File item = File::open_read(decoded);
    return read_item_archive(item, 0, item.size(), tensor, chunk);
  });
}

DcpChunkData locate_dcp_chunk_head(const DcpMetadata& meta, const DcpTensor& tensor, const DcpChunk& chunk) {
  return read_chunk(meta, tensor, chunk, [&](const File& file, DcpItemCoding coding) -> DcpChunkData {
    if (coding == DcpItemCoding::Stored) return read_item_archive(file, chunk.offset, chunk.length, tensor, chunk);
    ZstdFrameReader frame(file, chunk.offset, chunk.length);
    TorchItemHead head;
    try {
      head = read_torch_item_head([&](char* buf, size_t n) { return frame.read(buf, n); });
    } catch (Error& e) {
      throw e.offset(chunk.offset);
    }
    check_chunk_view(head.view, tensor, chunk);
    return {file.path(), file_stamp(file), head.storage, head.view, head.crc32_at};
  });
}

}  // namespace shardmerge
