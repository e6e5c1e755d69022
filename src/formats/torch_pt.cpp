#include "formats/torch_pt.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "formats/zip.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"
#include "util/shape.hpp"

namespace shardmerge {

using pickle::Kind;
using pickle::Value;

// ---- TensorView ----------------------------------------------------------------------------

uint64_t TensorView::numel() const { return element_count(size); }

bool TensorView::is_contiguous() const {
  // 128 bits: the product of sizes only grows while strides keep matching it, and a matched
  // stride is below 2^63, so the product stays below 2^127 where int64 would overflow.
  unsigned __int128 expected = 1;
  for (size_t i = size.size(); i-- > 0;) {
    if (size[i] != 1 && static_cast<unsigned __int128>(stride[i]) != expected) return false;
    expected *= static_cast<uint64_t>(size[i]);
  }
  return true;
}

std::string Placement::to_string() const {
  switch (kind) {
    case PlacementKind::Shard: return "Shard(" + std::to_string(dim) + ")";
    case PlacementKind::StridedShard:
      return "_StridedShard(" + std::to_string(dim) + ", sf=" + std::to_string(split_factor) + ")";
    case PlacementKind::Replicate: return "Replicate()";
    case PlacementKind::Partial: return "Partial(" + reduce_op + ")";
  }
  return "?";
}

DType StateEntry::dtype() const {
  if (auto* v = std::get_if<TensorView>(&value)) return v->dtype;
  if (auto* d = std::get_if<DTensorValue>(&value)) return d->local.dtype;
  return std::get<ShardedTensorValue>(value).dtype;
}

std::vector<int64_t> StateEntry::global_shape() const {
  if (auto* v = std::get_if<TensorView>(&value)) return v->size;
  if (auto* d = std::get_if<DTensorValue>(&value)) return d->global_size;
  return std::get<ShardedTensorValue>(value).global_size;
}

// ---- reconstructors: torch's allowlist -----------------------------------------------------

std::vector<int64_t> DeviceMeshInfo::coordinate_of(int64_t rank) const {
  if (!coordinate.empty()) return coordinate;
  std::vector<int64_t> c(shape.size());
  for (size_t i = c.size(); i-- > 0;) {
    c[i] = rank % shape[i];
    rank /= shape[i];
  }
  return c;
}

namespace {

struct StorageNative : pickle::Native {
  std::optional<DType> dtype;  // none for UntypedStorage (bytes; the dtype comes with the tensor)
  std::string key;
  std::string location;
  uint64_t nbytes = 0;
};

struct TensorNative : pickle::Native {
  bool has_storage = false;  // false for wrapper subclasses (DTensor, ShardedTensor) and meta tensors
  TensorView view;           // dtype/size/stride are meaningful either way
  std::string subclass;      // "module.Name" of a tensor subclass, empty for torch.Tensor
  const Value* subclass_state = nullptr;
  void references(std::vector<const Value*>& out) const override { out.push_back(subclass_state); }
};

Error decode_error(const std::string& what) { return Error("torch pickle: " + what); }

std::vector<int64_t> int_tuple(const Value& v, const char* what) {
  if (!v.is_sequence()) throw decode_error(std::string(what) + " is a " + pickle::kind_name(v.kind) + ", expected a tuple");
  std::vector<int64_t> out;
  out.reserve(v.items.size());
  for (const Value* x : v.items) {
    if (x->kind != Kind::Int) throw decode_error(std::string(what) + " holds a " + pickle::kind_name(x->kind));
    out.push_back(x->integer);
  }
  return out;
}

DType dtype_global(const Value& v) {
  if (v.kind == Kind::Global && v.text == "torch")
    if (auto t = dtype_from_torch_name(v.name)) return *t;
  std::string found = v.kind == Kind::Global ? v.text + "." + v.name : pickle::kind_name(v.kind);
  throw decode_error("unsupported tensor dtype " + found);
}

bool is_tensor_class(const Value& cls) {
  return cls.is_global("torch", "Tensor") || cls.is_global("torch.nn.parameter", "Parameter") ||
         cls.is_global("torch._tensor", "Tensor");
}

class TorchReconstructors : public pickle::Reconstructors {
 public:
  Value* reduce(pickle::Document& doc, const Value& g, Value& args) override {
    const auto& a = args.items;
    if (g.text == "torch._utils") {
      if (g.name == "_rebuild_tensor_v2" || g.name == "_rebuild_tensor_v3") return rebuild_tensor(doc, g.name, a);
      if ((g.name == "_rebuild_parameter" || g.name == "_rebuild_parameter_with_state") && !a.empty()) return a[0];
      if (g.name == "_rebuild_wrapper_subclass") return rebuild_wrapper(doc, a);
      if (g.name == "_rebuild_meta_tensor_no_storage" && a.size() >= 3) {
        auto t = std::make_unique<TensorNative>();
        t->view.dtype = dtype_global(*a[0]);
        t->view.size = int_tuple(*a[1], "size");
        t->view.stride = int_tuple(*a[2], "stride");
        t->subclass = "<meta>";
        return wrap(doc, std::move(t));
      }
      return nullptr;
    }
    if (g.is_global("torch._tensor", "_rebuild_from_type_v2") || g.is_global("torch._tensor", "_rebuild_from_type")) {
      // (func, new_type, func_args, state): evaluate func only if it is itself on the allowlist.
      if (a.size() < 3 || a[0]->kind != Kind::Global || a[2]->kind != Kind::Tuple) return nullptr;
      // torch nests one level (a subclass around a rebuild function); a hostile file could nest
      // them as deep as its length allows and overflow the stack here.
      if (from_type_depth_ >= kMaxFromTypeNesting)
        throw decode_error("tensor subclass reconstruction nested more than " + std::to_string(kMaxFromTypeNesting) +
                           " levels deep");
      struct Nesting {
        int& depth;
        ~Nesting() { --depth; }
      } nesting{++from_type_depth_};
      Value* inner = reduce(doc, *a[0], *a[2]);
      const TensorNative* t = inner ? inner->native_as<TensorNative>() : nullptr;
      if (!t) return nullptr;
      auto out = std::make_unique<TensorNative>(*t);  // the inner value may be shared via the memo
      if (!is_tensor_class(*a[1]) && a[1]->kind == Kind::Global) out->subclass = a[1]->text + "." + a[1]->name;
      if (a.size() > 3) out->subclass_state = a[3];
      return wrap(doc, std::move(out));
    }
    if (g.is_global("torch", "Size")) {
      if (a.size() == 1 && a[0]->is_sequence()) {
        doc.charge(a[0]->items.size() * sizeof(Value*));
        Value* t = doc.make(Kind::Tuple);
        t->items = a[0]->items;
        return t;
      }
      return nullptr;
    }
    if (g.is_global("torch", "device")) {
      if (a.empty() || a[0]->kind != Kind::Str) return nullptr;
      std::string dev = a[0]->text;
      if (a.size() > 1 && a[1]->kind == Kind::Int) dev += ":" + std::to_string(a[1]->integer);
      return doc.make_str(dev);
    }
    if (g.is_global("torch.serialization", "_get_layout")) {
      if (a.size() == 1 && a[0]->kind == Kind::Str) return doc.make_str(a[0]->text);
      return nullptr;
    }
    return nullptr;
  }

