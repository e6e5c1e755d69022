#include "plan/combine.hpp"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string_view>

#include "formats/dcp.hpp"
#include "geometry/sharding.hpp"
#include "layouts/megatron.hpp"
#include "layouts/names.hpp"
#include "plan/megatron_tp.hpp"
#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"
#include "util/shape.hpp"
#include "util/text.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
// Summaries and roles are layouts' types; the combine step reads them, nothing else.
using namespace layouts;

SourceSet combine_dcp(const DcpSummary& summary) {
  const DcpMetadata& meta = summary.metadata;
  const std::string& dir = meta.dir;
  SourceSet set;
  std::map<std::string, uint32_t> file_index;  // stored items' .distcp path -> SourceSet::files index
  size_t skipped = 0, chunks = 0;
  for (const DcpTensor& t : meta.tensors) {
    if (is_training_state(t.fqn)) {
      ++skipped;
      continue;
    }
    if (meta.reformulated_shapes.count(t.fqn))
      throw Error("is stored N-D flattened (distributed-optimizer layout), not as a model weight").tensor(t.fqn).file(dir);
    SourceTensor s;
    s.name = t.fqn;
    s.dtype = t.dtype;
    s.shape = t.size;
    s.origin = std::to_string(t.chunks.size()) + " DCP chunk(s)";
    for (const DcpChunk& c : t.chunks) {
      const std::string path = (fs::path(dir) / c.relative_path).string();
      try {
        const auto stamp = summary.data_files.find(c.relative_path);
        if (stamp == summary.data_files.end()) throw Error("no summary of the data file");
        check_item_within(c, stamp->second.size);
        if (item_coding(c) == DcpItemCoding::Zstd) {
          // Its own source: the executor decodes the item's archive up to the end of the storage
          // record and its CRC-32; slices and the record address those decoded bytes.
          const auto item = summary.compressed_items.find({c.relative_path, c.offset});
          if (item == summary.compressed_items.end())
            throw Error("no summary of the compressed item at offset " + std::to_string(c.offset));
          const ZipEntry& record = item->second.record;
          const std::optional<uint64_t> crc32_at = item->second.crc32_at;
          const auto fi = static_cast<uint32_t>(set.files.size());
          SourceFile file(path, stamp->second.size, stamp->second);
          const uint64_t needed = crc32_at ? std::max(record.data_offset + record.size, *crc32_at + 4) : record.data_offset + record.size;
          file.compressed = CompressedItem{"zstd", c.offset, c.length, needed};
          set.files.push_back(std::move(file));
          s.pieces.push_back(view_to_slice(fi, record.data_offset, item->second.view, c.offsets));
          set.records.push_back(record_check(fi, record, t.fqn));
          set.records.back().crc32_at = crc32_at;
        } else {
          const auto item = summary.stored_items.find({c.relative_path, c.offset});
          if (item == summary.stored_items.end()) throw Error("no summary of the item at offset " + std::to_string(c.offset));
          auto [it, fresh] = file_index.try_emplace(path, static_cast<uint32_t>(set.files.size()));
          if (fresh) set.files.push_back({path, stamp->second.size, stamp->second});
          s.pieces.push_back(view_to_slice(it->second, item->second.record.data_offset, item->second.view, c.offsets));
          set.records.push_back(record_check(it->second, item->second.record, t.fqn));
        }
      } catch (Error& e) {
        throw e.tensor(t.fqn).file(path);
      }
      ++chunks;
    }
    if (auto problem = check_tiling(s.shape, s.pieces))
      throw Error("DCP chunks do not tile the tensor: " + problem->message).tensor(t.fqn).file(dir);
    set.tensors.push_back(std::move(s));
  }
  set.description = "torch DCP checkpoint: " + std::to_string(set.tensors.size()) + " tensors in " +
                    std::to_string(chunks) + " chunks across " + std::to_string(set.files.size()) + " file(s)";
  if (skipped) set.notes.push_back(std::to_string(skipped) + " optimizer/scheduler/rng tensors in the tree are ignored");
  if (!meta.bytes_items.empty())
    set.notes.push_back(std::to_string(meta.bytes_items.size()) + " non-tensor items (extra states, rng) are ignored");
  return set;
}

