#include "plan/plan_file.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"
#include "util/base64.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"
#include "util/json_fields.hpp"
#include "util/shape.hpp"

namespace shardmerge {
namespace {

using Json = nlohmann::ordered_json;

// Plans of large models hold many pieces per tensor: far more than a sidecar JSON file.
constexpr size_t kMaxPlanFileBytes = size_t{4} << 30;

// ---------------------------------------------------------------------------------------------
// Writing

Json slice_json(const MergePlan& plan, const Slice& s) {
  Json j;
  j["source"] = s.file;
  j["file"] = plan.sources.at(s.file).path;  // for the reader of the file; `source` is what counts
  j["offset"] = s.offset;
  j["length"] = s.numel() * dtype_size(s.dtype);
  j["dtype"] = dtype_name(s.dtype);
  j["strides"] = s.strides;
  j["dst_start"] = s.start;
  j["dst_extent"] = s.extent;
  return j;
}

Json slices_json(const MergePlan& plan, const std::vector<Slice>& slices) {
  Json out = Json::array();
  for (const Slice& s : slices) out.push_back(slice_json(plan, s));
  return out;
}

Json stamp_json(const std::optional<FileStamp>& s) {
  if (!s) return nullptr;
  return {{"size", s->size}, {"mtime_ns", s->mtime_ns}, {"ctime_ns", s->ctime_ns}, {"inode", s->inode}, {"device", s->device}};
}

Json source_json(const SourceFile& s) {
  Json j;
  j["path"] = s.path;
  j["size"] = s.size;
  j["stamp"] = stamp_json(s.planned);
  j["owner"] = s.owner;
  if (s.compressed)
    j["compressed"] = {{"codec", s.compressed->codec},
                       {"offset", s.compressed->offset},
                       {"length", s.compressed->length},
                       {"decoded_size", s.compressed->decoded_size}};
  else
    j["compressed"] = nullptr;
  return j;
}

// The ops a reader of the file sees: the casts the copies need (derived from their dtypes),
// then the LoRA fold, which holds the fold's own fields.
Json ops_json(const MergePlan& plan, const OutputTensor& t) {
  Json ops = Json::array();
  std::vector<DType> casts;
  for (const auto& s : t.copies)
    if (s.dtype != t.dtype && std::find(casts.begin(), casts.end(), s.dtype) == casts.end()) casts.push_back(s.dtype);
  for (DType from : casts) ops.push_back({{"op", "cast"}, {"from", dtype_name(from)}, {"to", dtype_name(t.dtype)}});
  if (t.lora)
    ops.push_back({{"op", "lora_fold"},
                   {"rank", t.lora->rank},
                   {"scale", t.lora->scale},
                   {"fan_in_fan_out", t.lora->fan_in_fan_out},
                   {"a", slices_json(plan, t.lora->a)},
                   {"b", slices_json(plan, t.lora->b)}});
  return ops;
}

Json tensor_json(const MergePlan& plan, const OutputTensor& t) {
  Json j;
  j["name"] = t.name;
  j["dtype"] = dtype_name(t.dtype);
  j["shape"] = t.shape;
  j["file"] = plan.files.at(t.file).name;
  j["offset"] = t.offset;
  j["nbytes"] = t.nbytes;
  j["origin"] = t.origin;
  j["ops"] = ops_json(plan, t);
  j["copies"] = slices_json(plan, t.copies);
  return j;
}

// ---------------------------------------------------------------------------------------------
// Reading: every field checked, errors naming the plan file and the field's path

class Reader {
 public:
  Reader(const Json& object, std::string path, const std::string& plan_file)
      : j_(object), path_(std::move(path)), file_(plan_file) {
    if (!j_.is_object()) throw Error("'" + path_ + "' is " + shown(j_) + ", not an object").file(file_);
  }