  Value* persistent_load(pickle::Document& doc, Value& pid) override {
    // ('storage', <storage class>, key, location, numel)
    if (pid.kind != Kind::Tuple || pid.items.size() < 5 || pid.items[0]->kind != Kind::Str ||
        pid.items[0]->text != "storage")
      return nullptr;
    const Value& cls = *pid.items[1];
    auto s = std::make_unique<StorageNative>();
    if (cls.kind != Kind::Global) throw decode_error("storage type is not a class reference");
    if (cls.name == "UntypedStorage") {
      s->dtype.reset();
    } else if (auto t = dtype_from_storage_class(cls.name)) {
      s->dtype = *t;
    } else {
      throw decode_error("unsupported storage type " + cls.text + "." + cls.name +
                         " (quantized and other exotic storages are not supported)");
    }
    if (pid.items[2]->kind != Kind::Str) throw decode_error("storage key is not a string");
    s->key = pid.items[2]->text;
    if (pid.items[3]->kind == Kind::Str) s->location = pid.items[3]->text;
    if (pid.items[4]->kind != Kind::Int || pid.items[4]->integer < 0) throw decode_error("storage size is not a count");
    const auto numel = static_cast<uint64_t>(pid.items[4]->integer);
    const uint64_t elem = s->dtype ? dtype_size(*s->dtype) : 1;
    if (numel > std::numeric_limits<uint64_t>::max() / elem) throw decode_error("storage size overflows");
    s->nbytes = numel * elem;
    doc.charge(sizeof(StorageNative) + s->key.size() + s->location.size());
    Value* v = doc.make(Kind::Native);
    v->native = std::move(s);
    return v;
  }

 private:
  static constexpr int kMaxFromTypeNesting = 8;
  int from_type_depth_ = 0;

  // The sizes and strides come from tuples that the pickle can memoize and hand to any number
  // of reconstructions: their copies count against the VM's memory budget.
  static Value* wrap(pickle::Document& doc, std::unique_ptr<TensorNative> t) {
    doc.charge(sizeof(TensorNative) + (t->view.size.size() + t->view.stride.size()) * sizeof(int64_t) +
               t->view.storage_key.size() + t->subclass.size());
    Value* v = doc.make(Kind::Native);
    v->native = std::move(t);
    return v;
  }

