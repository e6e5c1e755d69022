#include "verify/reference_assembly.hpp"

#include <algorithm>
#include <numeric>
#include <unordered_map>

#include "formats/dcp.hpp"
#include "formats/safetensors.hpp"
#include "formats/torch_pt.hpp"
#include "layouts/megatron.hpp"
#include "shardmerge/error.hpp"
#include "util/crc32.hpp"
#include "util/shape.hpp"

namespace shardmerge {
namespace {

// The global indices of a box [offsets, offsets + sizes): one list per dim.
std::vector<std::vector<int64_t>> box_indices(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  std::vector<std::vector<int64_t>> out;
  for (size_t d = 0; d < sizes.size(); ++d) out.push_back(index_range(offsets.at(d), sizes[d]));
  return out;
}

// torch.chunk on a list: pieces of ceil(L / n) entries; the last ones are short or empty.
std::vector<int64_t> chunk_list(const std::vector<int64_t>& list, int64_t n, int64_t k) {
  const size_t each = (list.size() + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  const size_t lo = std::min(list.size(), static_cast<size_t>(k) * each);
  const size_t hi = std::min(list.size(), static_cast<size_t>(k + 1) * each);
  return {list.begin() + static_cast<std::ptrdiff_t>(lo), list.begin() + static_cast<std::ptrdiff_t>(hi)};
}

// The global indices a DTensor's local tensor holds along each dim, following torch's
// placement semantics one mesh dim at a time: Shard(d) keeps chunk `coordinate` of n of the
// indices still held; _StridedShard(d, sf) cuts them into sf chunks, keeps chunk `coordinate`
// of n of each and concatenates those; Replicate keeps everything.
std::vector<std::vector<int64_t>> dtensor_indices(const DTensorValue& d, const std::vector<int64_t>& coordinate) {
  const size_t ndim = d.global_size.size();
  std::vector<std::vector<int64_t>> mesh_dims_of(ndim);  // tensor dim -> mesh dims that shard it, in order
  for (size_t m = 0; m < d.placements.size(); ++m) {
    const Placement& p = d.placements[m];
    if (p.kind == PlacementKind::Partial) throw Error("placement " + p.to_string() + " holds unreduced partial sums");
    if (p.kind == PlacementKind::Replicate) continue;
    if (p.dim < 0 || static_cast<size_t>(p.dim) >= ndim)
      throw Error("placement " + p.to_string() + " names a missing dim");
    mesh_dims_of[static_cast<size_t>(p.dim)].push_back(static_cast<int64_t>(m));
  }
  for (const auto& [dim, order] : d.shard_order)
    if (dim >= 0 && static_cast<size_t>(dim) < ndim) mesh_dims_of[static_cast<size_t>(dim)] = order;
  std::vector<std::vector<int64_t>> out;
  for (size_t t = 0; t < ndim; ++t) {
    std::vector<int64_t> held = index_range(0, d.global_size[t]);
    for (int64_t m : mesh_dims_of[t]) {
      const Placement& p = d.placements.at(static_cast<size_t>(m));
      const int64_t n = d.mesh.shape.at(static_cast<size_t>(m)), c = coordinate.at(static_cast<size_t>(m));
      if (p.kind == PlacementKind::Shard) {
        held = chunk_list(held, n, c);
        continue;
      }
      std::vector<int64_t> mine;
      for (int64_t j = 0; j < p.split_factor; ++j) {
        const std::vector<int64_t> part = chunk_list(chunk_list(held, p.split_factor, j), n, c);
        mine.insert(mine.end(), part.begin(), part.end());
      }
      held = std::move(mine);
    }
    out.push_back(std::move(held));
  }
  return out;
}

}  // namespace

ReferencePiece torch_piece(uint32_t file, const ZipEntry& record, const TensorView& view,
                           std::vector<std::vector<int64_t>> global_index, std::string holder) {
  if (view.negated || view.conjugated) throw Error("tensor carries torch's lazy neg/conj bit");
  if (global_index.size() != view.size.size())
    throw Error("local tensor has " + std::to_string(view.size.size()) + " dims, its metadata " +
                std::to_string(global_index.size()));
  for (size_t d = 0; d < view.size.size(); ++d)
    if (static_cast<int64_t>(global_index[d].size()) != view.size[d])
      throw Error("local size " + std::to_string(view.size[d]) + " on dim " + std::to_string(d) +
                  " but its metadata places " + std::to_string(global_index[d].size()) + " elements");
  return {file,  record.data_offset, view.storage_offset, view.stride, std::move(global_index), std::move(holder),
          record};
}

std::vector<int64_t> index_range(int64_t first, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::iota(v.begin(), v.end(), first);
  return v;
}

namespace {

// A piece whose indices equal an earlier one's is a replica of it.
void add_unless_replica(ReferenceTensor& t, ReferencePiece p) {
  for (const ReferencePiece& kept : t.pieces)
    if (kept.global_index == p.global_index) return;
  t.pieces.push_back(std::move(p));
}

}  // namespace

std::string ReferenceSources::route() const {
  std::string s;
  for (const auto& [kind, n] : kinds)
    s += (s.empty() ? "" : ", ") + kind + " (" + std::to_string(n) + " source tensors)";
  return s;
}

ReferenceSources reference_from_fsdp(const layouts::FsdpRole& role) {
  ReferenceSources out;
  std::unordered_map<std::string, size_t> index_of;
  for (size_t rank = 0; rank < role.rank_files.size(); ++rank) {
    const std::string& path = role.rank_files[rank];
    if (path.empty()) continue;
    const TorchFile file = TorchFile::open(path);
    const auto fi = static_cast<uint32_t>(out.files.size());
    out.files.push_back(path);
    const std::string holder = "rank " + std::to_string(rank);
    for (const StateEntry& e : file.entries()) {
      try {
        auto [it, fresh] = index_of.try_emplace(e.name, out.tensors.size());
        if (fresh) out.tensors.push_back({e.name, e.dtype(), e.global_shape(), {}});
        ReferenceTensor& t = out.tensors[it->second];
        if (t.dtype != e.dtype() || t.shape != e.global_shape())
          throw Error("rank files disagree on its dtype or global shape");
        std::string kind;
        if (const auto* v = std::get_if<TensorView>(&e.value)) {
          add_unless_replica(t, torch_piece(fi, file.storage_record(*v), *v,
                                            box_indices(std::vector<int64_t>(v->size.size(), 0), v->size), holder));
          kind = "plain tensors";
        } else if (const auto* d = std::get_if<DTensorValue>(&e.value)) {
          add_unless_replica(
              t, torch_piece(fi, file.storage_record(d->local), d->local,
                             dtensor_indices(*d, d->mesh.coordinate_of(static_cast<int64_t>(rank))), holder));
          kind = "DTensor placements";
        } else {
          for (const auto& local : std::get<ShardedTensorValue>(e.value).local_shards)
            add_unless_replica(t, torch_piece(fi, file.storage_record(local.view), local.view,
                                              box_indices(local.offsets, local.view.size), holder));
          kind = "ShardedTensor offsets";
        }
        if (fresh) ++out.kinds["the rank files' " + kind];
      } catch (Error& err) {
        throw err.tensor(e.name).file(path);
      }
    }
  }
  return out;
}

ReferenceSources reference_from_dcp(const std::string& dir, const std::string& scratch_dir) {
  ReferenceSources out;
  const DcpMetadata meta = read_dcp_metadata(dir);
  std::unordered_map<std::string, uint32_t> file_index;
  for (const DcpTensor& t : meta.tensors) {
    if (layouts::is_training_state(t.fqn)) continue;
    if (meta.reformulated_shapes.count(t.fqn))
      throw Error("is stored N-D flattened, not as a model weight").tensor(t.fqn).file(dir);
    ReferenceTensor r{t.fqn, t.dtype, t.size, {}};
    for (const DcpChunk& c : t.chunks) {
      const DcpChunkData data = locate_dcp_chunk(meta, t, c, scratch_dir);
      auto [it, fresh] = file_index.try_emplace(data.path, static_cast<uint32_t>(out.files.size()));
      if (fresh) out.files.push_back(data.path);
      try {
        r.pieces.push_back(torch_piece(it->second, data.record, data.view, box_indices(c.offsets, c.sizes),
                                       "chunk at " + shape_string(c.offsets) + " of " + c.relative_path));
      } catch (Error& err) {
        throw err.tensor(t.fqn).file(data.path);
      }
    }
    out.tensors.push_back(std::move(r));
    ++out.kinds["the DCP chunks' offsets in .metadata"];
  }
  return out;
}

void add_safetensors_reference(ReferenceSources& into, const std::vector<std::string>& paths, const std::string& kind) {
  for (const std::string& path : paths) {
    const SafetensorsFile f = SafetensorsFile::open(path);
    const auto fi = static_cast<uint32_t>(into.files.size());
    into.files.push_back(path);
    for (const SafetensorsTensor& st : f.tensors()) {
      ReferenceTensor t{st.name, st.dtype, st.shape, {}};
      std::vector<int64_t> stride(st.shape.size(), 1);
      for (size_t d = st.shape.size(); d-- > 1;) stride[d - 1] = stride[d] * st.shape[d];
      t.pieces.push_back({fi, st.file_offset, 0, stride,
                          box_indices(std::vector<int64_t>(st.shape.size(), 0), st.shape), path, std::nullopt});
      into.tensors.push_back(std::move(t));
      ++into.kinds[kind];
    }
  }
}

uint64_t check_record_crcs(const ReferenceSources& sources) {
  std::map<std::pair<uint32_t, uint64_t>, std::pair<const ZipEntry*, const std::string*>> records;  // once each
  for (const ReferenceTensor& t : sources.tensors)
    for (const ReferencePiece& p : t.pieces)
      if (p.record) records.try_emplace({p.file, p.record->data_offset}, &*p.record, &t.name);
  constexpr size_t kBlock = 4u << 20;
  std::vector<uint8_t> block;
  std::map<uint32_t, File> open;
  for (const auto& [at, entry] : records) {
    const auto& [record, tensor] = entry;
    auto it = open.find(at.first);
    if (it == open.end()) it = open.emplace(at.first, File::open_read(sources.files.at(at.first))).first;
    uint32_t crc = 0;
    for (uint64_t pos = 0; pos < record->size; pos += kBlock) {
      block.resize(static_cast<size_t>(std::min<uint64_t>(kBlock, record->size - pos)));
      it->second.read_exact(record->data_offset + pos, block.data(), block.size());
      crc = crc32_update(crc, block.data(), block.size());
    }
    if (crc != record->crc32)
      throw Error("CRC-32 mismatch in zip record " + record->name + " (the zip directory has another checksum)")
          .file(sources.files.at(at.first))
          .tensor(*tensor)
          .offset(record->data_offset);
  }
  return records.size();
}

// ---- ElementFetcher ----------------------------------------------------------------------

namespace {
// Read windows of all pieces of one tensor together stay within this (W = 64 ranks: 128 KiB each).
constexpr uint64_t kWindowBudget = 8u << 20;
}  // namespace

int64_t ElementFetcher::DimMap::local(int64_t global) const {
  if (table.empty()) return global >= begin && global < begin + size ? global - begin : -1;
  return table[static_cast<size_t>(global)];
}

ElementFetcher::ElementFetcher(const ReferenceSources& sources, const ReferenceTensor& tensor)
    : tensor_(tensor),
      windows_(tensor.pieces.size()),
      element_size_(dtype_size(tensor.dtype)),
      window_bytes_(
          std::clamp<uint64_t>(kWindowBudget / std::max<size_t>(tensor.pieces.size(), 1), 64u << 10, 1u << 20)) {
  std::unordered_map<uint32_t, std::shared_ptr<File>> open;
  for (const ReferencePiece& p : tensor.pieces) {
    auto& f = open[p.file];
    if (!f) f = std::make_shared<File>(File::open_read(sources.files.at(p.file)));
    files_.push_back(f);
    std::vector<DimMap> dims(tensor.shape.size());
    for (size_t d = 0; d < tensor.shape.size(); ++d) {
      const std::vector<int64_t>& held = p.global_index[d];
      for (const int64_t g : held)
        if (g < 0 || g >= tensor.shape[d])
          throw Error(p.holder + " places an element at index " + std::to_string(g) + " of dim " + std::to_string(d) +
                      ", outside the global shape " + shape_string(tensor.shape))
              .tensor(tensor.name);
      DimMap& m = dims[d];
      m.begin = held.empty() ? 0 : held.front();
      m.size = static_cast<int64_t>(held.size());
      if (std::adjacent_find(held.begin(), held.end(), [](int64_t a, int64_t b) { return b != a + 1; }) == held.end())
        continue;  // a range [begin, begin + size): no table
      m.table.assign(static_cast<size_t>(tensor.shape[d]), -1);
      for (size_t i = 0; i < held.size(); ++i) {
        int32_t& slot = m.table[static_cast<size_t>(held[i])];
        if (slot >= 0)
          throw Error(p.holder + " holds global index " + std::to_string(held[i]) + " of dim " + std::to_string(d) +
                      " twice")
              .tensor(tensor.name);
        slot = static_cast<int32_t>(i);
      }
    }
    dims_.push_back(std::move(dims));
  }
}

const uint8_t* ElementFetcher::bytes_at(size_t piece, uint64_t offset) {
  Window& w = windows_[piece];
  if (w.bytes.empty() || offset < w.begin || offset + element_size_ > w.begin + w.bytes.size()) {
    const File& f = *files_[piece];
    w.begin = offset / window_bytes_ * window_bytes_;
    const uint64_t size = f.size();
    if (offset + element_size_ > size)
      throw Error(tensor_.pieces[piece].holder + ": element lies past the end of the file")
          .file(f.path())
          .tensor(tensor_.name);
    w.bytes.resize(static_cast<size_t>(std::min<uint64_t>(window_bytes_ + element_size_, size - w.begin)));
    f.read_exact(w.begin, w.bytes.data(), w.bytes.size());
  }
  return w.bytes.data() + (offset - w.begin);
}

void ElementFetcher::copy_element(size_t piece, int64_t element, uint8_t* out) {
  const ReferencePiece& p = tensor_.pieces[piece];
  if (element < 0) throw Error(p.holder + ": negative storage offset").tensor(tensor_.name);
  std::copy_n(bytes_at(piece, p.storage_offset_in_file + static_cast<uint64_t>(element) * element_size_), element_size_,
              out);
}

void ElementFetcher::copy_elements(size_t piece, int64_t element, int64_t n, uint8_t* out) {
  const ReferencePiece& p = tensor_.pieces[piece];
  if (element < 0) throw Error(p.holder + ": negative storage offset").tensor(tensor_.name);
  uint64_t offset = p.storage_offset_in_file + static_cast<uint64_t>(element) * element_size_;
  for (uint64_t left = static_cast<uint64_t>(n) * element_size_; left > 0;) {
    const uint8_t* at = bytes_at(piece, offset);
    const Window& w = windows_[piece];
    const uint64_t take = std::min<uint64_t>(left, w.begin + w.bytes.size() - offset);
    std::copy_n(at, take, out);
    out += take;
    offset += take;
    left -= take;
  }
}

int ElementFetcher::fetch(const int64_t* index, uint8_t* out) {
  int holders = 0;
  const size_t ndim = tensor_.shape.size();
  for (size_t p = 0; p < dims_.size(); ++p) {
    const ReferencePiece& piece = tensor_.pieces[p];
    int64_t element = piece.storage_offset;
    bool held = true;
    for (size_t d = 0; d < ndim && held; ++d) {
      const int64_t local = dims_[p][d].local(index[d]);
      held = local >= 0;
      element += local * piece.stride[d];
    }
    if (held && ++holders == 1) copy_element(p, element, out);
  }
  return holders;
}

uint64_t ElementFetcher::fetch_run(const int64_t* index, int64_t count, uint8_t* out) {
  const size_t ndim = tensor_.shape.size();
  if (ndim == 0) return fetch(index, out) == 1 ? 0 : 1;
  // The pieces that hold the run's leading indices, and where that row starts in each.
  candidates_.clear();
  for (size_t p = 0; p < dims_.size(); ++p) {
    int64_t element = tensor_.pieces[p].storage_offset;
    bool held = true;
    for (size_t d = 0; d + 1 < ndim && held; ++d) {
      const int64_t local = dims_[p][d].local(index[d]);
      held = local >= 0;
      element += local * tensor_.pieces[p].stride[d];
    }
    if (held) candidates_.push_back({p, element});
  }
  // Holders per element of the run; the first holder's bytes are the element.
  holders_.assign(static_cast<size_t>(count), 0);
  const int64_t first = index[ndim - 1];
  for (const auto& [p, row] : candidates_) {
    const DimMap& m = dims_[p][ndim - 1];
    const int64_t stride = tensor_.pieces[p].stride[ndim - 1];
    if (m.table.empty()) {  // a range of the last dim: copy the overlap as one stretch when dense
      const int64_t lo = std::max(first, m.begin), hi = std::min(first + count, m.begin + m.size);
      if (lo >= hi) continue;
      uint16_t* h = holders_.data() + (lo - first);
      const bool untouched = std::all_of(h, h + (hi - lo), [](uint16_t n) { return n == 0; });
      if (untouched && stride == 1) {
        copy_elements(p, row + (lo - m.begin), hi - lo, out + static_cast<size_t>(lo - first) * element_size_);
      } else {
        for (int64_t g = lo; g < hi; ++g)
          if (holders_[static_cast<size_t>(g - first)] == 0)
            copy_element(p, row + (g - m.begin) * stride, out + static_cast<size_t>(g - first) * element_size_);
      }
      for (int64_t j = 0; j < hi - lo; ++j) ++h[j];
      continue;
    }
    for (int64_t j = 0; j < count; ++j) {
      const int64_t local = m.local(first + j);
      if (local < 0) continue;
      if (holders_[static_cast<size_t>(j)]++ == 0)
        copy_element(p, row + local * stride, out + static_cast<size_t>(j) * element_size_);
    }
  }
  uint64_t not_once = 0;
  for (const uint16_t n : holders_) not_once += n != 1;
  return not_once;
}

}  // namespace shardmerge
