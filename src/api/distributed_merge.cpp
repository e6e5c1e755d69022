// The multi-process merge of api/distributed_merge.hpp.
#include "api/distributed_merge.hpp"

#include <chrono>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <thread>

#include "api/node_local_plan.hpp"
#include "exec/dist/data_plane.hpp"
#include "exec/dist/partition.hpp"
#include "exec/io.hpp"
#include "exec/dist/source_server.hpp"
#include "util/file.hpp"
#include "shardmerge/error.hpp"
#include "util/rss.hpp"
#include "verify/reference_verify.hpp"
#include "write/hf_tree_writer.hpp"

namespace fs = std::filesystem;

namespace shardmerge::api {
namespace {

// A token rank 0 writes into the temp directory: a process that reads it back sees the target's
// filesystem.
std::string visibility_token(int rank) {
  return std::to_string(::getpid()) + "-" + std::to_string(rank) + "-" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
}
constexpr const char* kTokenName = ".shardmerge-shared-check";

// Serves this process's sources to the others for as long as it lives (the data plane's
// end_serving is collective: it returns once every process has finished reading).
class Serving {
 public:
  Serving(dist::DataPlane* plane, dist::SourceServer& server) : plane_(plane) {
    if (plane_) plane_->begin_serving([&server](uint32_t f, uint64_t off, void* buf, size_t n) { server.read(f, off, buf, n); });
  }
  void end() {
    if (plane_) std::exchange(plane_, nullptr)->end_serving();
  }
  ~Serving() {
    try {
      end();
    } catch (...) {  // already failing: the error being thrown says why
    }
  }