  Value* rebuild_tensor(pickle::Document& doc, const std::string& fn, const std::vector<Value*>& a) {
    const bool v3 = fn == "_rebuild_tensor_v3";
    if (a.size() < (v3 ? 7u : 6u)) throw decode_error(fn + " with " + std::to_string(a.size()) + " arguments");
    const auto* storage = a[0]->native_as<StorageNative>();
    if (!storage) throw decode_error(fn + ": first argument is not a storage reference");
    auto t = std::make_unique<TensorNative>();
    t->has_storage = true;
    TensorView& view = t->view;
    if (v3) {
      view.dtype = dtype_global(*a[6]);
    } else if (storage->dtype) {
      view.dtype = *storage->dtype;
    } else {
      throw decode_error("_rebuild_tensor_v2 over an UntypedStorage has no dtype");
    }
    if (storage->dtype && *storage->dtype != view.dtype)
      throw decode_error("tensor dtype " + std::string(dtype_name(view.dtype)) + " differs from its storage's " +
                         std::string(dtype_name(*storage->dtype)));
    view.storage_key = storage->key;
    view.storage_nbytes = storage->nbytes;
    view.storage_offset = a[1]->as_int();
    view.size = int_tuple(*a[2], "size");
    view.stride = int_tuple(*a[3], "stride");
    const size_t meta_index = v3 ? 7 : 6;
    if (a.size() > meta_index && a[meta_index]->kind == Kind::Dict) {
      if (const Value* neg = a[meta_index]->get("neg")) view.negated = neg->as_bool();
      if (const Value* conj = a[meta_index]->get("conj")) view.conjugated = conj->as_bool();
    }
    return wrap(doc, std::move(t));
  }

