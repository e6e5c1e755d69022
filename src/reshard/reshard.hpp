// `shardmerge reshard`: a verl FSDP role directory rewritten for another world size (FSDP2
// layout: DTensor Shard(0) on a 1-D "fsdp" mesh, or HSDP (Replicate, Shard(0)) on ("ddp",
// "fsdp")), as one atomic output tree: model_ and optim_ rank files resharded, extra_state_
// files copied (rule in target.hpp), fsdp_config.json with the new world size, every other
// file of the role (huggingface/, LoRA files) copied. The source is only read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardmerge::reshard {

struct ReshardOptions {
  std::string local_dir;   // a role dir, or a step/run root (its actor role, as merge resolves it)
  int64_t world_size = 0;
  std::string mesh;        // "" or "ddp=A,fsdp=B"
  std::string target_dir;
  bool force = false;      // replace a non-empty target
  bool check_crc = true;
  // What the process may hold (resident memory), like merge's --memory-limit. Reshard streams
  // through an 8 MiB buffer whatever the checkpoint's size; what grows with the model is the
  // pickles it keeps (source rank 0's, one per kind) and builds (one target's), which are
  // checked against this before anything is written.
  uint64_t memory_limit = 512ull << 20;
  unsigned threads = 0;  // target ranks written at once; 0: one per core (fewer where memory is short)
};

struct ReshardSummary {
  std::string role_dir;
  int64_t source_world = 0;
  int64_t target_world = 0;
  std::vector<int64_t> target_mesh;
  int files_written = 0;
  uint64_t bytes_written = 0;
  bool optimizer = false;
  bool extra_state = false;
  uint64_t peak_rss_bytes = 0;
  std::vector<std::string> notes;
};

ReshardSummary reshard_role(const ReshardOptions& options);

}  // namespace shardmerge::reshard
