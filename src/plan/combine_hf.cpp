#include "plan/combine.hpp"

#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
// Summaries and roles are layouts' types; the combine step reads them, nothing else.
using namespace layouts;

namespace {

void add_safetensors_file(SourceSet& set, const SafetensorsSummary& f) {
  const auto fi = static_cast<uint32_t>(set.files.size());
  set.files.push_back({f.path, f.stamp.size, f.stamp});
  for (const auto& t : f.tensors) {
    SourceTensor s;
    s.name = t.name;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.origin = "whole tensor";
    s.pieces.push_back(dense_slice(fi, t.file_offset, t.dtype, std::vector<int64_t>(t.shape.size(), 0), t.shape));
    set.tensors.push_back(std::move(s));
  }
}

void add_torch_file(SourceSet& set, const TorchFileSummary& f) {
  const auto fi = static_cast<uint32_t>(set.files.size());
  set.files.push_back({f.path, f.stamp.size, f.stamp});
  for (const auto& e : f.entries) {
    const auto* v = std::get_if<TensorView>(&e.value);
    if (!v) throw Error("adapter tensors must be plain tensors").file(f.path).tensor(e.name);
    SourceTensor s;
    s.name = e.name;
    s.dtype = v->dtype;
    s.shape = v->size;
    s.origin = "whole tensor";
    s.pieces.push_back(view_to_slice(fi, f.record_of(*v).data_offset, *v, std::vector<int64_t>(v->size.size(), 0)));
    set.records.push_back(record_check(fi, f.record_of(*v), e.name));
    set.tensors.push_back(std::move(s));
  }
}

}  // namespace

SourceSet combine_hf_weights(const HfWeightsSummary& w) {
  SourceSet set;
  set.description = "HuggingFace safetensors, " + std::to_string(w.files.size()) + " file(s)";
  for (const auto& f : w.files) add_safetensors_file(set, f);  // in data order
  // The index decides which file holds a name (a stale shard may hold a stray copy).
  std::erase_if(set.tensors, [&](const SourceTensor& t) {
    auto it = w.file_of.find(t.name);
    return it == w.file_of.end() || it->second != t.pieces.front().file;
  });
  return set;
}

AdapterSources combine_adapter(const AdapterSummary& summary) {
  AdapterSources out;
  out.config_path = summary.config_path;
  out.config = summary.config;
  if (const auto* st = std::get_if<SafetensorsSummary>(&summary.weights))
    add_safetensors_file(out.tensors, *st);
  else
    add_torch_file(out.tensors, std::get<TorchFileSummary>(summary.weights));
  out.tensors.description = "PEFT adapter";
  return out;
}

}  // namespace shardmerge
