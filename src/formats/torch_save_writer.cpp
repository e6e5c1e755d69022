#include "formats/torch_save_writer.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "formats/torch_writer.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace shardmerge {

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

namespace {

// TUPLE1/2/3 where they exist (as Python writes small tuples); longer ones need a MARK
// before their items.
bool needs_mark(size_t n) { return n > 3; }
void close_tuple(pickle::Writer& w, size_t n) {
  if (needs_mark(n))
    w.tuple();
  else
    w.tuple(n);
}

}  // namespace

uint32_t TorchSaveWriter::global(const std::string& module, const std::string& name) {
  auto [it, fresh] = globals_.try_emplace(module + " " + name, 0);
  if (!fresh) {
    w_.get(it->second);
  } else {
    w_.global(module, name);
    it->second = w_.put();
  }
  return it->second;
}

std::string TorchSaveWriter::add_storage(uint64_t nbytes, std::function<void(char*, size_t)> fill) {
  storages_.push_back({nbytes, std::move(fill)});
  return std::to_string(storages_.size() - 1);
}

// ('storage', <class>, key, 'cpu', numel) BINPERSID, as torch's persistent_id writes it.
void TorchSaveWriter::storage_ref(const std::string& cls, const std::string& key, int64_t numel) {
  w_.mark().str("storage");
  global("torch", cls);
  w_.str(key).str("cpu").integer(numel).tuple().binpersid();
}

void TorchSaveWriter::tensor(DType dtype, const std::string& key, int64_t storage_numel, int64_t storage_offset,
                             const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  const std::string_view cls = dtype_info(dtype).legacy_storage;
  if (cls.empty()) throw Error("cannot write a " + std::string(dtype_name(dtype)) + " tensor (no typed storage class)");
  global("torch._utils", "_rebuild_tensor_v2");
  w_.mark();
  storage_ref(std::string(cls), key, storage_numel);
  w_.integer(storage_offset).int_tuple(size).int_tuple(stride).boolean(false);
  global("collections", "OrderedDict");
  w_.empty_tuple().reduce();
  w_.tuple().reduce();
}

void TorchSaveWriter::reduce_memoized(std::optional<uint32_t>& memo, const std::string& module, const std::string& name,
                                      const std::string& arg) {
  if (memo) {
    w_.get(*memo);
    return;
  }
  global(module, name);
  w_.str(arg).tuple(1).reduce();
  memo = w_.put();
}

void TorchSaveWriter::mesh(const MeshOut& m) {
  if (mesh_memo_) {
    w_.get(*mesh_memo_);
    return;
  }
  int64_t world = 1;
  for (int64_t n : m.shape) world *= n;
  const std::vector<int64_t> strides = contiguous_strides(m.shape);
  std::vector<int64_t> coordinate(m.shape.size());
  for (size_t d = 0; d < m.shape.size(); ++d) coordinate[d] = (m.rank / strides[d]) % m.shape[d];

  global("torch.distributed.device_mesh", "DeviceMesh");
  w_.empty_tuple().newobj();
  mesh_memo_ = w_.put();
  w_.empty_dict().mark();
  w_.str("_device_type").str("cpu");
  // _layout: one _FlatLayout (shape (n,), stride (s,)) per mesh dim.
  w_.str("_layout");
  global("torch.distributed._mesh_layout", "_MeshLayout");
  w_.empty_tuple().newobj().empty_dict().str("axes");
  if (needs_mark(m.shape.size())) w_.mark();
  for (size_t d = 0; d < m.shape.size(); ++d) {
    global("torch.distributed._mesh_layout", "_FlatLayout");
    w_.empty_tuple().newobj().empty_dict().mark();
    w_.str("shape").int_tuple({m.shape[d]}).str("stride").int_tuple({strides[d]});
    w_.setitems().build();
  }
  close_tuple(w_, m.shape.size());
  w_.setitem().build();
  // The rank map is a small int32 tensor with its own storage record.
  const std::string key = add_storage(static_cast<uint64_t>(world) * 4, [world, next = int32_t{0}](char* buf, size_t n) mutable {
    for (size_t i = 0; i + 4 <= n && next < world; i += 4, ++next) std::memcpy(buf + i, &next, 4);
  });
  w_.str("_rank_map");
  tensor(DType::I32, key, world, 0, {world}, {1});
  w_.str("_mesh_dim_names");
  if (needs_mark(m.dim_names.size())) w_.mark();
  for (const auto& n : m.dim_names) w_.str(n);
  close_tuple(w_, m.dim_names.size());
  w_.str("_root_mesh").none();
  w_.str("_preserve_rank_order").boolean(false);
  w_.str("_flatten_rank_map").mark();
  for (int64_t r = 0; r < world; ++r) w_.integer(r);
  w_.tuple();
  w_.str("_thread_id").none();
  w_.str("_flatten_mapping").empty_dict();
  w_.str("_dim_group_names").empty_list();
  if (m.group_names.size() == 1) {
    w_.str(m.group_names[0]).append();
  } else if (!m.group_names.empty()) {
    w_.mark();
    for (const auto& n : m.group_names) w_.str(n);
    w_.appends();
  }
  w_.str("_rank").integer(m.rank);
  w_.str("_coordinate_on_dim").int_tuple(coordinate);
  w_.str("_hash").none();  // computed again on first use (DeviceMesh.__hash__)
  w_.setitems().build();
}

