// The multi-process merge of api/distributed_merge.hpp.
#include "api/distributed_merge.hpp"

#include <chrono>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <exception>
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

// Rank 0's temp directory and the token it wrote there.
struct TempDirNotice {
  std::string dir;
  std::string token;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TempDirNotice, dir, token)

// What one process did, for the summary.
struct ProcessStats {
  uint64_t read = 0;  // from its own disks
  uint64_t peak_rss = 0;
  uint64_t lora_folds = 0;
  uint64_t records_checked = 0;
  unsigned threads = 0;
  uint64_t peak_read_bytes_in_flight = 0;
  uint64_t sent = 0;  // served to the others through the data plane
  double cpu_seconds = 0;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ProcessStats, read, peak_rss, lora_folds, records_checked, threads,
                                   peak_read_bytes_in_flight, sent, cpu_seconds)

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
                               const std::string& executor_description, const ExecOptions& exec) {
  const auto start = std::chrono::steady_clock::now();
  const bool root = group.rank() == 0;
  MergeOutcome out;
  PlannedMerge& pm = out.planned;
  const std::vector<uint64_t> digests = dist::run_together(group, [&] {
    pm = make_plan(group);
    return dist::plan_digest(pm.plan);
  });
  const double plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
  const TempDirNotice temp = dist::run_together(group, [&] {
                                HfTreeWriter& writer = writer_slot.emplace(o.target, o.force, pm.role_dir);
                                for (const std::string& d : pm.other_source_dirs) writer.refuse_overlap(d);
                                if (!root) return TempDirNotice{};
                                writer.create(plan, std::vector<bool>(plan.files.size(), false));
                                write_small_file(writer.temp_dir() + "/" + kTokenName, token);
                                return TempDirNotice{writer.temp_dir(), token};
                              }).at(0);
  HfTreeWriter& writer = *writer_slot;
  // Rank 0 made the temp directory; if it is the peer that stopped answering, it may never run
  // again to clean up (a hung node the launcher cannot reach), so a process that joined the
  // directory removes it (and rank 0's lock) when the job ends that way.
  struct RemoveIfPeerLost {
    dist::ProcessGroup& group;
    HfTreeWriter& writer;
    int unwinding = std::uncaught_exceptions();
    ~RemoveIfPeerLost() {
      if (std::uncaught_exceptions() > unwinding && group.peer_lost()) writer.remove_joined();
    }
  } remove_if_peer_lost{group, writer};
  const std::string& temp_dir = temp.dir;
  const std::vector<bool> sees = dist::run_together(group, [&] {
    if (root) return true;
    std::error_code ec;
    const std::string path = temp_dir + "/" + kTokenName;
    return fs::is_regular_file(path, ec) && read_small_file(path) == temp.token;
  });
  std::vector<int> writers;
  for (int r = 0; r < group.size(); ++r)
    if (sees[static_cast<size_t>(r)]) writers.push_back(r);
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
  const std::vector<ProcessStats> all_stats = dist::run_together(group, [&] {
    if (root) {
      fs::remove(temp_dir + "/" + kTokenName);
      writer.create_files(plan, share.owned_files);
    } else if (sees[static_cast<size_t>(group.rank())]) {
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
    return ProcessStats{stats.bytes_read,
                        peak_rss_bytes(),
                        stats.lora_folds,
                        stats.records_checked,
                        stats.threads,
                        stats.peak_read_bytes_in_flight,
                        plane ? plane->bytes_served() : 0,
                        cpu_seconds()};
  });
  // --verify: once every process has written and synced its files, the root compares the whole
  // tree, still in the temp dir, with the checkpoint assembled from its own metadata,
  // independently of the plan the processes shared; the others wait for its answer. An output
  // that fails is never committed.
  std::optional<ReferenceCheck>& check = out.check;
  const std::vector<bool> equal = dist::run_together(group, [&] {
    if (!root || !o.verify) return true;
    check = verify_against_sources(pm, temp_dir);
    return check->diff.equal();
  });
  if (!equal.at(0)) {
    if (root && hooks.on_verify_failed) hooks.on_verify_failed(*check);
    throw Error("verification failed: the merged output differs from the source; nothing was written to " + o.target);
  }
  dist::run_together(group, [&] {
    if (root) writer.commit(plan);
  });
  if (!root) return out;

  MergeSummary& summary = out.summary.emplace(MergeSummary::of(pm, o.target, executor_description));
  summary.processes = MergeSummary::Processes{group.size(), group.transport(), plane ? plane->name() : "none",
                                              node_local, writers.size(), shared_target, 0};
  for (const ProcessStats& s : all_stats) {
    summary.bytes_read += s.read;
    summary.peak_rss_bytes = std::max(summary.peak_rss_bytes, s.peak_rss);
    summary.lora_folds += s.lora_folds;
    summary.crc_checked_records += s.records_checked;
    summary.threads = std::max(summary.threads, s.threads);
    summary.peak_read_bytes_in_flight = std::max(summary.peak_read_bytes_in_flight, s.peak_read_bytes_in_flight);
    summary.processes->bytes_sent_between_processes += s.sent;
    summary.cpu_seconds += s.cpu_seconds;
  }
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  summary.plan_seconds = plan_seconds;
  if (check) summary.verify = check->summary();
  return out;
}

}  // namespace shardmerge::api
