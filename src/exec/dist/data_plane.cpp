#include "exec/dist/data_plane.hpp"

#include <map>
#include <nlohmann/json.hpp>

#include "shardmerge/error.hpp"
#ifdef SHARDMERGE_HAVE_NCCL
#include "exec/dist/nccl_link.hpp"
#endif

namespace shardmerge::dist {
namespace {

// A process's answer to "can you join an NCCL data plane?": why not (empty: it can), and which
// GPU it would use.
struct NcclAnswer {
  std::string problem;
  std::string gpu;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(NcclAnswer, problem, gpu)

// Every process's answer: empty, or why not.
std::vector<std::string> nccl_problems(ProcessGroup& group, [[maybe_unused]] int& device) {
  const std::vector<NcclAnswer> answers = run_together(group, [&] {
#ifdef SHARDMERGE_HAVE_NCCL
    const NcclProbe p = probe_nccl(group.local_rank());
    device = p.device;
    return NcclAnswer{p.problem, p.gpu};
#else
    return NcclAnswer{"this shardmerge was built without NCCL", ""};
#endif
  });
  std::vector<std::string> problems;
  std::map<std::string, size_t> first_on_gpu;
  for (size_t r = 0; r < answers.size(); ++r) {
    std::string problem = answers[r].problem;
    if (problem.empty()) {
      const auto [it, fresh] = first_on_gpu.emplace(answers[r].gpu, r);
      if (!fresh) problem = "it would share its GPU with process rank " + std::to_string(it->second) + " (NCCL needs one GPU per process)";
    }
    problems.push_back(std::move(problem));
  }
  return problems;
}

}  // namespace

ChosenDataPlane choose_data_plane(ProcessGroup& group, const std::string& transport, bool needed) {
  ChosenDataPlane chosen;
  if (transport == "mpi") {
    if (!group.data_plane())
      throw usage_error("--transport mpi needs processes started by mpirun or srun (this launch uses the " +
                        group.transport() + ") and a shardmerge built with MPI");
    if (needed) chosen.plane = group.data_plane();
    return chosen;
  }
  if (transport != "auto" && transport != "nccl") throw usage_error("--transport must be auto, mpi or nccl, not '" + transport + "'");
  if (transport == "auto" && !needed) return chosen;
  int device = -1;
  const std::vector<std::string> problems = nccl_problems(group, device);
  for (size_t r = 0; r < problems.size(); ++r) {
    if (problems[r].empty()) continue;
    if (transport == "nccl")
      throw usage_error("--transport nccl: process rank " + std::to_string(r) + " cannot use NCCL: " + problems[r]);
    if (needed) chosen.plane = group.data_plane();  // auto: MPI, or none
    return chosen;
  }
  if (!needed) return chosen;
#ifdef SHARDMERGE_HAVE_NCCL
  chosen.owned = std::make_unique<RoundExchange>(make_nccl_link(
      group.rank(), group.size(), device,
      [&group](const std::string& id, bool ok) { return group.all_gather(id, ok).at(0); }, group.peer_timeout_s()));
  chosen.plane = chosen.owned.get();
#endif
  return chosen;
}

}  // namespace shardmerge::dist
