// `shardmerge bench`: merge throughput on a synthetic verl FSDP2 checkpoint of a real model shape
// (or on an existing checkpoint, --local_dir), beside the I/O floors measured in the same run (nccl-tests style: one table, ratios, no
// thresholds). The floors: reading every rank file (in parallel, as the merge does) and writing
// the output's size with fsync (as the merge commits). The merge runs as a child `shardmerge
// merge`, so its peak RSS is its own (wait4). --cold empties the page cache before every step and
// adds the floor a merge is held to on a cold disk: reads and writes started together.
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "cli/commands.hpp"
#include "pipeline/planner.hpp"
#include "shardmerge/error.hpp"
#include "synth/synthetic_fsdp.hpp"
#include "util/file.hpp"
#include "util/free_space.hpp"
#include "util/units.hpp"

extern char** environ;

namespace fs = std::filesystem;

namespace shardmerge::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  synth::SyntheticOptions checkpoint;
  std::string local_dir;  // an existing checkpoint instead of a synthetic one (never written into)
  std::string backend = "auto";
  std::string device = "cpu";
  std::string workdir;
  std::string memory_limit = "512MiB";
  unsigned threads = 0;
  int rounds = 1;
  bool json = false;
  bool list = false;
  bool keep = false;
  bool cold = false;
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

uint64_t tree_bytes(const fs::path& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

// Reads every file whole, a few files at a time in parallel: what the merge must read at least.
double read_floor(const std::vector<fs::path>& files) {
  const auto start = Clock::now();
  std::atomic<size_t> next{0};
  std::vector<std::thread> readers;
  const unsigned n = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), static_cast<unsigned>(files.size())));
  std::exception_ptr failure;
  std::mutex failure_mutex;
  for (unsigned t = 0; t < n; ++t)
    readers.emplace_back([&] {
      std::vector<char> buf(8 << 20);
      try {
        for (size_t i; (i = next++) < files.size();) {
          const File f = File::open_read(files[i].string());
          ::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
          for (uint64_t off = 0, size = f.size(); off < size; off += buf.size())
            f.read_exact(off, buf.data(), std::min<uint64_t>(buf.size(), size - off));
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        failure = std::current_exception();
      }
    });
  for (auto& r : readers) r.join();
  if (failure) std::rethrow_exception(failure);
  return seconds_since(start);
}

// Writes `bytes` of non-zero data to a new file and fsyncs it: what the merge must write at least.
double write_floor(const fs::path& path, uint64_t bytes) {
  std::vector<char> buf(8 << 20);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<char>(i * 131 + 7);
  const auto start = Clock::now();
  {
    File f = File::create(path.string());
    for (uint64_t off = 0; off < bytes; off += buf.size())
      f.write_exact(off, buf.data(), std::min<uint64_t>(buf.size(), bytes - off));
    f.sync();
  }
  const double secs = seconds_since(start);
  fs::remove(path);
  return secs;
}

// Writes back dirty pages and empties the page cache, so that the next step reads from the disk.
void drop_page_cache() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd < 0 || ::write(fd, "3", 1) != 1) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw Error(std::string("--cold empties the page cache before each step and cannot: ") + std::strerror(err) +
                " (run as root, with /proc/sys/vm writable)")
        .file("/proc/sys/vm/drop_caches");
  }
  ::close(fd);
}

// Reading every input and writing the output's size with fsync, started together: what a merge
// that overlaps its reads and writes perfectly must take at least. Seconds until both end.
double concurrent_floor(const std::vector<fs::path>& files, const fs::path& write_path, uint64_t bytes) {
  const auto start = Clock::now();
  std::exception_ptr failure;
  std::thread reader([&] {
    try {
      read_floor(files);
    } catch (...) {
      failure = std::current_exception();
    }
  });
  write_floor(write_path, bytes);
  reader.join();
  if (failure) std::rethrow_exception(failure);
  return seconds_since(start);
}

struct MergeRun {
  double seconds = 0;
  uint64_t peak_rss = 0;
  unsigned threads = 0;            // from the merge's --json summary
  uint64_t reads_in_flight = 0;    // its peak_read_bytes_in_flight
  uint64_t tensors = 0;            // output tensors
  double plan_seconds = 0;         // the merge's planning
};

