#include "reshard/reshard.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>
#include <nlohmann/json.hpp>

#include "formats/zip.hpp"
#include "layouts/fsdp.hpp"
#include "layouts/layout.hpp"
#include "layouts/names.hpp"
#include "reshard/rank_files.hpp"
#include "reshard/target.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/plan.hpp"
#include "util/fd_io.hpp"
#include "util/file.hpp"
#include "util/free_space.hpp"
#include "util/rss.hpp"
#include "util/units.hpp"
#include "write/hf_tree_writer.hpp"

namespace fs = std::filesystem;

namespace shardmerge::reshard {
namespace {

constexpr uint64_t kCopyBuffer = 8u << 20;  // as the torch.save writer's chunk

// The rank files `prefix`_world_size_W_rank_R.pt of every rank; empty when none is present,
// an Error naming the first missing one when only some are.
std::vector<std::string> rank_paths(const std::string& role_dir, const std::string& prefix, int64_t world) {
  std::vector<std::string> paths;
  std::string missing;
  for (int64_t r = 0; r < world; ++r) {
    const fs::path p = fs::path(role_dir) / layouts::rank_file_name(prefix, world, r);
    if (fs::is_regular_file(p))
      paths.push_back(p.string());
    else if (missing.empty())
      missing = p.filename().string();
  }
  if (!paths.empty() && !missing.empty())
    throw Error(missing + " is missing (" + std::to_string(paths.size()) + " of " + std::to_string(world) +
                " " + prefix + " rank files are present)")
        .file(role_dir);
  return paths;
}

bool is_rank_file(const std::string& name) {
  for (const char* prefix : {"model", "optim", "extra_state"})
    if (layouts::parse_rank_file_name(name, prefix)) return true;
  return false;
}

// Streams `size` bytes of reader file `file` into a new file at `to`, through the reader (so
// its records are checked as they pass).
uint64_t copy_through(const SourceReader& reader, uint32_t file, uint64_t size, const std::string& to) {
  File out = File::create(to);
  std::unique_ptr<char[]> buf(new char[std::min<uint64_t>(kCopyBuffer, std::max<uint64_t>(size, 1))]);
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kCopyBuffer, size - done));
    reader.read(file, done, buf.get(), n);
    out.write_exact(done, buf.get(), n);
    done += n;
  }
  out.sync();
  return size;
}

}  // namespace

