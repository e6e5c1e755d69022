#include "api/node_local_plan.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "layouts/fsdp.hpp"
#include "layouts/layout.hpp"
#include "layouts/megatron.hpp"
#include "layouts/node_local.hpp"
#include "layouts/summary_codec.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace shardmerge::api {
namespace {

// The --local_dir each process was given, and rank 0's resolution of it to the role dir (with
// the notes saying how).
struct GivenRoleDir {
  std::string given;
  std::string dir;
  std::vector<std::string> notes;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(GivenRoleDir, given, dir, notes)

// The summaries of the data files this process is the lowest holder of, for the layout the
// view shows: FSDP rank files, or the items of a dist_ckpt's .distcp files.
layouts::NodeSummaries summarise_here(const layouts::NodeLocalView& view) {
  layouts::NodeSummaries out;
  const std::vector<std::string>& mine = view.summarised_here();
  auto is_mine = [&](const std::string& real) { return std::find(mine.begin(), mine.end(), real) != mine.end(); };
  const layouts::Layout layout = layouts::detect(view.view_dir());
  if (const auto* fsdp = std::get_if<layouts::FsdpRole>(&layout.info)) {
    for (const std::string& f : fsdp->rank_files)
      if (!f.empty() && is_mine(view.real_path(f))) out.torch_files.push_back(layouts::summarise_torch_file(view.real_path(f)));
  } else if (const auto* megatron = std::get_if<layouts::MegatronRole>(&layout.info);
             megatron && !megatron->dist_ckpt.empty() && fs::is_regular_file(fs::path(megatron->dist_ckpt) / ".metadata")) {
    DcpMetadata meta = read_dcp_metadata(megatron->dist_ckpt);
    meta.dir = view.real_path(megatron->dist_ckpt);
    out.dcp = layouts::summarise_dcp_items(std::move(meta), [&](const std::string& relative) {
      return is_mine(view.real_path(megatron->dist_ckpt) + "/" + relative);
    });
  }
  return out;
}

void replace_all(std::string& text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
}

// The plan as every process will run it: real paths, owners and stamps of the sources as
// their holders saw them, sidecars as content (the view is removed after planning).
void make_real(PlannedMerge& pm, const layouts::NodeLocalView& view) {
  auto real_text = [&](std::string& s) { replace_all(s, view.view_dir(), view.role_dir()); };
  MergePlan& plan = pm.plan;
  for (SourceFile& s : plan.sources) {
    const bool copied = s.path.rfind(view.view_dir(), 0) == 0;  // planning read the view's copy
    s.path = view.real_path(s.path);
    const auto holder = view.holder_of(s.path);
    if (!holder) throw Error("no process holds this file, which the plan reads").file(s.path);
    s.owner = holder->first;
    if (copied) s.planned = holder->second;
  }
  for (Sidecar& c : plan.sidecars) {
    if (!c.content && c.source.rfind(view.view_dir(), 0) == 0) c.content = read_small_file(c.source, 1ull << 30);
    c.source = view.real_path(c.source);
  }
  real_text(plan.source_dir);
  real_text(plan.layout);
  for (auto* texts : {&plan.notes, &plan.warnings, &pm.lora_summary, &pm.sources.notes})
    for (std::string& t : *texts) real_text(t);
  for (OutputTensor& t : plan.tensors) real_text(t.origin);
  real_text(pm.role_dir);
  real_text(pm.sources.description);
  for (SourceFile& s : pm.sources.files) s.path = view.real_path(s.path);
}

}  // namespace

bool has_node_local_sources(const MergePlan& plan) {
  return std::any_of(plan.sources.begin(), plan.sources.end(), [](const SourceFile& s) { return s.owner != kAnyOwner; });
}

PlannedMerge plan_node_local(dist::ProcessGroup& group, const MergeRequest& request) {
  // Every process must be given the same role-dir path (its contents differ from node to node);
  // rank 0, whose node has the sidecars, resolves a run root or step dir to the role dir.
  const std::vector<GivenRoleDir> given = dist::run_together(group, [&] {
    GivenRoleDir g{fs::absolute(request.local_dir).lexically_normal().string(), "", {}};
    if (group.rank() == 0)
      g.dir = fs::absolute(layouts::resolve_role_dir(request.local_dir, request.role, g.notes)).lexically_normal().string();
    return g;
  });
  const GivenRoleDir& root = given.at(0);
  for (size_t r = 1; r < given.size(); ++r)
    if (given[r].given != root.given)
      throw Error("rank " + std::to_string(r) + " was given a different --local_dir than rank 0 (" + given[r].given + " vs " +
                  root.given + "): every process must be given the same path; its contents may differ from node to node");
  const std::string& role_dir = root.dir;
  const auto listings = dist::run_together(group, [&] { return layouts::encode_node_files(layouts::list_node_files(role_dir)); });
  std::vector<std::vector<layouts::NodeFile>> files;
  for (const std::string& l : listings) files.push_back(layouts::decode_node_files(l));

  std::unique_ptr<layouts::NodeLocalView> view;
  const auto summaries = dist::run_together(group, [&] {
    view = std::make_unique<layouts::NodeLocalView>(role_dir, files, group.rank());
    return layouts::encode_summaries(summarise_here(*view));
  });
  layouts::GatheredSummaries gathered;
  gathered.view = view.get();
  for (size_t r = 0; r < summaries.size(); ++r) {
    layouts::NodeSummaries s = layouts::decode_summaries(summaries[r], "process rank " + std::to_string(r));
    for (layouts::TorchFileSummary& t : s.torch_files) gathered.torch_files.emplace(t.path, std::move(t));
    gathered.dcp.data_files.merge(s.dcp.data_files);
    gathered.dcp.stored_items.merge(s.dcp.stored_items);
    gathered.dcp.compressed_items.merge(s.dcp.compressed_items);
  }

  MergeRequest over_view = request;
  over_view.local_dir = view->view_dir();
  over_view.gathered = &gathered;
  PlannedMerge pm;
  try {
    pm = plan_merge(over_view);
  } catch (const Error& e) {
    // Name the real paths, as a single-process merge of the same files would.
    std::string what = e.what();
    replace_all(what, view->view_dir(), view->role_dir());
    throw Error(what, e.exit_code());
  }
  pm.plan.notes.insert(pm.plan.notes.begin(), root.notes.begin(), root.notes.end());
  make_real(pm, *view);
  return pm;
}

}  // namespace shardmerge::api
