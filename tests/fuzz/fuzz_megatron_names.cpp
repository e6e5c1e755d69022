// libFuzzer target: Megatron names. The first line is an mp_rank directory name (legacy
// per-rank trees); the second byte chooses a model family; every further line is a Megatron
// tensor "name|d0,d1,..." (each dim one character c, meaning (c - '0') & 63) mapped to
// HuggingFace names (un-stacking, QKV and gate/up splits, vocab trimming). Whatever maps must
// tile each HF tensor exactly once.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "layouts/names.hpp"
#include "plan/megatron_names.hpp"
#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"

namespace {

// A row-major tensor held whole by one piece of file 0.
shardmerge::SourceTensor whole(const std::string& name, const std::vector<int64_t>& shape) {
  shardmerge::SourceTensor t;
  t.name = name;
  t.dtype = shardmerge::DType::F32;
  t.shape = shape;
  t.pieces.push_back(shardmerge::dense_slice(0, 0, t.dtype, std::vector<int64_t>(shape.size(), 0), shape));
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  std::getline(in, line);
  if (auto mp = shardmerge::layouts::parse_mp_rank_dir(line))
    if (mp->tp < 0 || (mp->pp && *mp->pp < 0) || (mp->ep && *mp->ep < 0)) std::abort();
  std::getline(in, line);
  const auto archs = shardmerge::megatron_supported_architectures();
  if (archs.empty() || line.empty()) return 0;
  // A small model of every family: 2 layers, hidden 8, 2 query heads of 4, 1 KV group, 2 experts.
  const nlohmann::ordered_json config = {{"architectures", {archs[static_cast<uint8_t>(line[0]) % archs.size()]}},
                                         {"num_hidden_layers", 2}, {"hidden_size", 8}, {"num_attention_heads", 2},
                                         {"num_key_value_heads", 1}, {"head_dim", 4}, {"intermediate_size", 16},
                                         {"vocab_size", 12}, {"num_experts", 2}, {"moe_intermediate_size", 4},
                                         {"shared_expert_intermediate_size", 8}, {"tie_word_embeddings", line.size() > 1}};
  shardmerge::SourceSet set;
  set.files.push_back({"/megatron/model.pt", 1u << 30, std::nullopt});
  while (std::getline(in, line) && set.tensors.size() < 64) {
    const size_t bar = line.find('|');
    std::vector<int64_t> shape;
    if (bar != std::string::npos) {
      std::istringstream dims(line.substr(bar + 1));
      std::string d;
      while (std::getline(dims, d, ',') && shape.size() < 4) shape.push_back(d.empty() ? 0 : (static_cast<uint8_t>(d[0]) - '0') & 63);
    }
    set.tensors.push_back(whole(line.substr(0, bar), shape));
  }
  try {
    const auto hf = shardmerge::map_megatron_to_hf(set, config, {});
    for (const auto& t : hf.tensors)
      if (shardmerge::check_tiling(t.shape, t.pieces)) std::abort();
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