void TorchSaveWriter::dtensor(const DTensorOut& d, const MeshOut& m) {
  if (d.placements.size() != m.shape.size())
    throw Error("internal: a DTensor with " + std::to_string(d.placements.size()) + " placements on a " +
                std::to_string(m.shape.size()) + "-dim mesh");
  const std::string dtype(dtype_name(d.dtype));
  global("torch._tensor", "_rebuild_from_type_v2");
  w_.mark();
  global("torch._utils", "_rebuild_wrapper_subclass");
  const uint32_t cls = global("torch.distributed.tensor", "DTensor");
  w_.mark().get(cls);
  global("torch", dtype);
  w_.int_tuple(d.global_size).int_tuple(contiguous_strides(d.global_size)).integer(0);
  reduce_memoized(layout_memo_, "torch.serialization", "_get_layout", "torch.strided");
  reduce_memoized(device_memo_, "torch", "device", "cpu");
  w_.boolean(false).tuple();
  w_.none().empty_dict().mark();
  w_.str("_local_tensor");
  tensor(d.dtype, d.storage_key, d.storage_numel, 0, d.local_size, contiguous_strides(d.local_size));
  w_.str("_spec");
  global("torch.distributed.tensor._dtensor_spec", "DTensorSpec");
  w_.empty_tuple().newobj().empty_dict().mark();
  w_.str("mesh");
  mesh(m);
  w_.str("placements");
  if (needs_mark(d.placements.size())) w_.mark();
  std::vector<std::pair<int64_t, std::vector<int64_t>>> order;  // tensor dim -> mesh dims sharding it
  for (size_t i = 0; i < d.placements.size(); ++i) {
    const Placement& p = d.placements[i];
    if (p.kind == PlacementKind::Shard) {
      global("torch.distributed.tensor.placement_types", "Shard");
      w_.empty_tuple().newobj().empty_dict().str("dim").integer(p.dim).setitem().build();
      auto it = std::find_if(order.begin(), order.end(), [&](const auto& e) { return e.first == p.dim; });
      if (it == order.end()) it = order.insert(order.end(), {p.dim, {}});
      it->second.push_back(static_cast<int64_t>(i));
    } else if (p.kind == PlacementKind::Replicate) {
      global("torch.distributed.tensor.placement_types", "Replicate");
      w_.empty_tuple().newobj().empty_dict().build();
    } else {
      throw Error("internal: cannot write placement " + p.to_string());
    }
  }
  close_tuple(w_, d.placements.size());
  w_.str("tensor_meta");
  global("torch.distributed.tensor._dtensor_spec", "TensorMeta");
  global("torch", "Size");
  w_.int_tuple(d.global_size).tuple(1).reduce();
  w_.int_tuple(contiguous_strides(d.global_size));
  global("torch", dtype);
  w_.tuple(3).newobj();
  w_.str("shard_order");
  std::sort(order.begin(), order.end());
  if (needs_mark(order.size())) w_.mark();
  for (const auto& [dim, mesh_dims] : order) {
    global("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry");
    w_.integer(dim).int_tuple(mesh_dims).tuple(2).newobj();
  }
  if (order.empty())
    w_.empty_tuple();
  else
    close_tuple(w_, order.size());
  w_.str("use_strided_shard_as_shard_order").boolean(false);
  w_.str("_hash").none();
  w_.setitems().build();
  w_.setitems().tuple(2);
  w_.tuple().reduce();
}

uint64_t TorchSaveWriter::write(const std::string& path) {
  const std::string pkl = w_.finish();
  TorchArchiveWriter zip(path, std::filesystem::path(path).stem().string());
  zip.add_record("data.pkl", pkl);
  zip.add_record(".format_version", "1");
  zip.add_record(".storage_alignment", "64");
  zip.add_record("byteorder", "little");
  for (size_t k = 0; k < storages_.size(); ++k) zip.add_record("data/" + std::to_string(k), storages_[k].nbytes, storages_[k].fill);
  zip.add_record(".data/serialization_id", std::string(40, '0'));
  zip.finish();
  return File::open_read(path).size();
}

}  // namespace shardmerge
