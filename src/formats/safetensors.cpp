#include "formats/safetensors.hpp"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "shardmerge/error.hpp"
#include "util/bytes.hpp"
#include "util/file.hpp"
#include "util/json_text.hpp"

namespace shardmerge {
namespace {

using json = nlohmann::json;

Error header_error(const std::string& what) { return Error("invalid safetensors header: " + what); }

uint64_t checked_nbytes(DType dtype, const std::vector<int64_t>& shape, const std::string& name) {
  unsigned __int128 n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) throw header_error("negative dimension in tensor '" + name + "'");
    n *= static_cast<uint64_t>(d);
    if (n > std::numeric_limits<uint64_t>::max()) throw header_error("size of tensor '" + name + "' overflows");
  }
  return static_cast<uint64_t>(n);
}

// Parses the header JSON, refusing duplicate top-level names (the Rust reader silently keeps
// the last one; we would rather not guess which tensor the writer meant).
json parse_header_json(std::string_view text) {
  // nlohmann's lexer takes a NUL byte for the end of the input and ignores whatever follows
  // it; serde_json (the reference reader) allows only JSON whitespace after the object, and a
  // NUL cannot occur in valid JSON at all, not even inside a string.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw header_error("byte 0x00 at header byte " + std::to_string(nul) +
                       ": the header must be JSON padded with spaces only");
  int depth = 0;
  std::unordered_set<std::string> names;
  std::string duplicate;
  json::parser_callback_t cb = [&](int d, json::parse_event_t event, json& parsed) {
    (void)d;
    if (event == json::parse_event_t::object_start) ++depth;
    if (event == json::parse_event_t::object_end) --depth;
    if (event == json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    throw header_error(std::string("not valid UTF-8 JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) throw header_error("tensor name '" + duplicate + "' appears twice");
  if (!header.is_object()) throw header_error("top level is not a JSON object");
  return header;
}

}  // namespace

uint64_t TensorDecl::nbytes() const { return checked_nbytes(dtype, shape, name); }

SafetensorsFile SafetensorsFile::from_header(std::string_view header_json, uint64_t file_size) {
  if (header_json.size() > kSafetensorsMaxHeader)
    throw header_error("header of " + std::to_string(header_json.size()) + " bytes exceeds 100 MB");
  const uint64_t data_start = 8 + header_json.size();
  if (data_start > file_size) throw header_error("header runs past the end of the file");
  const json header = parse_header_json(header_json);

  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw header_error("__metadata__ is not an object");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) throw header_error("__metadata__ value for '" + k + "' is not a string");
        out.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!info.is_object()) throw header_error("entry '" + name + "' is not an object");
    const auto dt = info.find("dtype");
    const auto shape = info.find("shape");
    const auto offsets = info.find("data_offsets");
    if (dt == info.end() || !dt->is_string()) throw header_error("tensor '" + name + "' has no dtype string");
    if (shape == info.end() || !shape->is_array()) throw header_error("tensor '" + name + "' has no shape array");
    if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2)
      throw header_error("tensor '" + name + "' has no [begin, end] data_offsets");
    SafetensorsTensor t;
    t.name = name;
    auto dtype = dtype_from_safetensors(dt->get<std::string>());
    if (!dtype) throw header_error("tensor '" + name + "' has unknown dtype '" + dt->get<std::string>() + "'");
    t.dtype = *dtype;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) throw header_error("tensor '" + name + "' has a non-integer or negative dimension");
      uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw header_error("tensor '" + name + "' has a dimension too large");
      t.shape.push_back(static_cast<int64_t>(v));
    }
    for (const auto& o : *offsets)
      if (!o.is_number_unsigned()) throw header_error("tensor '" + name + "' has a negative or non-integer offset");
    const uint64_t begin = (*offsets)[0].get<uint64_t>();
    const uint64_t end = (*offsets)[1].get<uint64_t>();
    if (end < begin) throw header_error("tensor '" + name + "' ends before it begins");
    t.nbytes = checked_nbytes(t.dtype, t.shape, name);
    if (end - begin != t.nbytes)
      throw header_error("tensor '" + name + "' has " + std::to_string(end - begin) + " bytes of data but its shape and dtype need " +
                         std::to_string(t.nbytes));
    spans.push_back({begin, end, out.tensors_.size()});
    out.tensors_.push_back(std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  std::vector<SafetensorsTensor> ordered;
  for (const Span& s : spans) {
    const std::string& name = out.tensors_[s.index].name;
    if (s.begin < expected) throw header_error("tensor '" + name + "' overlaps the tensor before it");
    if (s.begin > expected)
      throw header_error("hole of " + std::to_string(s.begin - expected) + " bytes before tensor '" + name + "'");
    expected = s.end;
    ordered.push_back(std::move(out.tensors_[s.index]));
    ordered.back().file_offset = data_start + s.begin;
  }
  if (file_size - data_start < expected)
    throw header_error("file is truncated: tensor data ends at byte " + std::to_string(data_start + expected) +
                       " but the file has " + std::to_string(file_size) + " bytes");
  if (file_size - data_start > expected)
    throw header_error(std::to_string(file_size - data_start - expected) + " trailing bytes after the tensor data, which ends at byte " +
                       std::to_string(data_start + expected));
  out.tensors_ = std::move(ordered);
  for (size_t i = 0; i < out.tensors_.size(); ++i) out.by_name_.emplace(out.tensors_[i].name, i);
  return out;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  try {
    File f = File::open_read(path);
    const uint64_t size = f.size();
    if (size < 8) throw header_error("file has " + std::to_string(size) + " bytes, fewer than the 8-byte header length");
    uint64_t n = 0;
    f.read_exact(0, &n, 8);
    if (n > kSafetensorsMaxHeader) throw header_error("header length " + std::to_string(n) + " exceeds 100 MB");
    if (8 + n > size)
      throw header_error("header length " + std::to_string(n) + " runs past the end of the " + std::to_string(size) +
                         "-byte file");
    SafetensorsFile out = from_header(f.read_string(8, static_cast<size_t>(n)), size);
    out.path_ = path;
    return out;
  } catch (Error& e) {
    e.file(path);
    throw;
  }
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

SafetensorsLayout layout_safetensors(const std::vector<TensorDecl>& tensors, const std::map<std::string, std::string>& metadata) {
  SafetensorsLayout layout;
  layout.order.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) layout.order[i] = i;
  std::sort(layout.order.begin(), layout.order.end(), [&tensors](size_t ia, size_t ib) {
    const TensorDecl &a = tensors[ia], &b = tensors[ib];
    const auto ra = dtype_info(a.dtype).st_alignment_rank, rb = dtype_info(b.dtype).st_alignment_rank;
    return ra != rb ? ra > rb : a.name < b.name;
  });
  // The header object in this order, written entry by entry: an ordered_json object looks keys
  // up one by one, which is quadratic in the tensor count (100k per-expert tensors in one file).
  std::string text = "{";
  if (!metadata.empty()) text += "\"__metadata__\":" + nlohmann::json(metadata).dump();
  std::unordered_set<std::string_view> names;
  names.reserve(tensors.size());
  layout.tensors.reserve(tensors.size());
  uint64_t offset = 0;
  for (size_t i : layout.order) {
    const TensorDecl& t = tensors[i];
    // A repeated name would silently replace the first one's header entry and leave a hole.
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      throw Error(t.name == "__metadata__" ? "is a reserved name in safetensors" : "appears twice").tensor(t.name);
    const auto& info = dtype_info(t.dtype);
    if (info.st_name.empty())
      throw Error("dtype " + std::string(info.torch_name) + " cannot be stored in safetensors").tensor(t.name);
    const uint64_t n = t.nbytes();
    if (text.size() > 1) text += ',';
    append_json_string(text, t.name);
    text += ":{\"dtype\":\"";
    text += info.st_name;
    text += "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d) text += ',';
      text += std::to_string(t.shape[d]);
    }
    text += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    layout.tensors.push_back({t.name, t.dtype, t.shape, offset, n});
    offset += n;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  append_le<uint64_t>(layout.header, text.size());
  layout.header += text;
  for (auto& t : layout.tensors) t.file_offset += layout.header.size();
  layout.file_size = layout.header.size() + offset;
  return layout;
}

void write_safetensors(const std::string& path, const std::vector<TensorDecl>& tensors, const std::vector<std::string>& data,
                       const std::map<std::string, std::string>& metadata) {
  const SafetensorsLayout layout = layout_safetensors(tensors, metadata);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  File f = File::create(path);
  f.write_exact(0, layout.header.data(), layout.header.size());
  for (const auto& placed : layout.tensors) {
    const std::string& bytes = data.at(index.at(placed.name));
    if (bytes.size() != placed.nbytes)
      throw Error("has " + std::to_string(bytes.size()) + " bytes, expected " + std::to_string(placed.nbytes))
          .tensor(placed.name);
    f.write_exact(placed.file_offset, bytes.data(), bytes.size());
  }
  f.sync();
}

}  // namespace shardmerge
