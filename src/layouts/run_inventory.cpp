#include "layouts/run_inventory.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "formats/dcp.hpp"
#include "layouts/names.hpp"
#include "util/text.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {
namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

bool has(const std::set<std::string>& files, const std::string& rel) { return files.count(rel) > 0; }

// The files a DCP dir's `.metadata` names must all be there.
void check_dcp(const RoleListing& role, const std::set<std::string>& files, const std::string& dir,
               std::vector<std::string>& problems) {
  const auto it = std::find_if(role.dcp.begin(), role.dcp.end(), [&](const DcpRefs& d) { return d.dir == dir; });
  if (it == role.dcp.end()) {
    problems.push_back(dir + "/.metadata missing (the DCP coordinator writes it last)");
    return;
  }
  if (!it->error.empty()) {
    problems.push_back(dir + "/.metadata unreadable: " + it->error);
    return;
  }
  std::vector<std::string> missing;
  for (const auto& f : it->files)
    if (!has(files, dir.empty() ? f : dir + "/" + f)) missing.push_back(f);
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    problems.push_back((dir.empty() ? std::string(".metadata") : dir) + ": files named by .metadata missing: " + names);
  }
}

// Each of verl's per-rank file kinds that is present at all must be present for every rank.
void check_fsdp(const RoleListing& role, const FsdpRole& fsdp, const std::set<std::string>& files,
                std::vector<std::string>& problems) {
  if (fsdp.world_size <= 0) {
    problems.push_back("world size unknown (no fsdp_config.json world_size and no single world size in the rank file names)");
    return;
  }
  if (!fsdp.missing_ranks.empty()) problems.push_back("missing model rank files for ranks " + join(fsdp.missing_ranks));
  for (const char* prefix : {"optim", "extra_state"}) {
    std::set<int64_t> ranks;
    for (const auto& f : role.files)
      if (auto r = parse_rank_file_name(f, prefix); r && r->world_size == fsdp.world_size) ranks.insert(r->rank);
    if (ranks.empty()) continue;
    std::vector<int64_t> missing;
    for (int64_t r = 0; r < fsdp.world_size; ++r)
      if (!ranks.count(r)) missing.push_back(r);
    if (!missing.empty())
      problems.push_back(std::string("missing ") + prefix + " rank files for ranks " + join(missing));
  }
  if (!has(files, "fsdp_config.json")) problems.push_back("no fsdp_config.json");
  if (!has(files, "huggingface/config.json")) problems.push_back("no huggingface/config.json");
}

// NeMo-Automodel: the consolidated model complete; the optimizer's DCP files all there.
void check_automodel(const RoleListing& role, const AutomodelRole& automodel, const std::set<std::string>& files,
                     std::vector<std::string>& problems) {
  if (!automodel.consolidated || !automodel.consolidated->weights_complete)
    problems.push_back("model/consolidated: no complete HF model");
  if (automodel.has_optimizer) check_dcp(role, files, "optim", problems);
}