  Value* rebuild_wrapper(pickle::Document& doc, const std::vector<Value*>& a) {
    // (cls, dtype, size, stride, storage_offset, layout, device, requires_grad)
    if (a.size() < 4) throw decode_error("_rebuild_wrapper_subclass with too few arguments");
    auto t = std::make_unique<TensorNative>();
    if (a[0]->kind == Kind::Global) t->subclass = a[0]->text + "." + a[0]->name;
    t->view.dtype = dtype_global(*a[1]);
    t->view.size = int_tuple(*a[2], "size");
    t->view.stride = int_tuple(*a[3], "stride");
    return wrap(doc, std::move(t));
  }
};

// ---- decoding the value tree ---------------------------------------------------------------

// Attribute lookup on a pickled instance: its BUILD state is a dict, or a pair
// (instance dict or None, slots dict), depending on the class and the Python version.
const Value* state_attr(const Value* state, std::string_view name) {
  if (!state) return nullptr;
  if (state->kind == Kind::Dict) return state->get(name);
  if (state->kind == Kind::Tuple)
    for (const Value* part : state->items)
      if (part->kind == Kind::Dict)
        if (const Value* v = part->get(name)) return v;
  return nullptr;
}

const Value* attr(const Value& obj, std::string_view name) { return state_attr(obj.state, name); }

const Value& require_state_attr(const Value* state, std::string_view name, const char* what) {
  if (const Value* v = state_attr(state, name)) return *v;
  throw decode_error(std::string(what) + " has no '" + std::string(name) + "'");
}

const Value& require_attr(const Value& obj, std::string_view name, const char* what) {
  return require_state_attr(obj.state, name, what);
}

bool class_is(const Value& obj, std::string_view name) {
  return obj.kind == Kind::Object && obj.callable && obj.callable->kind == Kind::Global && obj.callable->name == name;
}

void check_view(const TensorView& v) {
  // The stored bytes of a lazily negated or conjugated view are the un-negated data; copying
  // them as they are would write -x as x. Executors only copy and cast, so such views are
  // refused rather than applied.
  if (v.negated)
    throw decode_error("saved with torch's lazy negation bit set (metadata {'neg': True}); save it after "
                       "tensor.resolve_neg() to store the negated values");
  if (v.conjugated)
    throw decode_error("saved with torch's lazy conjugation bit set (metadata {'conj': True}); save it after "
                       "tensor.resolve_conj()");
  if (v.size.size() != v.stride.size()) throw decode_error("size and stride have different lengths");
  if (v.storage_offset < 0) throw decode_error("negative storage offset");
  const uint64_t elem = dtype_size(v.dtype);
  // Highest element index the view touches; sizes come from size/stride, never the storage
  // length. Saturated at 2^64 so that hostile sizes and strides cannot wrap it around.
  constexpr unsigned __int128 kSaturated = std::numeric_limits<uint64_t>::max();
  unsigned __int128 last = static_cast<uint64_t>(v.storage_offset);
  unsigned __int128 numel = 1;
  for (size_t i = 0; i < v.size.size(); ++i) {
    if (v.size[i] < 0) throw decode_error("negative size");
    if (v.stride[i] < 0) throw decode_error("negative stride");
    numel = std::min(kSaturated, numel * static_cast<uint64_t>(v.size[i]));
    const auto span = static_cast<unsigned __int128>(v.size[i] > 0 ? v.size[i] - 1 : 0) * static_cast<uint64_t>(v.stride[i]);
    last = std::min(kSaturated, last + span);
  }
  // torch counts elements in int64; more would also overflow TensorView::numel (zero strides
  // let a view far larger than its storage pass the bounds check below).
  if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw decode_error("shape " + shape_string(v.size) + " has more than 2^63 elements");
  if (numel == 0) return;
  const unsigned __int128 needed = (last + 1) * elem;
  if (needed > v.storage_nbytes)
    throw decode_error("shape " + shape_string(v.size) + " with strides " + shape_string(v.stride) + " at offset " +
                       std::to_string(v.storage_offset) + " needs " +
                       (last == kSaturated ? std::string("more than 2^64") : std::to_string(static_cast<uint64_t>(needed))) +
                       " bytes of storage data/" + v.storage_key + ", which has " + std::to_string(v.storage_nbytes));
}

const TensorNative& as_plain_tensor(const Value& v, const char* what) {
  const auto* t = v.native_as<TensorNative>();
  if (!t || !t->has_storage) throw decode_error(std::string(what) + " is not a plain tensor");
  check_view(t->view);
  return *t;
}

std::vector<std::string> str_tuple(const Value* v) {
  std::vector<std::string> out;
  if (!v || v->kind == Kind::None) return out;
  for (const Value* x : v->as_sequence()) out.push_back(x->as_str());
  return out;
}

// The number of elements of a shape, refusing negative dims and counts beyond int64.
int64_t checked_numel(const std::vector<int64_t>& shape, const char* what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw decode_error(std::string(what) + " " + shape_string(shape) + " has a negative dimension");
    if (__builtin_mul_overflow(n, d, &n))
      throw decode_error(std::string(what) + " " + shape_string(shape) + " has more than 2^63 elements");
  }
  return n;
}

DeviceMeshInfo decode_mesh(const Value& mesh) {
  if (!class_is(mesh, "DeviceMesh")) throw decode_error("DTensor spec's mesh is not a DeviceMesh");
  DeviceMeshInfo info;
  const Value* names = attr(mesh, "_mesh_dim_names");
  if (!names) names = attr(mesh, "mesh_dim_names");
  info.dim_names = str_tuple(names);
  if (const Value* coord = attr(mesh, "_coordinate_on_dim"); coord && coord->kind != Kind::None)
    info.coordinate = int_tuple(*coord, "_coordinate_on_dim");
  if (const Value* layout = attr(mesh, "_layout"); layout && layout->kind == Kind::Object) {
    // torch >= 2.9: a _MeshLayout of _FlatLayout axes; each mesh dim is the product of its axis.
    for (const Value* axis : require_attr(*layout, "axes", "_MeshLayout").as_sequence()) {
      const Value& shape = require_attr(*axis, "shape", "_FlatLayout");
      info.shape.push_back(shape.kind == Kind::Int ? shape.integer : checked_numel(int_tuple(shape, "axis shape"), "mesh axis"));
    }
  } else if (const Value* m = attr(mesh, "mesh")) {
    // torch <= 2.8: the mesh tensor itself (an int32 tensor of ranks).
    const auto* t = m->native_as<TensorNative>();
    if (!t) throw decode_error("DeviceMesh.mesh is not a tensor");
    info.shape = t->view.size;
  } else {
    throw decode_error("DeviceMesh has neither _layout nor mesh; unknown torch version");
  }
  if (!info.dim_names.empty() && info.dim_names.size() != info.shape.size())
    throw decode_error("DeviceMesh has " + std::to_string(info.shape.size()) + " dims but " +
                       std::to_string(info.dim_names.size()) + " dim names");
  if (!info.coordinate.empty() && info.coordinate.size() != info.shape.size())
    throw decode_error("DeviceMesh coordinate has the wrong number of dims");
  // Placements divide by mesh dims and index by coordinates: both must be in range.
  for (size_t i = 0; i < info.shape.size(); ++i) {
    if (info.shape[i] < 1) throw decode_error("DeviceMesh shape " + shape_string(info.shape) + " has an empty dim");
    if (!info.coordinate.empty() && (info.coordinate[i] < 0 || info.coordinate[i] >= info.shape[i]))
      throw decode_error("DeviceMesh coordinate " + shape_string(info.coordinate) + " is outside the mesh " +
                         shape_string(info.shape));
  }
  return info;
}

// The mesh a sub-mesh was sliced from (torch >= 2.9 pickles it as _root_mesh, with the rank as
// _rank): its dims and this rank's coordinate in it. The coordinate is the rank's row-major
// position, as torch numbers a mesh it made (init_device_mesh); a root with other strides or
// rank order leaves it unknown.
struct RootMesh {
  std::vector<int64_t> shape;
  std::vector<std::string> dim_names;
  std::optional<std::vector<int64_t>> coordinate;
};

std::optional<RootMesh> decode_root_mesh(const Value& mesh) {
  const Value* root = attr(mesh, "_root_mesh");
  if (!root || root->kind == Kind::None || !class_is(*root, "DeviceMesh")) return std::nullopt;
  RootMesh out;
  const DeviceMeshInfo info = decode_mesh(*root);
  out.shape = info.shape;
  out.dim_names = info.dim_names;
  const Value* rank = attr(mesh, "_rank");
  bool row_major = true;
  if (const Value* layout = attr(*root, "_layout"); layout && layout->kind == Kind::Object) {
    int64_t expected = 1;
    const auto axes = require_attr(*layout, "axes", "_MeshLayout").as_sequence();
    for (size_t i = axes.size(); i-- > 0;) {
      const Value& stride = require_attr(*axes[i], "stride", "_FlatLayout");
      const int64_t s = stride.kind == Kind::Int ? stride.integer : int_tuple(stride, "axis stride").at(0);
      row_major = row_major && s == expected;
      expected *= out.shape[i];
    }
  }
  if (const Value* map = attr(*root, "_rank_map"); map && map->kind != Kind::None) {
    const auto* t = map->native_as<TensorNative>();
    row_major = row_major && t && t->view.size.size() == 1 && t->view.size[0] == checked_numel(out.shape, "root mesh");
  }
  if (rank && rank->kind == Kind::Int && row_major && rank->integer >= 0 &&
      rank->integer < checked_numel(out.shape, "root mesh"))
    out.coordinate = DeviceMeshInfo{out.shape, {}, {}}.coordinate_of(rank->integer);
  return out;
}

// Extra parallelism (VeOmni's expert parallel): a parameter is first sliced along a tensor dim
// over one dim of a mesh of its own ((ep_fsdp, ep), ep innermost), then FSDP-sharded over that
// mesh's other dims, so the DTensor covers one slice, on a sub-mesh without the slicing dim.
// Root-mesh dims of these names slice these tensor dims; other dims a sub-mesh leaves out hold
// replicas (a TP sub-mesh's 'dp').
struct SlicingMeshDim {
  std::string_view name;
  int64_t tensor_dim;
};
constexpr SlicingMeshDim kSlicingMeshDims[] = {{"ep", 0}};

// The DTensor as the whole tensor sees it: the slicing dim put first (outermost) as Shard.
void widen_to_slicing_dims(DTensorValue& d, const std::optional<RootMesh>& root) {
  if (!root || d.mesh.dim_names.empty()) return;
  for (const SlicingMeshDim& s : kSlicingMeshDims) {
    const auto in_root = std::find(root->dim_names.begin(), root->dim_names.end(), s.name);
    if (in_root == root->dim_names.end() ||
        std::find(d.mesh.dim_names.begin(), d.mesh.dim_names.end(), s.name) != d.mesh.dim_names.end())
      continue;
    const auto i = static_cast<size_t>(in_root - root->dim_names.begin());
    if (!root->coordinate || d.mesh.coordinate.empty())
      throw decode_error("DTensor on a sub-mesh of a mesh with an '" + std::string(s.name) +
                         "' dim, but the pickle does not say which slice this rank holds");
    if (s.tensor_dim >= static_cast<int64_t>(d.global_size.size()))
      throw decode_error("DTensor sliced over '" + std::string(s.name) + "' has no dim " + std::to_string(s.tensor_dim));
    int64_t& extent = d.global_size[static_cast<size_t>(s.tensor_dim)];
    if (__builtin_mul_overflow(extent, root->shape[i], &extent))
      throw decode_error("DTensor sliced over '" + std::string(s.name) + "' is larger than 2^63 elements");
    d.mesh.shape.insert(d.mesh.shape.begin(), root->shape[i]);
    d.mesh.dim_names.insert(d.mesh.dim_names.begin(), std::string(s.name));
    d.mesh.coordinate.insert(d.mesh.coordinate.begin(), (*root->coordinate)[i]);
    Placement slice;
    slice.kind = PlacementKind::Shard;
    slice.dim = s.tensor_dim;
    d.placements.insert(d.placements.begin(), slice);
    if (!d.shard_order.empty()) {
      bool listed = false;
      for (auto& [dim, mesh_dims] : d.shard_order) {
        for (int64_t& m : mesh_dims) ++m;
        if (dim == s.tensor_dim) {
          mesh_dims.insert(mesh_dims.begin(), 0);
          listed = true;
        }
      }
      if (!listed) d.shard_order.emplace_back(s.tensor_dim, std::vector<int64_t>{0});
    }
  }
}

Placement decode_placement(const Value& p) {
  Placement out;
  auto int_field = [&](std::string_view name, size_t arg_index) -> std::optional<int64_t> {
    if (const Value* v = attr(p, name)) return v->as_int();
    if (p.args && p.args->items.size() > arg_index && p.args->items[arg_index]->kind == Kind::Int)
      return p.args->items[arg_index]->integer;
    return std::nullopt;
  };
  if (class_is(p, "Shard")) {
    out.kind = PlacementKind::Shard;
    auto d = int_field("dim", 0);
    if (!d) throw decode_error("Shard placement without a dim");
    out.dim = *d;
  } else if (class_is(p, "_StridedShard")) {
    out.kind = PlacementKind::StridedShard;
    auto d = int_field("dim", 0);
    auto sf = int_field("split_factor", 1);
    if (!d || !sf || *sf < 1) throw decode_error("_StridedShard placement without dim/split_factor");
    out.dim = *d;
    out.split_factor = *sf;
  } else if (class_is(p, "Replicate")) {
    out.kind = PlacementKind::Replicate;
  } else if (class_is(p, "Partial") || class_is(p, "_MaskPartial") || class_is(p, "_NormPartial")) {
    out.kind = PlacementKind::Partial;
    const Value* op = attr(p, "reduce_op");
    out.reduce_op = op && op->kind == Kind::Str ? op->text : "sum";
  } else {
    std::string name = p.kind == Kind::Object && p.callable ? p.callable->text + "." + p.callable->name : "?";
    throw decode_error("unknown DTensor placement " + name);
  }
  return out;
}

DTensorValue decode_dtensor(const TensorNative& wrapper) {
  if (!wrapper.subclass_state) throw decode_error("DTensor without state");
  // The state is (instance dict or None, {'_local_tensor', '_spec'}) or just that dict.
  const Value* state = wrapper.subclass_state;
  DTensorValue d;
  d.global_size = wrapper.view.size;
  d.local = as_plain_tensor(require_state_attr(state, "_local_tensor", "DTensor"), "DTensor._local_tensor").view;
  const Value& spec = require_state_attr(state, "_spec", "DTensor");
  if (!class_is(spec, "DTensorSpec")) throw decode_error("DTensor._spec is not a DTensorSpec");
  const Value& mesh = require_attr(spec, "mesh", "DTensorSpec");
  d.mesh = decode_mesh(mesh);
  for (const Value* p : require_attr(spec, "placements", "DTensorSpec").as_sequence())
    d.placements.push_back(decode_placement(*p));
  if (d.placements.size() != d.mesh.shape.size())
    throw decode_error("DTensor has " + std::to_string(d.placements.size()) + " placements for a " +
                       std::to_string(d.mesh.shape.size()) + "-dim mesh");
  if (const Value* order = attr(spec, "shard_order"); order && order->kind != Kind::None) {
    // A tuple of ShardOrderEntry(tensor_dim, mesh_dims) named tuples (NEWOBJ with their fields).
    for (const Value* entry : order->as_sequence()) {
      const Value* fields = entry->kind == Kind::Object ? entry->args : entry;
      if (!fields || !fields->is_sequence() || fields->items.size() != 2)
        throw decode_error("DTensorSpec.shard_order entry is not a (tensor_dim, mesh_dims) pair");
      d.shard_order.emplace_back(fields->items[0]->as_int(), int_tuple(*fields->items[1], "shard_order mesh_dims"));
    }
  }
  for (const auto& p : d.placements)
    if ((p.kind == PlacementKind::Shard || p.kind == PlacementKind::StridedShard) &&
        (p.dim < 0 || p.dim >= static_cast<int64_t>(d.global_size.size())))
      throw decode_error("placement " + p.to_string() + " on a " + std::to_string(d.global_size.size()) + "-dim tensor");
  if (d.local.size.size() != d.global_size.size()) throw decode_error("DTensor local and global ranks differ");
  widen_to_slicing_dims(d, decode_root_mesh(mesh));
  checked_numel(d.global_size, "DTensor global shape");
  if (d.local.dtype != wrapper.view.dtype)
    throw decode_error("DTensor is " + std::string(dtype_name(wrapper.view.dtype)) + " but its local tensor is " +
                       std::string(dtype_name(d.local.dtype)));
  // Every placement gives a rank at most the whole extent of a dim.
  for (size_t i = 0; i < d.global_size.size(); ++i)
    if (d.local.size[i] > d.global_size[i])
      throw decode_error("DTensor local shape " + shape_string(d.local.size) + " exceeds its global shape " +
                         shape_string(d.global_size));
  return d;
}

ShardedTensorValue decode_sharded_tensor(const TensorNative& wrapper) {
  if (!wrapper.subclass_state || wrapper.subclass_state->kind != Kind::Tuple || wrapper.subclass_state->items.size() < 2)
    throw decode_error("ShardedTensor state is not the expected 5-tuple");
  const auto& st = wrapper.subclass_state->items;
  ShardedTensorValue out;
  out.global_size = wrapper.view.size;
  out.dtype = wrapper.view.dtype;
  for (const Value* shard : st[0]->as_sequence()) {
    ShardedTensorValue::LocalShard local;
    local.view = as_plain_tensor(require_attr(*shard, "tensor", "ShardedTensor shard"), "ShardedTensor shard").view;
    local.offsets = int_tuple(require_attr(require_attr(*shard, "metadata", "ShardedTensor shard"), "shard_offsets",
                                           "ShardMetadata"),
                              "shard_offsets");
    out.local_shards.push_back(std::move(local));
  }
  const Value& meta = *st[1];
  for (const Value* sm : require_attr(meta, "shards_metadata", "ShardedTensorMetadata").as_sequence()) {
    ShardedTensorValue::ShardMeta m;
    m.offsets = int_tuple(require_attr(*sm, "shard_offsets", "ShardMetadata"), "shard_offsets");
    m.sizes = int_tuple(require_attr(*sm, "shard_sizes", "ShardMetadata"), "shard_sizes");
    if (const Value* pl = attr(*sm, "placement"))
      if (const Value* rank = attr(*pl, "_rank"); rank && rank->kind == Kind::Int)
        m.placement = "rank:" + std::to_string(rank->integer);
    out.all_shards.push_back(std::move(m));
  }
  checked_numel(out.global_size, "ShardedTensor global shape");
  // A shard is a box inside the global shape; offsets past it would address other tensors' bytes.
  auto check_box = [&](const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
    if (offsets.size() != out.global_size.size() || sizes.size() != out.global_size.size())
      throw decode_error("ShardedTensor shard rank differs from the tensor's");
    for (size_t i = 0; i < offsets.size(); ++i)
      if (offsets[i] < 0 || sizes[i] < 0 || offsets[i] > out.global_size[i] || sizes[i] > out.global_size[i] - offsets[i])
        throw decode_error("ShardedTensor shard at " + shape_string(offsets) + " of shape " + shape_string(sizes) +
                           " is outside the global shape " + shape_string(out.global_size));
  };
  for (const auto& l : out.local_shards) check_box(l.offsets, l.view.size);
  for (const auto& m : out.all_shards) check_box(m.offsets, m.sizes);
  return out;
}

StateEntry decode_tensor(const TensorNative& t, const std::string& name) {
  try {
    StateEntry e;
    e.name = name;
    if (t.subclass.empty()) {
      if (!t.has_storage) throw decode_error("tensor has no storage");
      check_view(t.view);
      e.value = t.view;
    } else if (t.subclass == "torch.distributed.tensor.DTensor" || t.subclass == "torch.distributed._tensor.api.DTensor" ||
               t.subclass == "torch.distributed.tensor._api.DTensor") {
      e.value = decode_dtensor(t);
    } else if (t.subclass == "torch.distributed._shard.sharded_tensor.api.ShardedTensor") {
      e.value = decode_sharded_tensor(t);
    } else if (t.has_storage) {
      check_view(t.view);  // another tensor subclass with its own storage: its data is the tensor
      e.value = t.view;
    } else {
      throw decode_error("unsupported tensor kind " + t.subclass);
    }
    return e;
  } catch (Error& err) {
    err.tensor(name);
    throw;
  }
}

class Collector {
 public:
  std::vector<StateEntry> entries;