// `shardmerge merge` of the checkpoint as a child process (this very binary).
// Its --json summary goes to `summary` (read back for the executor's threads and read depth).
MergeRun run_merge(const BenchOptions& o, const std::string& role_dir, const fs::path& target, const fs::path& summary) {
  std::vector<std::string> args = {"shardmerge", "merge", "--local_dir", role_dir, "--target_dir", target.string(),
                                   "--force", "--json", "--device", o.device, "--memory-limit", o.memory_limit,
                                   "--backend", o.backend};
  if (o.threads) args.insert(args.end(), {"--threads", std::to_string(o.threads)});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, summary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const auto start = Clock::now();
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw Error(std::string("cannot start the merge: ") + std::strerror(rc));
  int status = 0;
  rusage usage{};
  while (::wait4(pid, &status, 0, &usage) < 0)
    if (errno != EINTR) throw Error(std::string("waiting for the merge: ") + std::strerror(errno));
  MergeRun run{seconds_since(start), static_cast<uint64_t>(usage.ru_maxrss) * 1024};
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw Error("the merge failed (its error is above)").file(role_dir);
  try {
    const auto j = nlohmann::json::parse(read_small_file(summary.string(), 1 << 20));
    run.threads = j.at("threads").get<unsigned>();
    run.plan_seconds = j.at("plan_seconds").get<double>();
    run.tensors = j.at("tensors").get<uint64_t>();
    run.reads_in_flight = j.at("peak_read_bytes_in_flight").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("the merge's --json summary: ") + e.what()).file(summary.string());
  }
  return run;
}

// What the benchmark wrote (the generated run root unless kept, the merge output, its summary
// and the write floor's file) goes away with it, on success or failure.
class Cleanup {
 public:
  explicit Cleanup(std::vector<fs::path> paths) : paths_(std::move(paths)) {}
  ~Cleanup() {
    std::error_code ec;
    for (const fs::path& p : paths_)
      if (!p.empty()) fs::remove_all(p, ec);
  }

 private:
  std::vector<fs::path> paths_;
};

// The checkpoint a bench run times: its role dir and the files the merge reads.
struct BenchCheckpoint {
  std::string role_dir;
  std::string tag;                 // names the output and the write floor's file in the workdir
  std::vector<fs::path> inputs;
  uint64_t bytes_in = 0;
  fs::path remove_after;           // the generated run root, when not kept
  bool reused = false;             // a kept synthetic checkpoint, or --local_dir
  std::string kept;                // a synthetic run root left for later runs
  double generate_seconds = 0;
};

// --local_dir: the files its merge plan reads (whole, for the floors), of any layout merge reads.
BenchCheckpoint existing_checkpoint(const BenchOptions& o, const fs::path& workdir, bool print) {
  MergeRequest request;
  request.local_dir = o.local_dir;
  request.backend = o.backend;
  const PlannedMerge planned = plan_merge(request);
  BenchCheckpoint c;
  c.role_dir = planned.role_dir;
  c.tag = "checkpoint";
  c.reused = true;
  for (const auto& s : planned.plan.sources) {
    c.inputs.emplace_back(s.path);
    c.bytes_in += s.size;
  }
  const uint64_t needed = planned.plan.bytes_written();
  const std::optional<uint64_t> available = free_bytes(workdir.string());
  if (print)
    std::printf("# shardmerge bench: %s (%s), %zu source files; needs %s in %s (%s free)\n", planned.role_dir.c_str(),
                planned.plan.layout.c_str(), c.inputs.size(), format_bytes(needed).c_str(), workdir.c_str(),
                available ? format_bytes(*available).c_str() : "unknown");
  require_free_space(needed, available, workdir.string());
  return c;
}