void check_megatron(const RoleListing& role, const MegatronRole& meg, const std::set<std::string>& files,
                    std::vector<std::string>& problems) {
  if (meg.layout == "v2 manifest") {
    const auto& contents = (*meg.manifest)["contents"];
    if (!contents.is_object()) {
      problems.push_back(meg.manifest_name + " has no 'contents' object");
      return;
    }
    for (const auto& [key, entry] : contents.items()) {
      if (!entry.is_object() || !entry.contains("path") || !entry["path"].is_string()) continue;
      const std::string path = entry["path"].get<std::string>();
      const std::string format = entry.value("format", "");
      if (format == "megatron_dist_checkpoint") {
        check_dcp(role, files, path, problems);
      } else if (format == "json") {
        if (!has(files, path)) problems.push_back(path + " missing (" + meg.manifest_name + " lists it)");
      } else if (format == "huggingface") {
        if (!has(files, path + "/config.json")) problems.push_back(path + "/config.json missing (" + meg.manifest_name + " lists it)");
        if (key == "hf_model" && !(meg.huggingface && meg.huggingface->weights_complete))
          problems.push_back(path + ": HF weights incomplete");
      }
    }
  } else if (meg.layout == "v2 (no manifest)") {
    problems.push_back("no ckpt_contents.json (verl writes it last: the save did not finish)");
  } else if (meg.layout == "v1 dist_ckpt") {
    check_dcp(role, files, "dist_ckpt", problems);
    if (!has(files, "huggingface/config.json")) problems.push_back("no huggingface/config.json");
  } else {  // legacy mp_rank: every (tp, pp, ep) combination the names span
    std::set<int64_t> tps, pps, eps;
    std::set<std::string> present;
    for (const auto& d : meg.mp_rank_dirs) {
      const std::string name = fs::path(d).filename().string();
      if (auto m = parse_mp_rank_dir(name)) {
        tps.insert(m->tp);
        pps.insert(m->pp.value_or(-1));
        eps.insert(m->ep.value_or(-1));
        if (has(files, "model/" + name + "/model.pt")) present.insert(name);
      }
    }
    if (tps.empty()) problems.push_back("no model/mp_rank_* directory");
    std::vector<std::string> missing;
    for (int64_t tp = 0; !tps.empty() && tp <= *tps.rbegin(); ++tp)
      for (int64_t pp : pps)
        for (int64_t ep : eps) {
          char name[64];
          int n = std::snprintf(name, sizeof name, "mp_rank_%02lld", static_cast<long long>(tp));
          if (pp >= 0) n += std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "_%03lld", static_cast<long long>(pp));
          if (ep >= 0) std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "_%03lld", static_cast<long long>(ep));
          if (!present.count(name)) missing.push_back(std::string("model/") + name + "/model.pt");
        }
    if (!pps.empty() && *pps.begin() >= 0 && *pps.rbegin() + 1 != static_cast<int64_t>(pps.size()))
      problems.push_back("pipeline stages are not 0.." + std::to_string(*pps.rbegin()));
    for (const auto& m : missing) problems.push_back(m + " missing");
    if (!has(files, "hf_config_and_tokenizer/config.json") && !has(files, "huggingface/config.json"))
      problems.push_back("no hf_config_and_tokenizer/config.json");
  }
}

}  // namespace

RunInventory build_inventory(const RunListing& listing) {
  RunInventory inv;
  inv.path = listing.path;
  inv.stray_temps = listing.stray_temps;
  inv.has_trash = listing.has_trash;
  for (const auto& s : listing.steps) {
    StepStatus st;
    st.step = s.step;
    st.name = s.name;
    st.symlink_target = s.symlink_target;
    st.bytes = s.bytes;
    if (s.symlink_target) {
      st.problems.push_back("a symbolic link (to " + *s.symlink_target + "): not inspected");
    } else {
      if (s.roles.empty()) st.problems.push_back("no role directory (actor, critic, ...) holds a checkpoint");
      for (const auto& t : s.temp_entries) st.problems.push_back("temporary entry left by a killed writer: " + t);
    }
    for (const auto& r : s.roles) {
      RoleStatus rs;
      rs.name = r.name;
      const std::set<std::string> files(r.files.begin(), r.files.end());
      if (const auto* fsdp = std::get_if<FsdpRole>(&r.info)) {
        rs.kind = "fsdp";
        check_fsdp(r, *fsdp, files, rs.problems);
      } else if (const auto* automodel = std::get_if<AutomodelRole>(&r.info)) {
        rs.kind = "automodel";
        check_automodel(r, *automodel, files, rs.problems);
      } else if (std::holds_alternative<TorchTitanCheckpoint>(r.info)) {
        rs.kind = "torchtitan";
        check_dcp(r, files, "", rs.problems);  // the step-N directory is one DCP checkpoint
      } else {
        rs.kind = "megatron";
        check_megatron(r, std::get<MegatronRole>(r.info), files, rs.problems);
      }
      for (const auto& p : rs.problems) st.problems.push_back(r.name + ": " + p);
      st.roles.push_back(std::move(rs));
    }
    inv.steps.push_back(std::move(st));
  }
  std::sort(inv.steps.begin(), inv.steps.end(), [](const auto& a, const auto& b) { return a.step < b.step; });

  if (!listing.tracker_text) {
    inv.tracker_problem = "no latest_checkpointed_iteration.txt";
    return inv;
  }
  const auto parsed = parse_tracker_step(*listing.tracker_text);
  if (!parsed) {
    inv.tracker_problem = "latest_checkpointed_iteration.txt does not hold a step number ('" +
                          std::string(trim_whitespace(*listing.tracker_text)) + "')";
    return inv;
  }
  const int64_t step = *parsed;
  inv.tracker_step = step;
  bool found = false;
  for (auto& s : inv.steps)
    if (s.step == step) s.tracked = found = true;
  if (!found)
    inv.tracker_problem = "latest_checkpointed_iteration.txt names step " + std::to_string(step) +
                          ", which has no global_step_" + std::to_string(step) + " directory";
  return inv;
}

