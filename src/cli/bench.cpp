// `shardmerge bench`: merge throughput on a synthetic verl FSDP2 checkpoint of a real model shape,
// beside the I/O floors measured in the same run (nccl-tests style: one table, ratios, no
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
};

// `shardmerge merge` of the checkpoint as a child process (this very binary).
MergeRun run_merge(const BenchOptions& o, const std::string& role_dir, const fs::path& target) {
  std::vector<std::string> args = {"shardmerge", "merge", "--local_dir", role_dir, "--target_dir", target.string(),
                                   "--force", "--json", "--device", o.device, "--memory-limit", o.memory_limit};
  if (o.threads) args.insert(args.end(), {"--threads", std::to_string(o.threads)});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);  // its --json summary
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
  return run;
}

// The generated run root and the merge output go away with the benchmark, unless --keep.
class Cleanup {
 public:
  Cleanup(fs::path run_root, fs::path output, bool keep_run) : run_(std::move(run_root)), out_(std::move(output)), keep_(keep_run) {}
  ~Cleanup() {
    std::error_code ec;
    fs::remove_all(out_, ec);
    if (!keep_) fs::remove_all(run_, ec);
  }

 private:
  fs::path run_, out_;
  bool keep_;
};

int run_bench(const BenchOptions& o) {
  if (o.list) {
    for (const auto& m : synth::model_shapes()) std::printf("%s\n", synth::shape_line(m).c_str());
    return 0;
  }
  if (o.rounds < 1) throw usage_error("--rounds must be at least 1");
  const synth::SyntheticSize size = synth::estimate_synthetic(o.checkpoint);
  const fs::path workdir = o.workdir.empty() ? fs::temp_directory_path() : fs::path(o.workdir);
  fs::create_directories(workdir);
  const std::string tag = o.checkpoint.model + "-w" + std::to_string(o.checkpoint.world_size) +
                          (o.checkpoint.lora_rank ? "-lora" + std::to_string(o.checkpoint.lora_rank) : "") +
                          (o.checkpoint.dtype == "bfloat16" ? "-bf16" : "");
  const fs::path run_root = workdir / ("shardmerge-bench-" + tag), target = workdir / ("shardmerge-bench-" + tag + "-out");
  const bool reuse = fs::exists(run_root);
  // The checkpoint, then the merge output beside it (removed before the write floor writes as much).
  const uint64_t needed = (reuse ? 0 : size.rank_file_bytes) + size.merged_bytes;
  const std::optional<uint64_t> available = free_bytes(workdir.string());
  if (!o.json)
    std::printf("# shardmerge bench: %s, world size %ld%s, %s; needs %s in %s (%s free)\n", o.checkpoint.model.c_str(),
                static_cast<long>(o.checkpoint.world_size),
                o.checkpoint.lora_rank ? (", LoRA r=" + std::to_string(o.checkpoint.lora_rank)).c_str() : "",
                o.checkpoint.dtype.c_str(), format_bytes(needed).c_str(), workdir.c_str(),
                available ? format_bytes(*available).c_str() : "unknown");
  require_free_space(needed, available, workdir.string());
  Cleanup cleanup(run_root, target, o.keep || reuse);

  synth::SyntheticOptions gen = o.checkpoint;
  gen.out_dir = run_root.string();
  std::string role_dir = (run_root / ("global_step_" + std::to_string(gen.step)) / "actor").string();
  double generate_secs = 0;
  if (!reuse) {
    const auto t0 = Clock::now();
    role_dir = synth::write_synthetic_fsdp(gen).role_dir;
    generate_secs = seconds_since(t0);
    ::sync();  // the checkpoint's write-back must not land on the timed rounds
  }
  std::vector<fs::path> inputs;
  uint64_t bytes_in = 0;
  for (const auto& e : fs::directory_iterator(role_dir))
    if (e.is_regular_file() && e.path().extension() == ".pt") {
      inputs.push_back(e.path());
      bytes_in += e.file_size();
    }

  // Alternating rounds, so that a slow spell of the disk lands on every step alike. --cold empties
  // the page cache before each step and adds the concurrent floor; the merge goes first so that
  // the write floors know the output's size.
  std::vector<double> reads, writes, merges, concurrents;
  uint64_t bytes_out = 0, peak_rss = 0;
  const fs::path floor_file = workdir / ("shardmerge-bench-" + tag + ".write-floor");
  auto cold_step = [&] {
    if (o.cold) drop_page_cache();
  };
  for (int r = 0; r < o.rounds; ++r) {
    if (!o.cold) reads.push_back(read_floor(inputs));
    cold_step();
    const MergeRun m = run_merge(o, role_dir, target);
    merges.push_back(m.seconds);
    peak_rss = std::max(peak_rss, m.peak_rss);
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
  const double read_s = median(reads), write_s = median(writes), merge_s = median(merges);
  const double ratio_max = merge_s / std::max(read_s, write_s), ratio_sum = merge_s / (read_s + write_s);
  const double concurrent_s = o.cold ? median(concurrents) : 0;  // --cold only

  if (o.json) {
    nlohmann::ordered_json j;
    j["model"] = o.checkpoint.model;
    j["world_size"] = o.checkpoint.world_size;
    j["lora_rank"] = o.checkpoint.lora_rank;
    j["dtype"] = o.checkpoint.dtype;
    j["device"] = o.device;
    j["rounds"] = o.rounds;
    j["workdir"] = workdir.string();
    j["reused_checkpoint"] = reuse;
    j["generate_seconds"] = generate_secs;
    j["bytes_in"] = bytes_in;
    j["bytes_out"] = bytes_out;
    j["read_floor_seconds"] = read_s;
    j["write_floor_seconds"] = write_s;
    j["merge_seconds"] = merge_s;
    j["merge_bytes_per_second"] = static_cast<double>(bytes_in + bytes_out) / merge_s;
    j["merge_over_max_floor"] = ratio_max;
    j["merge_over_sum_floor"] = ratio_sum;
    j["merge_peak_rss_bytes"] = peak_rss;
    j["cold"] = o.cold;
    if (o.cold) {
      j["concurrent_floor_seconds"] = concurrent_s;
      j["merge_over_concurrent_floor"] = merge_s / concurrent_s;
    }
    j["kept"] = o.keep || reuse ? nlohmann::ordered_json(run_root.string()) : nlohmann::ordered_json(nullptr);
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  char origin[64] = "reused the kept checkpoint";
  if (!reuse) std::snprintf(origin, sizeof origin, "generated in %.1f s", generate_secs);
  std::printf("# %s of rank files in, %s of safetensors out; %s; median of %d round(s), %s\n",
              format_bytes(bytes_in).c_str(), format_bytes(bytes_out).c_str(), origin, o.rounds,
              o.cold ? "page cache emptied before each step" : "page cache warm");
  std::printf("#%-26s %10s %14s\n", "step", "seconds", "GB/s");
  std::printf(" %-26s %10.3f %14.2f\n", "read floor (rank files)", read_s, static_cast<double>(bytes_in) / read_s / 1e9);
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
  std::printf("# merge peak RSS                  = %.1f MiB\n", static_cast<double>(peak_rss) / (1 << 20));
  if (o.keep || reuse) std::printf("# kept %s (delete it when done)\n", run_root.c_str());
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "bench", "Time a merge of a synthetic verl FSDP2 checkpoint of a real model shape against the I/O floors, same run");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("--model", o->checkpoint.model, "Model shape (see --list)");
  cmd->add_option("--world-size,--world_size", o->checkpoint.world_size, "Rank files of the checkpoint")->check(CLI::Range(1, 4096));
  cmd->add_option("--lora-rank,--lora_rank", o->checkpoint.lora_rank, "Add LoRA of this rank on every linear layer (folded by the merge)")
      ->check(CLI::Range(0, 65536));
  cmd->add_option("--dtype", o->checkpoint.dtype, "Parameter dtype of the checkpoint")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
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
  cmd->callback([&run, o] { run = [o] { return run_bench(*o); }; });
}

}  // namespace shardmerge::cli