 private:
  dist::DataPlane* plane_;
};

}  // namespace

MergeOutcome merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge(dist::ProcessGroup&)>& make_plan,
                               const WriteOptions& o, const MergeHooks& hooks, Executor& executor,
                               const ExecOptions& exec) {
  const auto start = std::chrono::steady_clock::now();
  const bool root = group.rank() == 0;
  MergeOutcome out;
  PlannedMerge& pm = out.planned;
  const auto digests = dist::run_together(group, [&] {
    pm = make_plan(group);
    return std::to_string(dist::plan_digest(pm.plan));
  });
  for (int r = 1; r < group.size(); ++r)
    if (digests[static_cast<size_t>(r)] != digests[0])
      throw Error("process " + std::to_string(r) + " planned a different merge than rank 0 (do all processes see the same "
                  "checkpoint files?)");
  const MergePlan& plan = pm.plan;
  const bool node_local = has_node_local_sources(plan);
  if (o.verify && node_local)  // the same plan everywhere: every process refuses together
    throw usage_error("--verify reads every source on rank 0, and this merge's rank files are spread over the "
                      "processes' nodes: run `shardmerge verify` where one machine sees the whole checkpoint");

  const dist::ChosenDataPlane data = dist::choose_data_plane(group, o.transport, node_local);
  dist::DataPlane* const plane = data.plane;

  // Rank 0 creates the temp directory; the processes that see it write too.
  std::optional<HfTreeWriter> writer_slot;
  const std::string token = visibility_token(group.rank());
  const std::string temp = dist::run_together(group, [&] {
                             HfTreeWriter& writer = writer_slot.emplace(o.target, o.force, pm.role_dir);
                             for (const std::string& d : pm.other_source_dirs) writer.refuse_overlap(d);
                             if (!root) return std::string();
                             writer.create(plan, std::vector<bool>(plan.files.size(), false));
                             write_small_file(writer.temp_dir() + "/" + kTokenName, token);
                             return writer.temp_dir() + "\n" + token;
                           }).at(0);
  HfTreeWriter& writer = *writer_slot;
  const std::string temp_dir = temp.substr(0, temp.find('\n'));
  const auto sees = dist::run_together(group, [&] {
    if (root) return std::string("1");
    std::error_code ec;
    const std::string path = temp_dir + "/" + kTokenName;
    return std::string(fs::is_regular_file(path, ec) && read_small_file(path) == temp.substr(temp.find('\n') + 1) ? "1" : "0");
  });
  std::vector<int> writers;
  for (int r = 0; r < group.size(); ++r)
    if (sees[static_cast<size_t>(r)] == "1") writers.push_back(r);
  const dist::RankShare share =
      dist::share_of(plan, dist::assign_files(plan, group.size(), writers, plane != nullptr), group.rank());
  const bool shared_target = writers.size() == static_cast<size_t>(group.size());
  if (root && hooks.on_start) {
    std::string line = std::to_string(group.size()) + " processes over " + group.transport() +
                       (plane && plane->name() != group.transport() ? ", slices over " + plane->name() : "") + "; " +
                       (shared_target ? "each writes its share of the " + std::to_string(plan.files.size()) + " output files"
                                      : std::to_string(writers.size()) + " of them see the target and write its " +
                                            std::to_string(plan.files.size()) + " files");
    // mpirun binds each process to one core by default when it starts one or two per node.
    if (usable_cores() == 1 && std::thread::hardware_concurrency() > 1)
      line += "; rank 0 runs on 1 of this machine's " + std::to_string(std::thread::hardware_concurrency()) +
              " cores (the launcher bound it there: give mpirun --bind-to none)";
    hooks.on_start(pm, line, 0);
  }

  ExecStats stats;
  dist::SourceServer server(plan, group.rank());
  const auto all_stats = dist::run_together(group, [&] {
    if (root) {
      fs::remove(temp_dir + "/" + kTokenName);
      writer.create_files(plan, share.owned_files);
    } else if (sees[static_cast<size_t>(group.rank())] == "1") {
      writer.attach(temp_dir, plan, share.owned_files);
    }
    ExecOptions mine = exec;
    mine.rank = group.rank();  // reads its own sources, and the others' through the data plane
    mine.remote = plane;
    Serving serving(plane, server);
    if (!share.plan.tensors.empty()) stats = executor.run(share.plan, writer, mine);
    serving.end();
    server.finish();
    writer.sync_files();
    return nlohmann::json{{"read", stats.bytes_read},
                          {"written", stats.bytes_written},
                          {"rss", peak_rss_bytes()},
                          {"folds", stats.lora_folds},
                          {"sent", plane ? plane->bytes_served() : 0}}
        .dump();
  });
  // --verify: once every process has written and synced its files, the root compares the whole
  // tree, still in the temp dir, with the checkpoint assembled from its own metadata,
  // independently of the plan the processes shared; the others wait for its answer. An output
  // that fails is never committed.
  std::optional<ReferenceCheck>& check = out.check;
  const auto verdict = dist::run_together(group, [&] {
    if (!root || !o.verify) return std::string();
    check = verify_against_sources(pm, temp_dir);
    return std::string(check->diff.equal() ? "" : "differs");
  });
  if (o.verify && !verdict.at(0).empty()) {
    if (root && hooks.on_verify_failed) hooks.on_verify_failed(*check);
    throw Error("verification failed: the merged output differs from the source; nothing was written to " + o.target);
  }
  dist::run_together(group, [&] {
    if (root) writer.commit(plan);
    return std::string();
  });
  if (!root) return out;

  uint64_t read = 0, peak = 0, folds = 0, sent = 0;
  for (const auto& s : all_stats) {
    const auto j = nlohmann::json::parse(s);
    read += j["read"].get<uint64_t>();
    peak = std::max<uint64_t>(peak, j["rss"].get<uint64_t>());
    folds += j["folds"].get<uint64_t>();
    sent += j["sent"].get<uint64_t>();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  nlohmann::ordered_json& j = out.summary;
  j["source"] = pm.role_dir;
  j["target"] = o.target;
  j["layout"] = plan.layout;
  j["processes"] = group.size();
  j["transport"] = group.transport();
  j["data_plane"] = plane ? plane->name() : "none";  // what moved the slices between processes
  j["node_local_sources"] = node_local;
  j["writers"] = writers.size();
  j["target_seen_by_all"] = shared_target;
  j["tensors"] = plan.tensors.size();
  j["files"] = plan.files.size();
  j["bytes_read"] = read;  // by the processes from their disks: each source byte once
  j["bytes_sent_between_processes"] = sent;
  j["bytes_written"] = plan.bytes_written();
  j["seconds"] = secs;
  j["gb_per_s"] = secs > 0 ? static_cast<double>(read + plan.bytes_written()) / secs / 1e9 : 0;
  j["peak_rss_bytes"] = peak;
  j["lora_folds"] = folds;
  j["notes"] = plan.notes;
  if (check) {
    j["verified"] = true;
    j["verify"] = check->summary();
  }
  return out;
}

}  // namespace shardmerge::api