  // The outermost dict's items, as walk() would take them from the dict.
  void walk_root_items(const std::vector<std::pair<Value*, Value*>>& items) { walk_entries(items, "", 0); }
  // Values the VM freed: their addresses may come back as other values.
  void forget(const std::vector<const Value*>& values) {
    for (const Value* v : values) visited_.erase(v);
  }
  std::vector<StateEntry> take_unique() {
    std::unordered_set<std::string> names;
    for (const auto& e : entries)
      if (!names.insert(e.name).second) throw Error("two tensors are both named '" + e.name + "'");
    return std::move(entries);
  }

  void walk(const Value& v, const std::string& path, int depth) {
    if (depth > 64) throw decode_error("object nesting deeper than 64 levels at '" + path + "'");
    if (v.kind == Kind::Native) {
      // One tensor object saved under two names ({'a': t, 'b': t}) is loaded by torch under
      // both, so it is collected under both; only containers are deduplicated below.
      if (const auto* t = v.native_as<TensorNative>()) add(*t, path);
      return;
    }
    if (!visited_.insert(&v).second) return;  // shared or cyclic containers: each walked once
    switch (v.kind) {
      case Kind::Dict:
        walk_entries(v.entries, path, depth);
        break;
      case Kind::List:
      case Kind::Tuple:
        for (size_t i = 0; i < v.items.size(); ++i)
          walk(*v.items[i], path.empty() ? std::to_string(i) : path + "." + std::to_string(i), depth + 1);
        break;
      case Kind::Object:
        // Tensors inside unknown objects (e.g. argparse.Namespace) are still found.
        if (v.state) walk(*v.state, path, depth + 1);
        walk_entries(v.entries, path, depth);
        for (size_t i = 0; i < v.items.size(); ++i)  // APPENDs on a list subclass
          walk(*v.items[i], path.empty() ? std::to_string(i) : path + "." + std::to_string(i), depth + 1);
        break;
      default:
        break;
    }
  }