namespace {

// Layer, chunk and expert indices in names. Bounded far above any real model so that
// sums of them (layer offsets, "index + 1") cannot overflow.
constexpr int64_t kMaxNameIndex = int64_t{1} << 31;

// A decimal [0, kMaxNameIndex) spanning all of `digits`; nullopt otherwise (signs included).
std::optional<int64_t> name_index(std::string_view digits) {
  const auto v = parse_decimal(digits);
  if (!v || *v >= kMaxNameIndex) return std::nullopt;
  return v;
}

// "<index>.<rest>": the index, and in `end` the position of the dot.
std::optional<int64_t> leading_index(const std::string& s, size_t& end) {
  end = s.find('.');
  if (end == std::string::npos) return std::nullopt;
  return name_index(std::string_view(s).substr(0, end));
}

struct RankFile {
  int64_t tp = 0, pp = 0, ep = 0;
  const TorchFileSummary* file = nullptr;
  uint32_t file_index = 0;
};

// One tensor of one TP rank, in one (pp, vpp) chunk.
struct Shard {
  int64_t tp;
  const TensorView* view;
  const RankFile* rank;
};

Slice whole_view(const RankFile& r, const TensorView& v) {
  return view_to_slice(r.file_index, r.file->record_of(v).data_offset, v, std::vector<int64_t>(v.size.size(), 0));
}

// Concatenates TP shards along `dim` into one SourceTensor.
SourceTensor concat(const std::string& name, const std::vector<Shard>& shards, size_t dim, const std::string& origin) {
  std::vector<int64_t> shape = shards.front().view->size;
  int64_t at = 0;
  SourceTensor out;
  out.name = name;
  out.dtype = shards.front().view->dtype;
  out.origin = origin;
  if (dim >= shape.size())
    throw Error("has " + std::to_string(shape.size()) + " dims; its TP shards are concatenated along dim " +
                std::to_string(dim))
        .tensor(name)
        .file(shards.front().rank->file->path);
  for (const Shard& s : shards) {
    if (s.view->dtype != out.dtype || s.view->size.size() != shape.size())
      throw Error("TP shards disagree in dtype or rank").tensor(name).file(s.rank->file->path);
    Slice slice = whole_view(*s.rank, *s.view);
    slice.start[dim] = at;
    if (__builtin_add_overflow(at, s.view->size[dim], &at))
      throw Error("TP shards together are longer than 2^63 along dim " + std::to_string(dim)).tensor(name);
    out.pieces.push_back(std::move(slice));
  }
  shape[dim] = at;
  out.shape = shape;
  return out;
}

// fc1 of a SwiGLU MLP: rank r holds [gate_r; up_r]; the global tensor is [gate; up].
SourceTensor concat_gate_up(const std::string& name, const std::vector<Shard>& shards, const std::string& origin) {
  int64_t total = 0;
  for (const Shard& s : shards) {
    if (s.view->size.empty() || s.view->size[0] % 2) throw Error("fc1 shard with an odd number of rows").tensor(name);
    if (__builtin_add_overflow(total, s.view->size[0] / 2, &total) || total > std::numeric_limits<int64_t>::max() / 2)
      throw Error("fc1 TP shards together have more than 2^63 rows").tensor(name);
  }
  SourceTensor out;
  out.name = name;
  out.dtype = shards.front().view->dtype;
  out.shape = shards.front().view->size;
  out.shape[0] = 2 * total;
  out.origin = origin;
  int64_t at = 0;
  for (const Shard& s : shards) {
    const Slice w = whole_view(*s.rank, *s.view);
    const int64_t half = s.view->size[0] / 2;
    auto band = w.extent;
    band[0] = half;
    std::vector<int64_t> lo(w.start.size(), 0), hi = lo;
    hi[0] = half;
    Slice gate = *intersect(w, lo, band), up = *intersect(w, hi, band);
    gate.start[0] = at;
    up.start[0] = total + at;
    out.pieces.push_back(std::move(gate));
    out.pieces.push_back(std::move(up));
    at += half;
  }
  return out;
}

// The TP/PP/EP indices of each mp_rank directory, in role.mp_rank_dirs order; `any_three` says
// whether some name had three indices.
std::vector<RankFile> mp_ranks(const MegatronRole& role, bool& any_three) {
  std::vector<RankFile> ranks;
  any_three = false;
  const auto dirs = static_cast<int64_t>(role.mp_rank_dirs.size());
  for (const std::string& dir : role.mp_rank_dirs) {
    const auto name = parse_mp_rank_dir(fs::path(dir).filename().string());
    if (!name) throw Error("not an mp_rank_<tp>[_<pp>][_<ep>] directory").file(dir);
    RankFile r;
    r.tp = name->tp;
    r.pp = name->pp.value_or(0);
    r.ep = name->ep.value_or(0);
    // Every rank index is below the directory count of a complete tree; checking it first
    // also keeps "index + 1" and tp * pp * ep below from overflowing.
    if (r.tp >= dirs || r.pp >= dirs || r.ep >= dirs)
      throw Error("rank index past the " + std::to_string(dirs) + " mp_rank directories of the checkpoint (missing ranks?)")
          .file(dir);
    any_three = any_three || name->ep.has_value();
    ranks.push_back(r);
  }
  return ranks;
}

}  // namespace

