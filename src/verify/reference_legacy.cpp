// Legacy Megatron per-rank files for `verify`, reassembled from the spec of the legacy merger
// (research notes verl-megatron §5.3, §5.4) with per-dim index lists, not from
// layouts/megatron.cpp's slices:
//  - PP/VPP: chunks in (vpp outer, pp inner) order; each adds (largest local layer) + 1.
//  - EP: local expert j of EP rank e is expert e * (E / ep) + j.
//  - TP: which dim a parameter is split along is plan/megatron_tp.hpp's table, the one rule the
//    planner reads too (the files say nothing of it; the e2e tests pin it to megatron-core's
//    output). What stays independent here is the assembly: fc1 rank r holds [gate_r; up_r], so its
//    rows are gathered as index lists; everything else is placed shard after shard along that dim.
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>

#include "layouts/names.hpp"
#include "plan/megatron_tp.hpp"
#include "shardmerge/error.hpp"
#include "util/text.hpp"
#include "verify/reference_assembly.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

// "<n>.<rest>" -> n and rest.
std::optional<std::pair<int64_t, std::string>> split_index(const std::string& s) {
  const size_t dot = s.find('.');
  if (dot == std::string::npos) return std::nullopt;
  if (auto n = parse_decimal(std::string_view(s).substr(0, dot))) return std::make_pair(*n, s.substr(dot + 1));
  return std::nullopt;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

struct RankFile {
  int64_t tp = 0, pp = 0, ep = 0;
  uint32_t file = 0;
  TorchFile torch;
};

struct Held {
  int64_t tp;
  const RankFile* rank;
  const TensorView* view;
};

}  // namespace

