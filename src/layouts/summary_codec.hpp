// Per-file summaries as bytes, so a process can send the summaries of the files on its node to
// the others (layouts/node_local.hpp): torch.save files and the items of DCP .distcp files.
// CBOR through nlohmann_json; decoding checks shapes and types, never trusting the sender more
// than a file on disk.
#pragma once

#include <string>
#include <vector>

#include "layouts/summaries.hpp"

namespace shardmerge::layouts {

struct NodeSummaries {
  std::vector<TorchFileSummary> torch_files;
  DcpSummary dcp;  // data_files, stored_items, compressed_items (metadata is not sent)
};

std::string encode_summaries(const NodeSummaries& s);
// Throws an Error saying which process's message is malformed (`from`).
NodeSummaries decode_summaries(const std::string& blob, const std::string& from);

}  // namespace shardmerge::layouts
