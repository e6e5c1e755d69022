#include "reshard/rank_files.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "exec/record_checker.hpp"
#include "exec/sources.hpp"
#include "formats/torch_save_writer.hpp"
#include "formats/zip.hpp"
#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"
#include "util/file_stamp.hpp"

namespace shardmerge::reshard {

// ---- SourceReader ---------------------------------------------------------------------------

SourceReader::SourceReader(bool check_crc) : check_crc_(check_crc) {}
SourceReader::~SourceReader() = default;

uint32_t SourceReader::add(const std::string& path) {
  files_.push_back(File::open_read(path));
  paths_.push_back(path);
  stamps_.push_back(file_stamp(files_.back()));
  return static_cast<uint32_t>(files_.size() - 1);
}

void SourceReader::add_record(uint32_t file, const ZipEntry& record, const std::string& tensor) {
  for (const RecordCheck& r : records_)
    if (r.file == file && r.offset == record.data_offset) return;  // storages shared by several tensors
  records_.push_back({file, record.data_offset, record.size, record.crc32, record.name, tensor});
}

void SourceReader::start() {
  if (check_crc_ && !records_.empty()) checker_ = std::make_unique<RecordChecker>(records_, paths_);
}

void SourceReader::read(uint32_t file, uint64_t offset, void* buf, size_t n) const {
  files_.at(file).read_exact(offset, buf, n);
  if (checker_) checker_->consume(file, offset, buf, n);
}

void SourceReader::finish() {
  if (checker_) {
    SourceFds fds;
    for (const File& f : files_) fds.fds.push_back(f.fd());
    fds.names = paths_;
    checker_->finish(fds);
  }
  for (size_t i = 0; i < files_.size(); ++i)
    if (auto change = stamp_change(stamps_[i], file_stamp(files_[i]), StampMatch::Exact))
      throw Error("the source changed while it was being read (" + *change + ")").file(paths_[i]);
}

// ---- planning ---------------------------------------------------------------------------------

namespace {

int64_t row_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

uint64_t SourceKind::target_bytes(const TargetMesh& mesh) const {
  uint64_t per_replica = 0;
  for (const auto& [name, d] : dtensors)
    for (const TargetRows& t : d.targets)
      per_replica += static_cast<uint64_t>((d.padded ? t.padded_rows : t.rows) * d.row_elems) * dtype_size(d.dtype);
  uint64_t plain_bytes = 0;
  for (const auto& [name, p] : plain) plain_bytes += p.view.storage_nbytes;
  const auto ranks = static_cast<uint64_t>(mesh.world_size());
  // Pickles and zip records: a target's pickle is about the template's size.
  return per_replica * static_cast<uint64_t>(mesh.world_size() / mesh.fsdp()) +
         ranks * (plain_bytes + 2 * template_bytes + 65536);
}

SourceKind plan_kind(const std::string& prefix, const std::vector<std::string>& paths, const TargetMesh& mesh,
                     SourceReader& reader) {
  const bool optimizer = prefix == "optim";
  const auto world = static_cast<int64_t>(paths.size());
  SourceKind kind;
  kind.prefix = prefix;
  std::vector<TorchFile> files;
  for (const std::string& p : paths) {
    files.push_back(TorchFile::open(p));
    kind.files.push_back(reader.add(p));
  }
  {
    File f = File::open_read(paths[0]);
    const TorchArchive archive = TorchArchive::read(f);
    const std::string data = read_record_checked(f, archive.record("data.pkl"));
    kind.template_bytes = data.size();
    try {
      kind.templ = parse_torch_pickle(data);
    } catch (Error& e) {
      e.file(paths[0]);
      throw;
    }
  }
  // Entries by name, per rank; every rank must hold the same names.
  std::vector<std::unordered_map<std::string, const StateEntry*>> by_name(files.size());
  for (size_t r = 0; r < files.size(); ++r) {
    for (const StateEntry& e : files[r].entries()) by_name[r][e.name] = &e;
    if (by_name[r].size() != files[0].entries().size())
      throw Error("holds " + std::to_string(by_name[r].size()) + " tensors, rank 0 holds " +
                  std::to_string(files[0].entries().size()))
          .file(paths[r]);
  }
  for (const StateEntry& e0 : files[0].entries()) {
    if (std::holds_alternative<ShardedTensorValue>(e0.value))
      throw Error("is a ShardedTensor (FSDP1 without a device mesh); reshard reads DTensor (FSDP2) checkpoints only")
          .file(paths[0])
          .tensor(e0.name);
    if (const auto* v = std::get_if<TensorView>(&e0.value)) {
      if (optimizer && v->numel() > 1)
        throw Error("optimizer state " + shape_text(v->size) +
                    " is a plain tensor, not a DTensor (FSDP1's flat-parameter state?): its layout is unknown, "
                    "so it cannot be resharded")
            .file(paths[0])
            .tensor(e0.name);
      kind.plain[e0.name] = {*v, files[0].storage_offset_in_file(*v)};
      reader.add_record(kind.files[0], files[0].storage_record(*v), e0.name);
      continue;
    }
    const auto& d0 = std::get<DTensorValue>(e0.value);
    DTensorPlan plan;
    plan.dtype = d0.local.dtype;
    plan.global_size = d0.global_size;
    if (plan.global_size.empty())
      throw Error("a 0-dim DTensor cannot be resharded along dim 0").file(paths[0]).tensor(e0.name);
    plan.row_elems = row_elems(plan.global_size);
    std::vector<DTensorValue> sources;
    std::vector<std::vector<Runs>> runs;
    for (size_t r = 0; r < files.size(); ++r) {
      auto it = by_name[r].find(e0.name);
      const DTensorValue* d = it == by_name[r].end() ? nullptr : std::get_if<DTensorValue>(&it->second->value);
      try {
        if (d == nullptr) throw Error("is not a DTensor here, but is one on rank 0");
        if (d->global_size != d0.global_size || d->local.dtype != d0.local.dtype)
          throw Error("is " + std::string(dtype_name(d->local.dtype)) + " " + shape_text(d->global_size) + " here but " +
                      std::string(dtype_name(d0.local.dtype)) + " " + shape_text(d0.global_size) + " on rank 0");
        check_source_mesh(e0.name, *d);
        int64_t mesh_ranks = 1;
        for (int64_t n : d->mesh.shape) mesh_ranks *= n;
        if (mesh_ranks != world)
          throw Error("is on a mesh of " + std::to_string(mesh_ranks) + " ranks, but the role has " + std::to_string(world) +
                      " rank files (a sub-mesh: model parallelism along other mesh dims is not resharded)");
        if (!d->local.is_contiguous()) throw Error("its local tensor is not contiguous");
        runs.push_back(dtensor_local_runs(d->global_size, d->placements, d->mesh.shape,
                                          d->mesh.coordinate_of(static_cast<int64_t>(r)), d->shard_order));
        if (runs.back()[0].empty() ? d->local.size[0] != 0 : runs_length(runs.back()[0]) != d->local.size[0])
          throw Error("its local tensor has " + std::to_string(d->local.size[0]) + " rows where its placements give " +
                      std::to_string(runs_length(runs.back()[0])));
        const TorchFile& f = files[r];
        reader.add_record(kind.files[r], f.storage_record(d->local), e0.name);
        plan.row0_offset.push_back(f.storage_offset_in_file(d->local) +
                                   static_cast<uint64_t>(d->local.storage_offset) * dtype_size(d->local.dtype));
        sources.push_back(*d);
      } catch (Error& e) {
        e.file(paths[r]).tensor(e0.name);
        throw;
      }
    }
    try {
      plan.targets = plan_row_moves(e0.name, plan.global_size, runs, mesh.fsdp());
    } catch (Error& e) {
      e.file(paths[0]);
      throw;
    }
    plan.padded = padded_storage(sources, !optimizer);
    kind.dtensors.emplace(e0.name, std::move(plan));
  }
  return kind;
}

// ---- writing ----------------------------------------------------------------------------------

namespace {

// Streams a target storage: byte runs of source files in order, then zeros (padding rows).
struct StorageStream {
  struct Segment {
    uint32_t file;
    uint64_t offset, size;
  };
  const SourceReader* reader;
  std::vector<Segment> segments;
  size_t next = 0;
  uint64_t done_in_next = 0;