ReferenceSources reference_from_megatron_legacy(const layouts::MegatronRole& role,
                                                const nlohmann::ordered_json& config) {
  ReferenceSources out;
  std::vector<RankFile> ranks;
  bool three_part = false;
  for (const std::string& dir : role.mp_rank_dirs) {
    const auto name = layouts::parse_mp_rank_dir(fs::path(dir).filename().string());
    if (!name) throw Error("verify: not an mp_rank directory").file(dir);
    three_part = three_part || name->ep.has_value();
    RankFile r{name->tp, name->pp.value_or(0), name->ep.value_or(0), static_cast<uint32_t>(out.files.size()),
               TorchFile::open((fs::path(dir) / "model.pt").string())};
    out.files.push_back(r.torch.path());
    ranks.push_back(std::move(r));
  }
  auto holds = [](const TorchFile& f, const std::string& suffix) {
    return std::any_of(f.entries().begin(), f.entries().end(), [&](const StateEntry& e) {
      return e.name.size() >= suffix.size() &&
             e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0;
    });
  };
  // mp_rank_<tp>_<x>: x is the EP rank when every file has both ends of the model (one stage).
  if (!three_part && std::all_of(ranks.begin(), ranks.end(), [&](const RankFile& r) {
        return holds(r.torch, "embedding.word_embeddings.weight") && holds(r.torch, "decoder.final_layernorm.weight");
      }))
    for (RankFile& r : ranks) std::swap(r.pp, r.ep);
  int64_t tp = 0, ep = 0;
  for (const RankFile& r : ranks) {
    tp = std::max(tp, r.tp + 1);
    ep = std::max(ep, r.ep + 1);
  }
  const int64_t experts = config.value("num_experts", int64_t{0});
  const int64_t moe_ffn = config.value("moe_intermediate_size", int64_t{0});

  // Pass 1: layers per (vpp chunk, pp stage), from TP rank 0 / EP rank 0.
  std::map<std::pair<int64_t, int64_t>, int64_t> layers_in;  // (chunk, pp) -> count
  auto chunk_and_key = [](const std::string& name) {
    if (auto c = split_index(name)) return *c;  // "<chunk>.<key>": a list of per-VPP-chunk state dicts
    return std::make_pair(int64_t{0}, name);
  };
  for (const RankFile& r : ranks) {
    if (r.tp != 0 || r.ep != 0) continue;
    for (const StateEntry& e : r.torch.entries()) {
      const auto [chunk, key] = chunk_and_key(e.name);
      if (key.rfind("decoder.layers.", 0) != 0) continue;
      if (auto l = split_index(key.substr(15)))
        layers_in[{chunk, r.pp}] = std::max(layers_in[{chunk, r.pp}], l->first + 1);
    }
  }
  std::map<std::pair<int64_t, int64_t>, int64_t> first_layer;
  int64_t next = 0;
  for (const auto& [chunk_pp, n] : layers_in) {  // std::map order: chunk outer, pp inner
    first_layer[chunk_pp] = next;
    next += n;
  }

  // Pass 2: every entry under its global name, grouped by (name, pp stage) over TP ranks.
  std::map<std::string, std::map<int64_t, std::vector<Held>>> by_name;  // name -> pp -> TP shards
  std::vector<std::string> order;
  for (const RankFile& r : ranks) {
    for (const StateEntry& e : r.torch.entries()) {
      const auto* view = std::get_if<TensorView>(&e.value);
      if (!view) throw Error("verify: a sharded tensor in a legacy per-rank file").tensor(e.name).file(r.torch.path());
      const auto [chunk, key] = chunk_and_key(e.name);
      if (contains(key, "_extra_state")) continue;
      std::string name = key;
      if (key.rfind("decoder.layers.", 0) == 0)
        if (auto l = split_index(key.substr(15))) {
          std::string rest = l->second;
          std::optional<int64_t> local_expert;
          const std::string grouped = "mlp.experts.linear_fc", sequential = "mlp.experts.local_experts.";
          if (rest.rfind(grouped, 0) == 0 && contains(rest, ".weight")) {  // "...linear_fc1.weight<j>"
            const size_t w = rest.find(".weight") + 7;
            local_expert = parse_decimal(std::string_view(rest).substr(w));
            rest = "mlp.experts.*." + rest.substr(12, w - 12);
          } else if (rest.rfind(sequential, 0) == 0) {
            if (auto j = split_index(rest.substr(sequential.size()))) {
              local_expert = j->first;
              rest = "mlp.experts.*." + j->second;
            }
          }
          if (rest.find('*') != std::string::npos) {
            if (!local_expert || experts <= 0 || ep <= 0)
              throw Error("verify: cannot number this expert").tensor(e.name);
            rest.replace(rest.find('*'), 1, std::to_string(r.ep * (experts / ep) + *local_expert));
          }
          auto base = first_layer.find({chunk, r.pp});
          if (base == first_layer.end()) throw Error("verify: layer of an unknown model chunk").tensor(e.name);
          name = "decoder.layers." + std::to_string(base->second + l->first) + "." + rest;
        }
      auto& stages = by_name[name];
      if (stages.empty()) order.push_back(name);
      stages[r.pp].push_back({r.tp, &r, view});
    }
  }

  for (const std::string& name : order) {
    // A weight on several stages is the tied output layer's copy on the last one: the first wins.
    std::vector<Held> shards = by_name.at(name).begin()->second;
    std::sort(shards.begin(), shards.end(), [](const Held& a, const Held& b) { return a.tp < b.tp; });
    const std::vector<int64_t>& size = shards.front().view->size;
    const LegacyTpSplit split = legacy_tp_split(name, size, tp, moe_ffn);
    const bool replicated = split == LegacyTpSplit::Replicated;
    if (replicated)
      shards.resize(1);
    else if (static_cast<int64_t>(shards.size()) != tp)
      throw Error("verify: held by " + std::to_string(shards.size()) + " of " + std::to_string(tp) + " TP ranks")
          .tensor(name);
    const size_t dim = split == LegacyTpSplit::Dim1 ? 1 : 0;
    if (size.size() <= dim) throw Error("verify: too few dims to concatenate TP shards").tensor(name);
    ReferenceTensor t{name, shards.front().view->dtype, size, {}};
    t.shape[dim] = 0;
    for (const Held& h : shards) t.shape[dim] += h.view->size[dim];
    int64_t at = 0;
    for (const Held& h : shards) {
      std::vector<std::vector<int64_t>> index;
      for (size_t d = 0; d < h.view->size.size(); ++d) index.push_back(index_range(0, h.view->size[d]));
      if (split == LegacyTpSplit::GateUp) {  // [gate_r; up_r]: gate rows after gate rows, up rows after up rows
        const int64_t half = h.view->size[0] / 2, total_half = t.shape[0] / 2;
        index[0] = index_range(at / 2, half);
        const std::vector<int64_t> up = index_range(total_half + at / 2, h.view->size[0] - half);
        index[0].insert(index[0].end(), up.begin(), up.end());
      } else {
        index[dim] = index_range(at, h.view->size[dim]);
      }
      at += h.view->size[dim];
      t.pieces.push_back(torch_piece(h.rank->file, h.rank->torch.storage_record(*h.view), *h.view, std::move(index),
                                     "TP rank " + std::to_string(h.tp) + " of " + h.rank->torch.path()));
    }
    out.tensors.push_back(std::move(t));
    ++out.kinds["the per-rank files' TP/PP/EP ranks (legacy rules)"];
  }
  return out;
}

}  // namespace shardmerge