  template <typename T>
  T get(const std::string& key) const {
    present(key);
    return *json_field<T>(j_, key, file_, path_);
  }
  // A T, or nothing for null.
  template <typename T>
  std::optional<T> nullable(const std::string& key) const {
    if (!j_.contains(key)) throw error(key, "is missing");
    return json_field<T>(j_, key, file_, path_);
  }
  const Json& array(const std::string& key) const {
    const Json& v = present(key);
    if (!v.is_array()) throw error(key, "is " + shown(v) + ", not a list");
    return v;
  }
  Reader object(const std::string& key) const { return Reader(present(key), field(key), file_); }
  // An object, or nothing for null.
  std::optional<Reader> nullable_object(const std::string& key) const {
    if (!j_.contains(key)) throw error(key, "is missing");
    if (j_.at(key).is_null()) return std::nullopt;
    return object(key);
  }
  Reader element(const Json& array, const std::string& key, size_t i) const {
    return Reader(array[i], field(key) + "[" + std::to_string(i) + "]", file_);
  }
  std::string field(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  Error error(const std::string& key, const std::string& what) const {
    std::string message = "'";  // appended, not "'" + ...: GCC 12 warns falsely (-Wrestrict) on that
    message += field(key);
    message += "' ";
    message += what;
    return Error(std::move(message)).file(file_);
  }
  static std::string shown(const Json& v) {
    std::string s = v.dump();
    return s.size() > 40 ? s.substr(0, 40) + "..." : s;
  }

 private:
  // The field, which must be there and not null.
  const Json& present(const std::string& key) const {
    const auto it = j_.find(key);
    if (it == j_.end()) throw error(key, "is missing");
    if (it->is_null()) throw error(key, "is null");
    return *it;
  }

  const Json& j_;
  std::string path_;
  const std::string& file_;
};

// A list of T (an integer type or std::string), each element type- and range-checked.
template <typename T>
std::vector<T> read_list(const Reader& r, const std::string& key) {
  std::vector<T> out;
  const Json& a = r.array(key);
  for (size_t i = 0; i < a.size(); ++i) {
    if (!json_fields_detail::holds<T>(a[i]))
      throw r.error(key + "[" + std::to_string(i) + "]",
                    "is " + Reader::shown(a[i]) + ", not " + json_fields_detail::expected_name<T>());
    out.push_back(a[i].template get<T>());
  }
  return out;
}

DType read_dtype(const Reader& r, const std::string& key) {
  const std::string name = r.get<std::string>(key);
  const std::optional<DType> d = dtype_from_torch_name(name);
  if (!d) throw r.error(key, "is \"" + name + "\", not a dtype name such as \"bfloat16\"");
  return *d;
}

class PlanReader {
 public:
  PlanReader(const Json& j, const std::string& plan_file) : top_(j, "", plan_file), file_(plan_file) {}

  MergePlan read() {
    MergePlan p;
    p.source_dir = top_.get<std::string>("source_dir");
    p.layout = top_.get<std::string>("layout");
    top_.object("options");  // information only: must be an object
    p.notes = read_list<std::string>(top_, "notes");
    p.warnings = read_list<std::string>(top_, "warnings");
    each("sources", [&](const Reader& r) { p.sources.push_back(source(r)); });
    each("records", [&](const Reader& r) { p.records.push_back(record(r, p)); });
    std::map<std::string, uint32_t> file_index;
    each("files", [&](const Reader& r) {
      OutputFile f = output_file(r);
      if (!file_index.emplace(f.name, static_cast<uint32_t>(p.files.size())).second)
        throw r.error("name", "is \"" + f.name + "\", the name of an earlier file");
      p.files.push_back(std::move(f));
    });
    each("tensors", [&](const Reader& r) { p.tensors.push_back(tensor(r, p, file_index)); });
    check_tensors_apart(p);
    each("sidecars", [&](const Reader& r) { p.sidecars.push_back(sidecar(r)); });
    return p;
  }

 private:
  template <typename F>
  void each(const std::string& key, F&& read_one) {
    const Json& a = top_.array(key);
    for (size_t i = 0; i < a.size(); ++i) read_one(top_.element(a, key, i));
  }