 private:
  void walk_entries(const std::vector<std::pair<Value*, Value*>>& entries, const std::string& path, int depth) {
    for (const auto& [k, val] : entries) {
      if (k->kind != Kind::Str && k->kind != Kind::Int) continue;  // other keys cannot name a tensor
      std::string key = k->kind == Kind::Str ? k->text : std::to_string(k->integer);
      walk(*val, path.empty() ? key : path + "." + key, depth + 1);
    }
  }

  void add(const TensorNative& t, const std::string& name) { entries.push_back(decode_tensor(t, name)); }

  std::unordered_set<const Value*> visited_;
};

}  // namespace

pickle::Document parse_torch_pickle(std::string_view data) {
  TorchReconstructors hooks;
  return pickle::parse(data, &hooks);
}

std::optional<StateEntry> tensor_entry(const Value& v, const std::string& name) {
  const auto* t = v.native_as<TensorNative>();
  if (!t) return std::nullopt;
  return decode_tensor(*t, name);
}

std::vector<StateEntry> collect_tensors(const Value& root) {
  Collector c;
  c.walk(root, "", 0);
  return c.take_unique();
}

std::vector<StateEntry> read_state_entries(std::string_view pickle_bytes) {
  // Streamed: each batch of the state dict's items is decoded as it completes and its values
  // freed, so a file of 100k DTensors never holds their 7M pickle values at once.
  struct Sink : pickle::RootItems {
    Collector collector;
    bool streamed = false;
    // A bad tensor fails the read only if the dict turns out to be the result (a whole parse
    // would not look at it otherwise): held until the parse ends.
    std::exception_ptr failure;
    void add(const std::vector<std::pair<Value*, Value*>>& items) override {
      streamed = true;
      if (failure) return;
      try {
        collector.walk_root_items(items);
      } catch (const Error&) {
        failure = std::current_exception();
      }
    }
    void freed(const std::vector<const Value*>& values) override { collector.forget(values); }
  } sink;
  TorchReconstructors hooks;
  try {
    const pickle::Document doc = pickle::parse(pickle_bytes, &hooks, {}, &sink);
    // Nothing streamed (the outermost object is no dict filled by SETITEM(S)): walk it whole.
    if (!sink.streamed) return collect_tensors(doc.root());
    if (sink.failure) std::rethrow_exception(sink.failure);
    return sink.collector.take_unique();
  } catch (const pickle::NotStreamable&) {
    return collect_tensors(parse_torch_pickle(pickle_bytes).root());
  }
}

