// A role directory spread over the nodes of a multi-process merge: each process sees the same
// path with different contents (verl saves each node's rank files on that node; rank 0's node
// alone has huggingface/, fsdp_config.json, DCP .metadata). Each process lists its own files;
// from every process's listing each builds the same view: a local directory holding the union
// (small files copied, tensor-data files as empty placeholders of their size), on which
// detection and planning run unchanged, and the rank that reads each data file. The tensor
// data files are summarised only by their owners (summary_codec.hpp carries the summaries).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "layouts/summaries.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge::layouts {

struct NodeFile {
  std::string relative;  // to the role directory
  FileStamp stamp;
  std::optional<std::string> content;  // small files (configs, tokenizer, DCP .metadata): their bytes
};

// Every regular file under `dir` (none when it does not exist on this node).
std::vector<NodeFile> list_node_files(const std::string& dir);
std::string encode_node_files(const std::vector<NodeFile>& files);
std::vector<NodeFile> decode_node_files(const std::string& blob);

// Files whose bytes are tensor data (rank files, DCP .distcp, anything over 64 MiB): never
// copied between processes, only summarised by their owner and read through the data plane.
bool holds_tensor_data(const std::string& relative, uint64_t size);

class NodeLocalView {
 public:
  // `listings[r]`: what rank r holds under `role_dir`. Builds the view under $TMPDIR (removing
  // there the views of runs killed while planning). Throws when two processes hold one data file
  // with different sizes.
  NodeLocalView(std::string role_dir, const std::vector<std::vector<NodeFile>>& listings, int rank);
  ~NodeLocalView();
  NodeLocalView(const NodeLocalView&) = delete;
  NodeLocalView& operator=(const NodeLocalView&) = delete;

  const std::string& role_dir() const { return role_dir_; }  // the real path, the same on every node
  const std::string& view_dir() const { return view_dir_; }  // where planning looks
  // `path` under the view, as the same path under the role dir (other paths unchanged).
  std::string real_path(const std::string& path) const;
  // The rank that reads a file (kAnyOwner: every process sees the same file) and its stamp
  // there, by real path; nullopt for a path no process holds.
  std::optional<std::pair<int32_t, FileStamp>> holder_of(const std::string& real) const;
  // Real paths of the data files this process summarises (the lowest rank holding each).
  const std::vector<std::string>& summarised_here() const { return summarised_here_; }

 private:
  std::string role_dir_, temp_root_, view_dir_;
  std::map<std::string, int32_t> owner_;    // real path -> owner
  std::map<std::string, FileStamp> stamp_;  // real path -> the owner's stamp
  std::vector<std::string> summarised_here_;
};

// The summaries of the data files, from their owners, for planning over a NodeLocalView.
struct GatheredSummaries {
  const NodeLocalView* view = nullptr;
  std::map<std::string, TorchFileSummary> torch_files;  // by real path
  DcpSummary dcp;  // items and data files of every .distcp (metadata unset: the planner reads the view's)

  // The summary of the torch file the planner sees at `view_path`; throws naming the real path
  // when no process summarised it.
  const TorchFileSummary& torch_file(const std::string& view_path) const;
};

}  // namespace shardmerge::layouts