  SourceFile source(const Reader& r) {
    SourceFile s;
    s.path = r.get<std::string>("path");
    s.size = r.get<uint64_t>("size");
    if (auto st = r.nullable_object("stamp")) {
      FileStamp stamp;
      stamp.size = st->get<uint64_t>("size");
      stamp.mtime_ns = st->get<int64_t>("mtime_ns");
      stamp.ctime_ns = st->get<int64_t>("ctime_ns");
      stamp.inode = st->get<uint64_t>("inode");
      stamp.device = st->get<uint64_t>("device");
      s.planned = stamp;
    }
    s.owner = r.get<int32_t>("owner");
    if (s.owner < kAnyOwner) throw r.error("owner", "is " + std::to_string(s.owner) + ", not a rank or -1 (any process)");
    if (auto c = r.nullable_object("compressed")) {
      CompressedItem item;
      item.codec = c->get<std::string>("codec");
      if (item.codec != "zstd") throw c->error("codec", "is \"" + item.codec + "\"; the only codec is \"zstd\"");
      item.offset = c->get<uint64_t>("offset");
      item.length = c->get<uint64_t>("length");
      item.decoded_size = c->get<uint64_t>("decoded_size");
      if (item.offset > s.size || item.length > s.size - item.offset)
        throw c->error("length", "runs past the end of the file (" + std::to_string(s.size) + " bytes)");
      s.compressed = item;
    }
    return s;
  }

  uint32_t source_index(const Reader& r, const MergePlan& p) {
    const uint32_t i = r.get<uint32_t>("source");
    if (i >= p.sources.size())
      throw r.error("source", "is " + std::to_string(i) + ", but the plan has " + std::to_string(p.sources.size()) +
                                  " sources");
    return i;
  }

  RecordCheck record(const Reader& r, const MergePlan& p) {
    RecordCheck c;
    c.file = source_index(r, p);
    c.record = r.get<std::string>("record");
    c.tensor = r.get<std::string>("tensor");
    c.offset = r.get<uint64_t>("offset");
    c.size = r.get<uint64_t>("size");
    c.crc32 = r.get<uint32_t>("crc32");
    c.crc32_at = r.nullable<uint64_t>("crc32_at");
    const uint64_t end = readable_size(p.sources[c.file]);
    if (c.offset > end || c.size > end - c.offset)
      throw r.error("size", "runs past the end of its source (" + std::to_string(end) + " bytes)");
    if (c.crc32_at && (*c.crc32_at > end || end - *c.crc32_at < 4))
      throw r.error("crc32_at", "runs past the end of its source (" + std::to_string(end) + " bytes)");
    return c;
  }

  OutputFile output_file(const Reader& r) {
    OutputFile f;
    f.name = output_name(r, "name");
    f.size = r.get<uint64_t>("size");
    const std::string text = r.get<std::string>("header_base64");
    std::optional<std::string> header = base64_decode(text);
    if (!header) throw r.error("header_base64", "is not base64 (RFC 4648, padded)");
    f.header = std::move(*header);
    if (f.header.size() > f.size)
      throw r.error("header_base64", "holds " + std::to_string(f.header.size()) + " bytes, more than the file's size");
    return f;
  }

  Slice slice(const Reader& r, const MergePlan& p, size_t ndim) {
    Slice s;
    s.file = source_index(r, p);
    s.offset = r.get<uint64_t>("offset");
    s.dtype = read_dtype(r, "dtype");
    s.strides = read_list<int64_t>(r, "strides");
    s.start = read_list<int64_t>(r, "dst_start");
    s.extent = read_list<int64_t>(r, "dst_extent");
    auto check_rank = [&](const char* key, const std::vector<int64_t>& v) {
      if (v.size() != ndim)
        throw r.error(key, "has " + std::to_string(v.size()) + " entries; the tensor has " + std::to_string(ndim) +
                               " dimensions");
    };
    check_rank("strides", s.strides);
    check_rank("dst_start", s.start);
    check_rank("dst_extent", s.extent);
    check_within_source(r, s, p.sources[s.file]);
    return s;
  }