// ---- TorchFile -----------------------------------------------------------------------------

namespace {
constexpr uint64_t kMaxPickleBytes = 1ull << 30;
}

TorchFile TorchFile::open(const std::string& path) {
  try {
    File file = File::open_read(path);
    TorchFile out;
    out.path_ = path;
    out.stamp_ = file_stamp(file);
    TorchArchive archive = TorchArchive::read(file);
    const ZipEntry& pkl = archive.record("data.pkl");
    if (pkl.size > kMaxPickleBytes) throw Error("data.pkl of " + std::to_string(pkl.size) + " bytes is implausibly large");
    const std::string data = read_record_checked(file, pkl);
    out.entries_ = read_state_entries(data);
    for (const auto& e : out.entries_) {
      auto check_record = [&](const TensorView& v) {
        const ZipEntry* rec = archive.find_record("data/" + v.storage_key);
        if (!rec)
          throw Error("refers to storage record data/" + v.storage_key + ", which is not in the archive").tensor(e.name);
        if (rec->size != v.storage_nbytes)
          throw Error("storage record data/" + v.storage_key + " has " + std::to_string(rec->size) +
                      " bytes but the pickle declares " + std::to_string(v.storage_nbytes))
              .tensor(e.name);
        out.storage_records_.try_emplace(v.storage_key, *rec);
      };
      if (auto* v = std::get_if<TensorView>(&e.value)) check_record(*v);
      if (auto* d = std::get_if<DTensorValue>(&e.value)) check_record(d->local);
      if (auto* s = std::get_if<ShardedTensorValue>(&e.value))
        for (const auto& l : s->local_shards) check_record(l.view);
    }
    return out;
  } catch (Error& e) {
    e.file(path);
    throw;
  }
}

uint64_t TorchFile::storage_offset_in_file(const TensorView& view) const { return storage_record(view).data_offset; }

const ZipEntry& TorchFile::storage_record(const TensorView& view) const {
  auto it = storage_records_.find(view.storage_key);
  if (it == storage_records_.end()) throw Error("no storage record data/" + view.storage_key).file(path_);
  return it->second;
}

}  // namespace shardmerge