std::vector<PruneDecision> plan_prune(const RunInventory& inv, int64_t keep) {
  if (keep < 1) throw usage_error("--keep must be at least 1 (got " + std::to_string(keep) + ")");
  if (!inv.tracker_problem.empty())
    throw Error("refusing to prune: " + inv.tracker_problem +
                "; without it the step a resume would load is unknown, so nothing is removed")
        .file(inv.path);
  const int64_t tracker = *inv.tracker_step;
  // The `keep` newest complete steps at or below the tracker's; everything older than the
  // oldest of them is removable.
  std::vector<int64_t> kept_complete;
  for (auto it = inv.steps.rbegin(); it != inv.steps.rend() && static_cast<int64_t>(kept_complete.size()) < keep; ++it)
    if (it->step <= tracker && it->complete()) kept_complete.push_back(it->step);
  const bool enough = static_cast<int64_t>(kept_complete.size()) == keep;
  const int64_t cutoff = enough ? kept_complete.back() : INT64_MIN;
  const std::string n = std::to_string(keep);

  std::vector<PruneDecision> out;
  for (const auto& s : inv.steps) {
    PruneDecision d;
    d.step = &s;
    const bool is_kept_complete = std::find(kept_complete.begin(), kept_complete.end(), s.step) != kept_complete.end();
    if (s.symlink_target) {
      d.reason = "a symbolic link (to " + *s.symlink_target + "): never followed or removed";
    } else if (s.step == tracker) {
      d.reason = "named by latest_checkpointed_iteration.txt";
    } else if (s.step > tracker) {
      d.reason = "newer than the tracker's step " + std::to_string(tracker) + " (a save may be in progress)";
    } else if (is_kept_complete) {
      d.reason = "one of the " + n + " newest complete steps";
    } else if (!enough) {
      d.reason = "fewer than " + n + " complete steps at or below the tracker's: nothing is removed";
    } else if (s.step > cutoff) {
      d.reason = "incomplete, but newer than the oldest kept complete step";
    } else {
      d.remove = true;
      d.reason = s.complete() ? "older than the " + n + " newest complete steps"
                              : "older than the " + n + " newest complete steps; incomplete: " + s.problems.front();
    }
    out.push_back(std::move(d));
  }
  return out;
}