  // Every byte a piece reads lies inside its source (the decoded item of a compressed one).
  void check_within_source(const Reader& r, const Slice& s, const SourceFile& src) {
    for (int64_t e : s.extent)
      if (e <= 0) return;  // reads nothing (a negative extent is refused by the tiling check)
    const uint64_t end = readable_size(src);
    const Error outside = r.error("offset", "with these strides and extents reads outside its source's " +
                                                std::to_string(end) + " bytes (" + src.path + ")");
    // Element offsets of the lowest and highest element read. Each term is below 2^126; one past
    // 2^80 is outside any file, so the sums cannot overflow.
    constexpr __int128 kBeyondAnyFile = static_cast<__int128>(1) << 80;
    __int128 lo = 0, hi = 0;
    for (size_t d = 0; d < s.extent.size(); ++d) {
      const __int128 reach = static_cast<__int128>(s.extent[d] - 1) * s.strides[d];
      if (reach > kBeyondAnyFile || reach < -kBeyondAnyFile) throw outside;
      (reach < 0 ? lo : hi) += reach;
    }
    const int64_t elem = dtype_size(s.dtype);
    if (s.offset + lo * elem < 0 || s.offset + (hi + 1) * elem > static_cast<__int128>(end)) throw outside;
  }

  static uint64_t readable_size(const SourceFile& s) { return s.compressed ? s.compressed->decoded_size : s.size; }

  std::vector<Slice> slices(const Reader& r, const std::string& key, const MergePlan& p,
                            const std::vector<int64_t>& shape) {
    std::vector<Slice> out;
    const Json& a = r.array(key);
    for (size_t i = 0; i < a.size(); ++i) out.push_back(slice(r.element(a, key, i), p, shape.size()));
    if (auto problem = check_tiling(shape, out))
      throw r.element(a, key, problem->first).error("dst_start", "does not tile " + shape_string(shape) + ": " + problem->message);
    return out;
  }

  OutputTensor tensor(const Reader& r, const MergePlan& p, const std::map<std::string, uint32_t>& file_index) {
    OutputTensor t;
    t.name = r.get<std::string>("name");
    t.dtype = read_dtype(r, "dtype");
    t.shape = read_list<int64_t>(r, "shape");
    for (size_t d = 0; d < t.shape.size(); ++d)
      if (t.shape[d] < 0)
        throw r.error("shape[" + std::to_string(d) + "]", "is " + std::to_string(t.shape[d]) + ": a dimension cannot be negative");
    const std::string file = r.get<std::string>("file");
    const auto it = file_index.find(file);
    if (it == file_index.end()) throw r.error("file", "is \"" + file + "\", not the name of one of the plan's files");
    t.file = it->second;
    t.offset = r.get<uint64_t>("offset");
    t.nbytes = r.get<uint64_t>("nbytes");
    t.origin = r.get<std::string>("origin");
    t.copies = slices(r, "copies", p, t.shape);
    const Json& ops = r.array("ops");
    for (size_t i = 0; i < ops.size(); ++i) {
      const Reader op = r.element(ops, "ops", i);
      const std::string kind = op.get<std::string>("op");
      if (kind == "lora_fold") t.lora = fold(op, p, t);
      else if (kind != "cast") throw op.error("op", "is \"" + kind + "\", not \"cast\" or \"lora_fold\"");
    }
    const OutputFile& f = p.files[t.file];
    unsigned __int128 nbytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) nbytes *= static_cast<uint64_t>(d);
    if (nbytes != t.nbytes)
      throw r.error("nbytes", "is " + std::to_string(t.nbytes) + ", but " + shape_string(t.shape) + " " +
                                  std::string(dtype_name(t.dtype)) + " holds a different number of bytes");
    if (t.offset < f.header.size() || t.offset > f.size || t.nbytes > f.size - t.offset)
      throw r.error("offset", "places the tensor outside the data of " + f.name + " (bytes " +
                                  std::to_string(f.header.size()) + " to " + std::to_string(f.size) + ")");
    return t;
  }

  LoraFold fold(const Reader& r, const MergePlan& p, const OutputTensor& t) {
    if (t.shape.size() != 2) throw r.error("op", "is a LoRA fold of a tensor that is not 2-D");
    LoraFold f;
    f.rank = r.get<int64_t>("rank");
    if (f.rank <= 0) throw r.error("rank", "is " + std::to_string(f.rank) + ", not positive");
    f.scale = r.get<double>("scale");
    f.fan_in_fan_out = r.get<bool>("fan_in_fan_out");
    const int64_t out = f.fan_in_fan_out ? t.shape[1] : t.shape[0];
    const int64_t in = f.fan_in_fan_out ? t.shape[0] : t.shape[1];
    f.a = slices(r, "a", p, {f.rank, in});
    f.b = slices(r, "b", p, {out, f.rank});
    return f;
  }