void check_mp_rank_dirs(const MegatronRole& role) {
  bool any_three = false;
  mp_ranks(role, any_three);
}

SourceSet combine_megatron_legacy(const MegatronRole& role, const nlohmann::ordered_json& config,
                                  const std::vector<TorchFileSummary>& files) {
  if (files.size() != role.mp_rank_dirs.size())
    throw Error(std::to_string(files.size()) + " file summaries for " + std::to_string(role.mp_rank_dirs.size()) +
                " mp_rank directories").file(role.path);
  bool any_three = false;
  std::vector<RankFile> ranks = mp_ranks(role, any_three);
  SourceSet set;
  for (size_t i = 0; i < ranks.size(); ++i) {
    ranks[i].file = &files[i];
    ranks[i].file_index = static_cast<uint32_t>(set.files.size());
    set.files.push_back({files[i].path, files[i].stamp.size, files[i].stamp});
  }
  // mp_rank_<tp>_<x> is a PP rank, unless every file holds both the embedding and the final
  // norm: then there is one stage and x is the EP rank.
  auto has = [](const TorchFileSummary& f, const std::string& suffix) {
    return std::any_of(f.entries.begin(), f.entries.end(), [&](const StateEntry& e) {
      return e.name.size() >= suffix.size() && e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0;
    });
  };
  if (!any_three && std::all_of(ranks.begin(), ranks.end(), [&](const RankFile& r) {
        return has(*r.file, "embedding.word_embeddings.weight") && has(*r.file, "decoder.final_layernorm.weight");
      }))
    for (auto& r : ranks) std::swap(r.pp, r.ep);

  int64_t tp = 0, pp = 0, ep = 0;
  for (const auto& r : ranks) {
    tp = std::max(tp, r.tp + 1);
    pp = std::max(pp, r.pp + 1);
    ep = std::max(ep, r.ep + 1);
  }
  if (static_cast<int64_t>(ranks.size()) != tp * pp * ep)
    throw Error("expected " + std::to_string(tp * pp * ep) + " mp_rank directories for tp=" + std::to_string(tp) +
                " pp=" + std::to_string(pp) + " ep=" + std::to_string(ep) + ", found " + std::to_string(ranks.size()))
        .file(role.path);
  const int64_t experts = json_field<int64_t>(config, "num_experts", "config.json").value_or(0);
  const int64_t moe_ffn = json_field<int64_t>(config, "moe_intermediate_size", "config.json").value_or(0);

  // (pp, vpp chunk, ep, key) -> TP shards, and each (pp, chunk)'s local layer count.
  std::map<std::tuple<int64_t, int64_t, int64_t, std::string>, std::vector<Shard>> keys;
  std::map<std::pair<int64_t, int64_t>, int64_t> chunk_layers;  // (vpp chunk, pp) -> layers
  for (const auto& r : ranks) {
    for (const StateEntry& e : r.file->entries) {
      const auto* v = std::get_if<TensorView>(&e.value);
      if (!v) throw Error("legacy per-rank files hold plain tensors; found a sharded one").tensor(e.name).file(r.file->path);
      size_t dot = 0;
      int64_t chunk = 0;
      std::string key = e.name;
      if (auto c = leading_index(key, dot)) {  // a list of per-VPP-chunk state dicts
        chunk = *c;
        key = key.substr(dot + 1);
      }
      if (key.find("_extra_state") != std::string::npos) continue;
      if (key.rfind("model.", 0) == 0 || key.rfind("lm_head.", 0) == 0)
        throw Error("verl 0.3 (L0) per-rank checkpoints with verl's own parallel model names are not supported")
            .tensor(e.name).file(r.file->path);
      const std::string layers = "decoder.layers.";
      if (key.rfind(layers, 0) == 0 && r.tp == 0 && r.ep == 0)
        if (auto l = leading_index(key.substr(layers.size()), dot))
          chunk_layers[{chunk, r.pp}] = std::max(chunk_layers[{chunk, r.pp}], *l + 1);
      keys[{r.pp, chunk, r.ep, key}].push_back({r.tp, v, &r});
      set.records.push_back(record_check(r.file_index, r.file->record_of(*v), e.name));
    }
  }
  // Global layer offsets: chunks in (vpp outer, pp inner) order, as Megatron's interleaved schedule.
  std::map<std::pair<int64_t, int64_t>, int64_t> offset;
  int64_t next = 0;
  for (const auto& [chunk_pp, count] : chunk_layers) {
    offset[chunk_pp] = next;
    next += count;
  }

  std::map<std::string, SourceTensor> by_name;
  for (auto& [k, shards] : keys) {
    auto [p, chunk, ep_rank, key] = k;
    std::sort(shards.begin(), shards.end(), [](const Shard& a, const Shard& b) { return a.tp < b.tp; });
    if (static_cast<int64_t>(shards.size()) != tp)
      throw Error("present on " + std::to_string(shards.size()) + " of " + std::to_string(tp) + " TP ranks").tensor(key).file(role.path);
    std::string name = key;
    const std::string layers = "decoder.layers.";
    size_t dot = 0;
    if (key.rfind(layers, 0) == 0)
      if (auto l = leading_index(key.substr(layers.size()), dot)) {
        std::string rest = key.substr(layers.size() + dot + 1);
        // Local experts: TEGroupedMLP "mlp.experts.linear_fc1.weight<j>", SequentialMLP "mlp.experts.local_experts.<j>.".
        int64_t local_expert = -1;
        const std::string grouped = "mlp.experts.linear_fc", seq = "mlp.experts.local_experts.";
        if (rest.rfind(grouped, 0) == 0 && rest.find(".weight") != std::string::npos) {
          const size_t w = rest.find(".weight");
          const auto j = name_index(std::string_view(rest).substr(w + 7));
          if (!j) throw Error("grouped expert weight without an expert number after '.weight'").tensor(key);
          local_expert = *j;
          rest = "mlp.experts.*." + rest.substr(12, w + 7 - 12);
        } else if (rest.rfind(seq, 0) == 0) {
          size_t d2 = 0;
          const auto j = leading_index(rest.substr(seq.size()), d2);
          if (!j) throw Error("local expert without an expert number after '" + seq + "'").tensor(key);
          local_expert = *j;
          rest = "mlp.experts.*." + rest.substr(seq.size() + d2 + 1);
        }
        if (local_expert >= 0) {
          if (experts <= 0) throw Error("expert tensors but config.json has no num_experts").tensor(key);
          if (local_expert >= experts / ep)
            throw Error("local expert " + std::to_string(local_expert) + " but each of the " + std::to_string(ep) +
                        " EP ranks holds " + std::to_string(experts / ep) + " of config.json's " + std::to_string(experts) +
                        " experts")
                .tensor(key);
          const int64_t global = ep_rank * (experts / ep) + local_expert;
          rest.replace(rest.find('*'), 1, std::to_string(global));
        }
        const auto base = offset.find({chunk, p});
        if (base == offset.end())
          throw Error("layer tensor of a model chunk that TP rank 0 (EP rank 0) does not have").tensor(key).file(role.path);
        name = layers + std::to_string(base->second + *l) + "." + rest;
      }
    const std::string origin = "legacy mp_rank, tp=" + std::to_string(tp);
    SourceTensor t;
    switch (legacy_tp_split(name, shards[0].view->size, tp, moe_ffn)) {
      case LegacyTpSplit::Replicated: t = concat(name, {shards.front()}, 0, origin); break;
      case LegacyTpSplit::Dim0: t = concat(name, shards, 0, origin); break;
      case LegacyTpSplit::Dim1: t = concat(name, shards, 1, origin); break;
      case LegacyTpSplit::GateUp: t = concat_gate_up(name, shards, origin); break;
    }
    if (by_name.count(name)) {
      // The same weight on several stages: the tied output layer's copy on the last stage.
      if (name.rfind("output_layer", 0) != 0) throw Error("appears twice across pipeline stages").tensor(name).file(role.path);
      continue;
    }
    by_name.emplace(name, std::move(t));
  }
  if (experts > 0) {
    for (int64_t l = 0; l < next; ++l)
      for (int64_t e = 0; e < experts; ++e)
        for (const char* part : {"linear_fc1.weight", "linear_fc2.weight"}) {
          const std::string n = "decoder.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + "." + part;
          if (!by_name.count(n))
            throw Error("expert " + std::to_string(e) + " of layer " + std::to_string(l) +
                        " is in no mp_rank file (EP ranks that never saved?)")
                .file(role.path);
        }
  }
  for (auto& [_, t] : by_name) set.tensors.push_back(std::move(t));
  set.description = "Megatron legacy per-rank files: tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) +
                    " ep=" + std::to_string(ep) + ", " + std::to_string(chunk_layers.size()) + " model chunk(s), " +
                    std::to_string(next) + " layers";
  return set;
}

}  // namespace shardmerge