namespace {

bool is_temp_name(const std::string& name) {
  return name.find(".tmp-") != std::string::npos ||
         (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0);
}

// Regular files (relative paths and total size) and temp entries under `dir`; symbolic links
// inside are listed by name but never followed.
void walk_step(const fs::path& dir, std::vector<std::string>& files, std::vector<std::string>& temps,
               uint64_t& bytes) {
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
  if (ec) throw Error("cannot list the step directory: " + ec.message()).file(dir.string());
  for (; it != end; it.increment(ec)) {
    if (ec) throw Error("cannot list the step directory: " + ec.message()).file(dir.string());
    const fs::path rel = it->path().lexically_relative(dir);
    if (is_temp_name(it->path().filename().string())) temps.push_back(rel.generic_string());
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;  // removed while listing
    if (S_ISREG(st.st_mode)) {
      files.push_back(rel.generic_string());
      bytes += static_cast<uint64_t>(st.st_size);
    }
  }
  std::sort(files.begin(), files.end());
  std::sort(temps.begin(), temps.end());
}

RoleListing list_role(const std::string& name, const fs::path& role_dir, const Layout& layout,
                      const std::vector<std::string>& step_files) {
  RoleListing role{name, {}, {}, {}};
  if (layout.kind == Kind::FsdpRole) role.info = std::get<FsdpRole>(layout.info);
  else if (layout.kind == Kind::AutomodelRole) role.info = std::get<AutomodelRole>(layout.info);
  else if (layout.kind == Kind::TorchTitan) role.info = std::get<TorchTitanCheckpoint>(layout.info);
  else role.info = std::get<MegatronRole>(layout.info);
  const std::string prefix = name == "." ? "" : name + "/";
  for (const auto& f : step_files)
    if (f.compare(0, prefix.size(), prefix) == 0) role.files.push_back(f.substr(prefix.size()));
  for (const auto& f : role.files) {
    const fs::path p(f);
    if (p.filename() != ".metadata") continue;
    DcpRefs refs;
    refs.dir = p.parent_path().generic_string();
    try {
      const DcpMetadata meta = read_dcp_metadata((role_dir / p.parent_path()).string());
      std::set<std::string> named;
      for (const auto& t : meta.tensors)
        for (const auto& c : t.chunks) named.insert(c.relative_path);
      refs.files.assign(named.begin(), named.end());
    } catch (const std::exception& e) {
      refs.error = e.what();
    }
    role.dcp.push_back(std::move(refs));
  }
  return role;
}

}  // namespace

RunListing list_run(const std::string& run_root) {
  const fs::path root(run_root);
  std::error_code ec;
  if (!fs::exists(root, ec)) throw usage_error(run_root + ": no such file or directory");
  if (!fs::is_directory(root, ec)) throw usage_error(run_root + ": not a directory");
  RunListing listing;
  listing.path = run_root;
  if (fs::is_regular_file(root / "latest_checkpointed_iteration.txt", ec))
    listing.tracker_text = read_small_file((root / "latest_checkpointed_iteration.txt").string(), 4096);
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(root, ec)) entries.push_back(e.path());
  if (ec) throw Error("cannot list the run root: " + ec.message()).file(run_root);
  std::sort(entries.begin(), entries.end());
  for (const auto& p : entries) {
    const std::string name = p.filename().string();
    const fs::file_status link_status = fs::symlink_status(p, ec);
    if (name == kTrashDirName) {
      listing.has_trash = true;
      continue;
    }
    const auto step = parse_step_dir(name);
    if (!step) {
      if (is_temp_name(name)) listing.stray_temps.push_back(name);
      continue;
    }
    StepListing s;
    s.step = *step;
    s.name = name;
    if (fs::is_symlink(link_status)) {
      s.symlink_target = fs::read_symlink(p, ec).string();
      listing.steps.push_back(std::move(s));
      continue;
    }
    if (!fs::is_directory(link_status)) continue;  // a file named global_step_N is not a step
    std::vector<std::string> files;
    walk_step(p, files, s.temp_entries, s.bytes);
    const Layout layout = detect(p.string());
    if (layout.kind == Kind::FsdpRole || layout.kind == Kind::MegatronRole || layout.kind == Kind::AutomodelRole) {
      s.roles.push_back(list_role(".", p, layout, files));  // verl's SFT trainer: the step is the role
    } else if (layout.kind == Kind::StepRoot) {
      const StepRoot& step = std::get<StepRoot>(layout.info);
      for (const auto& role : step.roles) {
        const fs::path role_dir = p / role;
        if (fs::is_symlink(fs::symlink_status(role_dir, ec))) continue;  // never followed out of the step
        s.roles.push_back(list_role(role, role_dir, detect(role_dir.string()), files));
      }
      if (step.torchtitan) {  // verl's TorchTitan engine: every role's model in one step-N checkpoint
        const fs::path titan(*step.torchtitan);
        s.roles.push_back(list_role(titan.filename().string(), titan, detect(titan.string()), files));
      }
    }
    listing.steps.push_back(std::move(s));
  }
  return listing;
}

}  // namespace shardmerge::layouts