  // A path the writer creates: relative and inside the target directory.
  static std::string output_name(const Reader& r, const std::string& key) {
    const std::string name = r.get<std::string>(key);
    bool inside = !name.empty() && name.front() != '/' && name.find('\0') == std::string::npos;
    for (const auto& part : std::filesystem::path(name)) inside = inside && part != "." && part != ".." && !part.empty();
    if (!inside) throw r.error(key, "is \"" + name + "\", not a relative path inside the target directory");
    return name;
  }

  // No two output tensors share a byte of a file (each would overwrite the other).
  void check_tensors_apart(const MergePlan& p) const {
    std::vector<size_t> order;
    for (size_t i = 0; i < p.tensors.size(); ++i)
      if (p.tensors[i].nbytes) order.push_back(i);
    auto at = [&](size_t i) { return std::pair(p.tensors[i].file, p.tensors[i].offset); };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at(a) < at(b); });
    for (size_t k = 1; k < order.size(); ++k) {
      const OutputTensor& a = p.tensors[order[k - 1]];
      const OutputTensor& b = p.tensors[order[k]];
      if (a.file == b.file && b.offset - a.offset < a.nbytes)
        throw Error("'tensors[" + std::to_string(order[k]) + "].offset' places '" + b.name + "' over bytes of '" + a.name +
                    "' in " + p.files[a.file].name)
            .file(file_);
    }
  }

  Sidecar sidecar(const Reader& r) {
    Sidecar s;
    s.name = output_name(r, "name");
    s.source = r.get<std::string>("source");
    s.content = r.nullable<std::string>("content");
    return s;
  }

  Reader top_;
  const std::string& file_;
};

// Where `given` first differs from `canonical` (the plan read from it, written again): a
// field the format does not have, or a derived field that disagrees with its sources. Objects
// compare by key, in any order.
std::optional<std::string> first_difference(const Json& given, const Json& canonical, const std::string& path) {
  auto field = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
  if (given.is_object() && canonical.is_object()) {
    for (const auto& [key, value] : given.items()) {
      const auto it = canonical.find(key);
      if (it == canonical.end()) return "'" + field(key) + "' is not a field of a version-1 plan file";
      if (auto d = first_difference(value, *it, field(key))) return d;
    }
    for (const auto& [key, value] : canonical.items())
      if (!given.contains(key)) return "'" + field(key) + "' is missing";
    return std::nullopt;
  }
  if (given.is_array() && canonical.is_array()) {
    if (given.size() != canonical.size())
      return "'" + path + "' has " + std::to_string(given.size()) + " entries, but the plan's other fields make " +
             std::to_string(canonical.size());
    for (size_t i = 0; i < given.size(); ++i)
      if (auto d = first_difference(given[i], canonical[i], path + "[" + std::to_string(i) + "]")) return d;
    return std::nullopt;
  }
  if (given == canonical) return std::nullopt;
  return "'" + path + "' is " + Reader::shown(given) + ", but the plan's other fields make it " + Reader::shown(canonical) +
         " (it is derived from them)";
}

// Parses JSON text, refusing a key given twice in one object (nlohmann would keep the last).
Json parse_strict(const std::string& text, const std::string& plan_file) {
  std::vector<std::set<std::string>> keys;  // of the objects open at each depth
  std::string duplicate;
  Json::parser_callback_t cb = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) keys.emplace_back();
    else if (event == Json::parse_event_t::object_end) keys.pop_back();
    else if (event == Json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second &&
             duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  Json j;
  try {
    j = Json::parse(text, cb);
  } catch (const Json::exception& e) {
    throw Error(std::string("not a valid JSON plan file (") + e.what() + ")").file(plan_file);
  }
  if (!duplicate.empty()) throw Error("the key '" + duplicate + "' appears twice in one object").file(plan_file);
  return j;
}

}  // namespace