  void operator()(char* buf, size_t n) {
    while (n > 0) {
      if (next == segments.size()) {  // padding
        std::memset(buf, 0, n);
        return;
      }
      const Segment& s = segments[next];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, s.size - done_in_next));
      reader->read(s.file, s.offset + done_in_next, buf, take);
      buf += take;
      n -= take;
      done_in_next += take;
      if (done_in_next == s.size) {
        ++next;
        done_in_next = 0;
      }
    }
  }
};

std::string path_join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

class Emitter {
 public:
  Emitter(const SourceKind& kind, const TargetMesh& mesh, int64_t rank, const SourceReader& reader, const std::string& file)
      : kind_(kind), mesh_(mesh), rank_(rank), reader_(reader), file_(file),
        mesh_out_{mesh.shape, mesh.dim_names, mesh.group_names(rank), rank} {}

  TorchSaveWriter& out() { return out_; }

  void emit(const pickle::Value& v, const std::string& path, int depth) {
    using pickle::Kind;
    if (depth > 64) fail(path, "nesting deeper than 64 levels");
    auto& w = out_.pickle();
    if (auto it = memo_.find(&v); it != memo_.end()) {
      w.get(it->second);
      return;
    }
    switch (v.kind) {
      case Kind::None: w.none(); return;
      case Kind::Bool: w.boolean(v.boolean); return;
      case Kind::Int: w.integer(v.integer); return;
      case Kind::BigInt: w.big_integer(v.text); return;
      case Kind::Float: w.real(v.real); return;
      case Kind::Str: w.str(v.text); break;
      case Kind::Bytes: w.bytes(v.text); break;
      case Kind::Tuple:
        if (v.items.empty()) {
          w.empty_tuple();
          return;
        }
        w.mark();
        for (size_t i = 0; i < v.items.size(); ++i) emit(*v.items[i], path_join(path, std::to_string(i)), depth + 1);
        w.tuple();
        break;
      case Kind::List:
        w.empty_list();
        memo_[&v] = w.put();
        if (!v.items.empty()) {
          w.mark();
          for (size_t i = 0; i < v.items.size(); ++i) emit(*v.items[i], path_join(path, std::to_string(i)), depth + 1);
          w.appends();
        }
        return;
      case Kind::Dict:
        if (v.callable != nullptr) {
          out_.global("collections", "OrderedDict");
          w.empty_tuple().reduce();
        } else {
          w.empty_dict();
        }
        memo_[&v] = w.put();
        if (!v.entries.empty()) {
          w.mark();
          for (const auto& [k, val] : v.entries) {
            emit(*k, path, depth + 1);
            const std::string key = k->kind == Kind::Str ? k->text : k->kind == Kind::Int ? std::to_string(k->integer) : "?";
            emit(*val, path_join(path, key), depth + 1);
          }
          w.setitems();
        }
        if (v.state != nullptr) {
          emit(*v.state, path, depth + 1);
          w.build();
        }
        return;
      case Kind::Native:
        tensor(v, path);
        break;
      default:
        fail(path, std::string("a ") + pickle::kind_name(v.kind) + " cannot be copied");
    }
    memo_[&v] = w.put();
  }