ReshardSummary reshard_role(const ReshardOptions& o) {
  const TargetMesh mesh = parse_target_mesh(o.mesh, o.world_size);
  ReshardSummary summary;
  const std::string role_dir = layouts::resolve_role_dir(o.local_dir, "actor", summary.notes);
  const layouts::Layout layout = layouts::detect(role_dir);
  if (layout.kind != layouts::Kind::FsdpRole)
    throw Error(std::string("not a verl FSDP role directory (it looks like: ") + layouts::kind_name(layout.kind) + ")")
        .file(role_dir);
  const auto& role = std::get<layouts::FsdpRole>(layout.info);
  layouts::check_fsdp_role(role);
  const int64_t world = role.world_size;
  summary.role_dir = role_dir;
  summary.source_world = world;
  summary.target_world = mesh.world_size();
  summary.target_mesh = mesh.shape;

  const std::vector<std::string> model = rank_paths(role_dir, "model", world);
  if (static_cast<int64_t>(model.size()) != world)
    throw Error("no " + layouts::rank_file_name("model", world, 0) + " rank files").file(role_dir);
  const std::vector<std::string> optim = rank_paths(role_dir, "optim", world);
  const std::vector<std::string> extra = rank_paths(role_dir, "extra_state", world);
  summary.optimizer = !optim.empty();
  summary.extra_state = !extra.empty();
  if (optim.empty()) summary.notes.push_back("no optim_ rank files: the output has model weights only");

  SourceReader reader(o.check_crc);
  std::vector<SourceKind> kinds;
  kinds.push_back(plan_kind("model", model, mesh, reader));
  if (!optim.empty()) kinds.push_back(plan_kind("optim", optim, mesh, reader));
  std::vector<uint32_t> extra_files;
  std::vector<uint64_t> extra_sizes;
  for (const std::string& p : extra) {
    extra_files.push_back(reader.add(p));
    File f = File::open_read(p);
    extra_sizes.push_back(f.size());
    const ZipArchive zip = ZipArchive::read(f);
    for (const ZipEntry& e : zip.entries()) reader.add_record(extra_files.back(), e, "(extra state)");
  }
  reader.start();
  // What the writing holds beyond what is resident now: the copy buffer, one target pickle
  // being built and its zip directory (about a source pickle's size, the largest kind's).
  uint64_t pickle_bytes = 0;
  for (const SourceKind& k : kinds) pickle_bytes = std::max(pickle_bytes, k.template_bytes);
  // Each writing thread holds those; as many threads as the limit allows, up to --threads.
  const uint64_t resident = current_rss_bytes(), per_worker = kCopyBuffer + 2 * pickle_bytes;
  if (resident + per_worker > o.memory_limit)
    throw Error("resharding needs about " + format_bytes(resident + per_worker) + " of memory (the checkpoint's pickles, " +
                format_bytes(pickle_bytes) + " the largest, and an " + format_bytes(kCopyBuffer) +
                " copy buffer) but --memory-limit is " + format_bytes(o.memory_limit))
        .file(role_dir);
  const unsigned wanted = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  const auto workers = static_cast<unsigned>(std::min<uint64_t>(
      {wanted, static_cast<uint64_t>(mesh.world_size()), (o.memory_limit - resident) / per_worker}));

  // Every other file of the role is copied: huggingface/, lora_train_meta.json, lora_adapter/, ...
  std::vector<fs::path> copies;
  uint64_t copy_bytes = 0;
  for (auto it = fs::recursive_directory_iterator(role_dir); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path rel = fs::relative(it->path(), role_dir);
    if (it.depth() == 0 && (rel == "fsdp_config.json" || is_rank_file(rel.string()))) continue;
    if (it->is_regular_file()) {
      copies.push_back(rel);
      copy_bytes += it->file_size();
    }
  }
  nlohmann::ordered_json config = {{"FSDP_version", 2}, {"world_size", 0}};
  if (const fs::path p = fs::path(role_dir) / "fsdp_config.json"; fs::exists(p)) {
    try {
      config = nlohmann::ordered_json::parse(read_small_file(p.string(), 1 << 20));
    } catch (const nlohmann::json::exception& e) {
      throw Error(std::string("not valid JSON: ") + e.what()).file(p.string());
    }
    if (!config.is_object()) throw Error("not a JSON object").file(p.string());
  }
  config["world_size"] = mesh.world_size();

  HfTreeWriter writer(o.target_dir, o.force, role_dir);
  uint64_t needed = copy_bytes;
  for (const SourceKind& k : kinds) needed += k.target_bytes(mesh);
  for (int64_t r = 0; r < mesh.world_size(); ++r)
    if (!extra.empty()) needed += extra_sizes[static_cast<size_t>(extra_state_source(r, world))];
  const std::string parent = fs::path(writer.resolved_target()).parent_path().string();
  const MergePlan no_tensors;
  writer.create(no_tensors);
  require_free_space(needed, free_bytes(parent), parent);
  const fs::path temp(writer.temp_dir());

  // Target ranks are independent files, written by `workers` threads at once: most of the time
  // goes to the kernel's copies into the page cache, which then run on every core.
  const int64_t targets = mesh.world_size();
  std::vector<uint64_t> rank_bytes(static_cast<size_t>(targets), 0);
  auto write_rank = [&](int64_t r) {
    uint64_t bytes = 0;
    for (const SourceKind& k : kinds)
      bytes += write_target_file(k, mesh, r, reader, (temp / layouts::rank_file_name(k.prefix, targets, r)).string());
    if (!extra.empty()) {
      const auto s = static_cast<size_t>(extra_state_source(r, world));
      bytes += copy_through(reader, extra_files[s], extra_sizes[s],
                            (temp / layouts::rank_file_name("extra_state", targets, r)).string());
    }
    rank_bytes[static_cast<size_t>(r)] = bytes;
  };
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < workers; ++i)
    pool.emplace_back([&] {
      for (int64_t r; !failed && (r = next.fetch_add(1)) < targets;) {
        try {
          write_rank(r);
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          failed = true;
        }
      }
    });
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  for (uint64_t b : rank_bytes) summary.bytes_written += b;
  summary.files_written += static_cast<int>(targets * static_cast<int64_t>(kinds.size() + (extra.empty() ? 0 : 1)));
  reader.finish();
  for (const fs::path& rel : copies) {
    fs::create_directories((temp / rel).parent_path());
    const File in = File::open_read((fs::path(role_dir) / rel).string());
    const File out = File::create((temp / rel).string());
    const uint64_t n = in.size();
    if (copy_file_bytes(in.fd(), 0, out.fd(), 0, n) != n) {
      std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(n, kCopyBuffer)));
      for (uint64_t done = 0; done < n;) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(buf.size(), n - done));
        in.read_exact(done, buf.data(), k);
        out.write_exact(done, buf.data(), k);
        done += k;
      }
    }
    out.sync();
    summary.bytes_written += n;
    ++summary.files_written;
  }
  {
    const std::string text = config.dump(4);  // as verl writes it (json.dump, indent=4)
    const File f = File::create((temp / "fsdp_config.json").string());
    f.write_exact(0, text.data(), text.size());
    f.sync();
  }
  ++summary.files_written;
  writer.commit(no_tensors);
  summary.peak_rss_bytes = peak_rss_bytes();
  return summary;
}

}  // namespace shardmerge::reshard