// A synthetic FSDP2 checkpoint of the named shape, generated into the workdir (or the one kept there).
BenchCheckpoint synthetic_checkpoint(const BenchOptions& o, const fs::path& workdir, bool print) {
  const synth::SyntheticSize size = synth::estimate_synthetic(o.checkpoint);
  BenchCheckpoint c;
  c.tag = o.checkpoint.model + "-w" + std::to_string(o.checkpoint.world_size) +
          (o.checkpoint.lora_rank ? "-lora" + std::to_string(o.checkpoint.lora_rank) : "") +
          (o.checkpoint.dtype == "bfloat16" ? "-bf16" : "") + (o.checkpoint.fused_experts ? "-fused" : "") +
          (o.checkpoint.layers ? "-L" + std::to_string(o.checkpoint.layers) : "");
  const fs::path run_root = workdir / ("shardmerge-bench-" + c.tag);
  c.reused = fs::exists(run_root);
  // The checkpoint, then the merge output beside it (removed before the write floor writes as much).
  const uint64_t needed = (c.reused ? 0 : size.rank_file_bytes) + size.merged_bytes;
  const std::optional<uint64_t> available = free_bytes(workdir.string());
  if (print)
    std::printf("# shardmerge bench: %s, world size %ld%s, %s; needs %s in %s (%s free)\n", o.checkpoint.model.c_str(),
                static_cast<long>(o.checkpoint.world_size),
                o.checkpoint.lora_rank ? (", LoRA r=" + std::to_string(o.checkpoint.lora_rank)).c_str() : "",
                o.checkpoint.dtype.c_str(), format_bytes(needed).c_str(), workdir.c_str(),
                available ? format_bytes(*available).c_str() : "unknown");
  require_free_space(needed, available, workdir.string());
  synth::SyntheticOptions gen = o.checkpoint;
  gen.out_dir = run_root.string();
  c.role_dir = (run_root / ("global_step_" + std::to_string(gen.step)) / "actor").string();
  if (!c.reused) {
    const auto t0 = Clock::now();
    try {
      c.role_dir = synth::write_synthetic_fsdp(gen).role_dir;
    } catch (...) {  // a half-written checkpoint must not be reused by the next run
      std::error_code ec;
      fs::remove_all(run_root, ec);
      throw;
    }
    c.generate_seconds = seconds_since(t0);
    ::sync();  // the checkpoint's write-back must not land on the timed rounds
  }
  if (o.keep || c.reused) c.kept = run_root.string();
  else c.remove_after = run_root;
  for (const auto& e : fs::directory_iterator(c.role_dir))
    if (e.is_regular_file() && e.path().extension() == ".pt") {
      c.inputs.push_back(e.path());
      c.bytes_in += e.file_size();
    }
  return c;
}