MergePlan plan_from_json(const nlohmann::ordered_json& j, const std::string& plan_file) {
  if (!j.is_object()) throw Error("not a shardmerge plan file (the top level is not a JSON object)").file(plan_file);
  const auto version = j.find("shardmerge_plan");
  if (version == j.end())
    throw Error("not a shardmerge plan file: no 'shardmerge_plan' version field (write one with `shardmerge plan "
                "--out`)")
        .file(plan_file);
  if (*version != kPlanFileVersion)
    throw Error("'shardmerge_plan' is " + Reader::shown(*version) + ": this shardmerge reads plan files of version " +
                std::to_string(kPlanFileVersion) + " only (make the plan again with this shardmerge)")
        .file(plan_file);
  MergePlan plan = PlanReader(j, plan_file).read();
  if (auto d = first_difference(j, plan_to_json(plan, j.at("options")), "")) throw Error(*d).file(plan_file);
  return plan;
}

MergePlan parse_plan_file(const std::string& text, const std::string& plan_file) {
  return plan_from_json(parse_strict(text, plan_file), plan_file);
}

MergePlan read_plan_file(const std::string& path) { return parse_plan_file(read_small_file(path, kMaxPlanFileBytes), path); }

void write_plan_file(const std::string& path, const MergePlan& plan, const nlohmann::ordered_json& options) {
  const std::string text = plan_to_json(plan, options).dump(2) + "\n";
  const std::filesystem::path target = std::filesystem::absolute(path);
  const std::string temp = (target.parent_path() / ("." + target.filename().string() + ".tmp-" +
                                                    std::to_string(::getpid())))
                               .string();
  try {
    File f = File::create(temp, /*overwrite=*/true);
    f.write_exact(0, text.data(), text.size());
    f.sync();
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    throw Error(std::string("cannot write the plan file: ") + std::strerror(err)).file(path);
  }
  fsync_dir(target.parent_path().string());
}

void confirm_sources_unchanged(MergePlan& plan, const std::string& plan_file, int32_t rank) {
  for (SourceFile& s : plan.sources) {
    if (rank >= 0 && s.owner != kAnyOwner && s.owner != rank) continue;  // another process's to read
    if (!s.planned)
      throw Error("the plan file " + plan_file + " records no size and mtime for this source, so it cannot tell "
                  "whether it changed; make the plan with `shardmerge plan --out`")
          .file(s.path);
    const FileStamp now = file_stamp(File::open_read(s.path));
    if (auto change = stamp_change(*s.planned, now, StampMatch::SizeAndMtime))
      throw Error("changed since the plan " + plan_file + " was made (" + *change + "); make the plan again")
          .file(s.path);
    s.planned = now;
  }
}

nlohmann::ordered_json plan_to_json(const MergePlan& plan, const nlohmann::ordered_json& options) {
  Json j;
  j["shardmerge_plan"] = kPlanFileVersion;
  j["source_dir"] = plan.source_dir;
  j["layout"] = plan.layout;
  j["options"] = options;
  j["bytes_read"] = plan.bytes_read();
  j["bytes_written"] = plan.bytes_written();
  j["notes"] = plan.notes;
  j["warnings"] = plan.warnings;
  auto& sources = j["sources"] = Json::array();
  for (const auto& s : plan.sources) sources.push_back(source_json(s));
  auto& files = j["files"] = Json::array();
  for (const auto& f : plan.files)
    files.push_back({{"name", f.name}, {"size", f.size}, {"header_base64", base64_encode(f.header)}});
  auto& tensors = j["tensors"] = Json::array();
  for (const auto& t : plan.tensors) tensors.push_back(tensor_json(plan, t));
  auto& records = j["records"] = Json::array();
  for (const auto& r : plan.records)
    records.push_back({{"source", r.file},
                       {"file", plan.sources.at(r.file).path},
                       {"record", r.record},
                       {"tensor", r.tensor},
                       {"offset", r.offset},
                       {"size", r.size},
                       {"crc32", r.crc32},
                       {"crc32_at", r.crc32_at ? Json(*r.crc32_at) : Json(nullptr)}});
  auto& side = j["sidecars"] = Json::array();
  for (const auto& s : plan.sidecars)
    side.push_back({{"name", s.name}, {"source", s.source}, {"content", s.content ? Json(*s.content) : Json(nullptr)}});
  return j;
}

}  // namespace shardmerge