 private:
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw Error("reshard: " + what).file(file_).tensor(path);
  }

  void tensor(const pickle::Value& v, const std::string& path) {
    const std::optional<StateEntry> e = tensor_entry(v, path);
    if (!e) fail(path, "a reconstructed value that is not a tensor cannot be copied");
    if (std::holds_alternative<DTensorValue>(e->value)) {
      const auto it = kind_.dtensors.find(path);
      if (it == kind_.dtensors.end()) fail(path, "internal: no plan for this DTensor");
      dtensor(it->second);
      return;
    }
    const auto it = kind_.plain.find(path);
    if (it == kind_.plain.end()) fail(path, "internal: no plan for this tensor");
    const TensorView& view = it->second.view;
    auto [key, fresh] = plain_keys_.try_emplace(view.storage_key, "");
    if (fresh) {
      // The whole storage, from source rank 0.
      StorageStream s{&reader_, {}};
      s.segments.push_back({kind_.files[0], it->second.storage_offset_in_file, view.storage_nbytes});
      key->second = out_.add_storage(view.storage_nbytes, std::move(s));
    }
    out_.tensor(view.dtype, key->second, static_cast<int64_t>(view.storage_nbytes / dtype_size(view.dtype)),
                view.storage_offset, view.size, view.stride);
  }

  void dtensor(const DTensorPlan& p) {
    const TargetRows& t = p.targets[static_cast<size_t>(mesh_.fsdp_index(rank_))];
    const uint64_t row_bytes = static_cast<uint64_t>(p.row_elems) * dtype_size(p.dtype);
    StorageStream s{&reader_, {}};
    for (const RowMove& m : t.moves)
      s.segments.push_back({kind_.files[static_cast<size_t>(m.source)],
                            p.row0_offset[static_cast<size_t>(m.source)] + static_cast<uint64_t>(m.source_row) * row_bytes,
                            static_cast<uint64_t>(m.rows) * row_bytes});
    const int64_t storage_rows = p.padded ? t.padded_rows : t.rows;
    const std::string key = out_.add_storage(static_cast<uint64_t>(storage_rows) * row_bytes, std::move(s));
    std::vector<int64_t> local = p.global_size;
    local[0] = t.rows;
    out_.dtensor({p.dtype, p.global_size, mesh_.placements(), local, key, storage_rows * p.row_elems}, mesh_out_);
  }

  const SourceKind& kind_;
  const TargetMesh& mesh_;
  int64_t rank_;
  const SourceReader& reader_;
  std::string file_;
  MeshOut mesh_out_;
  TorchSaveWriter out_;
  std::unordered_map<const pickle::Value*, uint32_t> memo_;
  std::unordered_map<std::string, std::string> plain_keys_;  // source storage key -> target key
};

}  // namespace

uint64_t write_target_file(const SourceKind& kind, const TargetMesh& mesh, int64_t rank, const SourceReader& reader,
                           const std::string& path) {
  Emitter e(kind, mesh, rank, reader, path);
  e.emit(kind.templ.root(), "", 0);
  return e.out().write(path);
}

}  // namespace shardmerge::reshard