int run_bench(const BenchOptions& o) {
  if (o.list) {
    for (const auto& m : synth::model_shapes()) std::printf("%s\n", synth::shape_line(m).c_str());
    return 0;
  }
  if (o.rounds < 1) throw usage_error("--rounds must be at least 1");
  const fs::path workdir = o.workdir.empty() ? fs::temp_directory_path() : fs::path(o.workdir);
  fs::create_directories(workdir);
  BenchCheckpoint c = o.local_dir.empty() ? synthetic_checkpoint(o, workdir, !o.json) : existing_checkpoint(o, workdir, !o.json);
  const fs::path target = workdir / ("shardmerge-bench-" + c.tag + "-out");
  const fs::path floor_file = workdir / ("shardmerge-bench-" + c.tag + ".write-floor");
  const fs::path summary_file = workdir / ("shardmerge-bench-" + c.tag + ".merge.json");
  Cleanup cleanup({c.remove_after, target, floor_file, summary_file});
  const std::string& role_dir = c.role_dir;
  const std::vector<fs::path>& inputs = c.inputs;
  const uint64_t bytes_in = c.bytes_in;

  // Alternating rounds, so that a slow spell of the disk lands on every step alike. --cold empties
  // the page cache before each step and adds the concurrent floor; the merge goes first so that
  // the write floors know the output's size.
  std::vector<double> reads, writes, merges, plans, concurrents;
  uint64_t bytes_out = 0, peak_rss = 0, reads_in_flight = 0, tensors = 0;
  unsigned threads = 0;
  auto cold_step = [&] {
    if (o.cold) drop_page_cache();
  };
  for (int r = 0; r < o.rounds; ++r) {
    if (!o.cold) reads.push_back(read_floor(inputs));
    cold_step();
    const MergeRun m = run_merge(o, role_dir, target, summary_file);
    merges.push_back(m.seconds);
    plans.push_back(m.plan_seconds);
    peak_rss = std::max(peak_rss, m.peak_rss);
    threads = m.threads;
    tensors = m.tensors;
    reads_in_flight = std::max(reads_in_flight, m.reads_in_flight);
    bytes_out = tree_bytes(target);
    fs::remove_all(target);
    if (o.cold) {
      cold_step();
      reads.push_back(read_floor(inputs));
    }
    cold_step();
    writes.push_back(write_floor(floor_file, bytes_out));
    if (o.cold) {
      cold_step();
      concurrents.push_back(concurrent_floor(inputs, floor_file, bytes_out));
    }
  }
  const double read_s = median(reads), write_s = median(writes), merge_s = median(merges), plan_s = median(plans);
  const double ratio_max = merge_s / std::max(read_s, write_s), ratio_sum = merge_s / (read_s + write_s);
  const double concurrent_s = o.cold ? median(concurrents) : 0;  // --cold only

  if (o.json) {
    nlohmann::ordered_json j;
    if (o.local_dir.empty()) {
      j["model"] = o.checkpoint.model;
      j["world_size"] = o.checkpoint.world_size;
      j["lora_rank"] = o.checkpoint.lora_rank;
      j["dtype"] = o.checkpoint.dtype;
      j["fused_experts"] = o.checkpoint.fused_experts;
      j["layers"] = o.checkpoint.layers ? o.checkpoint.layers : synth::find_model(o.checkpoint.model).layers;
    } else {
      j["local_dir"] = o.local_dir;
    }
    j["device"] = o.device;
    j["rounds"] = o.rounds;
    j["workdir"] = workdir.string();
    j["reused_checkpoint"] = c.reused;
    j["generate_seconds"] = c.generate_seconds;
    j["bytes_in"] = bytes_in;
    j["bytes_out"] = bytes_out;
    j["read_floor_seconds"] = read_s;
    j["write_floor_seconds"] = write_s;
    j["merge_seconds"] = merge_s;
    j["merge_bytes_per_second"] = static_cast<double>(bytes_in + bytes_out) / merge_s;
    j["merge_over_max_floor"] = ratio_max;
    j["merge_over_sum_floor"] = ratio_sum;
    j["merge_plan_seconds"] = plan_s;
    j["merge_tensors"] = tensors;
    j["merge_peak_rss_bytes"] = peak_rss;
    j["merge_threads"] = threads;
    j["merge_peak_read_bytes_in_flight"] = reads_in_flight;
    j["cold"] = o.cold;
    if (o.cold) {
      j["concurrent_floor_seconds"] = concurrent_s;
      j["merge_over_concurrent_floor"] = merge_s / concurrent_s;
    }
    j["kept"] = c.kept.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(c.kept);
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  char origin[64] = "reused the kept checkpoint";
  if (!o.local_dir.empty()) std::snprintf(origin, sizeof origin, "an existing checkpoint");
  else if (!c.reused) std::snprintf(origin, sizeof origin, "generated in %.1f s", c.generate_seconds);
  std::printf("# %s of source files in, %s of safetensors out; %s; median of %d round(s), %s\n",
              format_bytes(bytes_in).c_str(), format_bytes(bytes_out).c_str(), origin, o.rounds,
              o.cold ? "page cache emptied before each step" : "page cache warm");
  std::printf("#%-26s %10s %14s\n", "step", "seconds", "GB/s");
  std::printf(" %-26s %10.3f %14.2f\n", "read floor (sources)", read_s, static_cast<double>(bytes_in) / read_s / 1e9);
  std::printf(" %-26s %10.3f %14.2f\n", "write floor (out + fsync)", write_s, static_cast<double>(bytes_out) / write_s / 1e9);
  std::printf(" %-26s %10.3f %14.2f  (in + out)\n", ("merge --device " + o.device).c_str(), merge_s,
              static_cast<double>(bytes_in + bytes_out) / merge_s / 1e9);
  if (o.cold) {
    std::printf(" %-26s %10.3f %14.2f  (in + out)\n", "read + write together", concurrent_s,
                static_cast<double>(bytes_in + bytes_out) / concurrent_s / 1e9);
    std::printf("# merge / concurrent floor       = %.3f\n", merge_s / concurrent_s);
  }
  std::printf("# merge / max(read, write) floor = %.3f\n", ratio_max);
  std::printf("# merge / (read + write) floor   = %.3f\n", ratio_sum);
  std::printf("# merge's planning                = %.3f s, %.1f %% of the merge (%lu output tensors)\n", plan_s,
              100 * plan_s / merge_s, static_cast<unsigned long>(tensors));
  std::printf("# merge peak RSS                  = %.1f MiB\n", static_cast<double>(peak_rss) / (1 << 20));
  std::printf("# merge reads in flight, at most = %s (%u threads)\n", format_bytes(reads_in_flight).c_str(), threads);
  if (!c.kept.empty()) std::printf("# kept %s (delete it when done)\n", c.kept.c_str());
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Time a merge of a synthetic verl FSDP2 checkpoint of a real model shape (or of --local_dir) against the I/O "
      "floors, same run");
  auto o = std::make_shared<BenchOptions>();
  auto* local = cmd->add_option("--local_dir,--local-dir", o->local_dir,
                  "Time this existing checkpoint (any layout merge reads) instead of generating one; never written into");
  cmd->add_option("--backend", o->backend, "The merge's --backend (with --local_dir)")->check(CLI::IsMember({"auto", "fsdp", "megatron"}));
  cmd->add_option("--model", o->checkpoint.model, "Model shape (see --list)");
  cmd->add_option("--world-size,--world_size", o->checkpoint.world_size, "Rank files of the checkpoint")->check(CLI::Range(1, 4096));
  cmd->add_option("--lora-rank,--lora_rank", o->checkpoint.lora_rank, "Add LoRA of this rank on every linear layer (folded by the merge)")
      ->check(CLI::Range(0, 65536));
  cmd->add_option("--dtype", o->checkpoint.dtype, "Parameter dtype of the checkpoint")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->add_option("--layers", o->checkpoint.layers, "Decoder layers, instead of the shape's own (a shallower model)")
      ->check(CLI::Range(1, 100000));
  cmd->add_flag("--fused-experts,--fused_experts", o->checkpoint.fused_experts,
                "MoE experts fused as transformers 5 holds them at run time; the merge writes them per expert");
  cmd->add_option("--tokenizer-from,--tokenizer_from", o->checkpoint.tokenizer_from,
                  "Copy tokenizer files into the checkpoint's huggingface/ from this HF directory");
  cmd->add_option("--device", o->device, "The merge's --device");
  cmd->add_option("--workdir", o->workdir, "Where the checkpoint and the output go (default: the temp directory)");
  cmd->add_option("--memory-limit,--memory_limit", o->memory_limit, "The merge's --memory-limit");
  cmd->add_option("--threads", o->threads, "The merge's --threads (default: its own)");
  cmd->add_option("--rounds", o->rounds, "Rounds of read floor, merge, write floor (medians are shown)");
  cmd->add_flag("--json", o->json, "Print the results as JSON");
  cmd->add_flag("--list", o->list, "List the model shapes");
  cmd->add_flag("--cold", o->cold,
                "Empty the page cache before every step (needs root) and add the concurrent floor: reads and writes "
                "started together");
  cmd->add_flag("--keep", o->keep, "Keep the generated checkpoint in --workdir (a later run reuses it)");
  for (const char* synthetic_only : {"--model", "--world-size", "--lora-rank", "--dtype", "--layers", "--fused-experts", "--tokenizer-from", "--keep", "--list"})
    local->excludes(cmd->get_option(synthetic_only));
  cmd->callback([&run, o] { run = [o] { return run_bench(*o); }; });
}

}  // namespace shardmerge::cli
