// How Megatron's legacy per-rank files (mp_rank_*/model_optim_rng.pt, torch.save of each rank's
// state dict) hold a tensor across TP ranks. Unlike dist_ckpt, the files carry no sharding
// metadata: the split follows from which megatron-core layer owns the parameter, written down
// here as a table keyed by (module, parameter). The planner (combine_megatron_legacy) and the
// verifier's reference assembly both read it: one owner for the rule.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace shardmerge {

enum class LegacyTpSplit {
  Replicated,  // every TP rank holds the whole tensor: rank 0's copy is the tensor
  Dim0,        // column- or vocab-parallel: ranks concatenate along dim 0 (QKV groups stay in order)
  Dim1,        // row-parallel weight: ranks concatenate along dim 1
  GateUp,      // gated fc1: rank r holds [gate_r; up_r], so gate rows follow gate rows, up rows up rows
};

const char* to_string(LegacyTpSplit split);

// `name` is the tensor's global name (decoder.layers.<l>.…, experts numbered
// mlp.experts.<e>.…), `shard_size` TP rank 0's shape, `moe_ffn` config.json's
// moe_intermediate_size (0 without experts). With one TP rank everything is Replicated. An expert
// whose shard already has moe_ffn rows (fc1: 2 * moe_ffn) has expert-TP 1: Replicated, as is an
// output_layer of one row (a critic's value head). A parameter no rule covers is an Error naming
// it: guessing a split would write a wrong tensor.
LegacyTpSplit legacy_tp_split(std::string_view name, const std::vector<int64_t>& shard_size, int64_t tp,
                              int64_t moe_ffn);

}  // namespace shardmerge
