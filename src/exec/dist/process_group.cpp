#include "exec/dist/process_group.hpp"

#include <cstdlib>

#include "exec/dist/tcp_group.hpp"
#include "shardmerge/error.hpp"
#ifdef SHARDMERGE_HAVE_MPI
#include "exec/dist/mpi_group.hpp"
#endif

namespace shardmerge::dist {
namespace {

std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end) throw usage_error(std::string("environment variable ") + name + "='" + v + "' is not an integer");
  return static_cast<int>(x);
}

}  // namespace

std::optional<LaunchInfo> launch_from_environment() {
  LaunchInfo info;
  auto rank = env_int("RANK"), size = env_int("WORLD_SIZE");
  if (!rank || !size) {  // mpirun (Open MPI), then PMI (MPICH, Slurm's pmi2), then PMIx (srun --mpi=pmix)
    info.mpi = true;
    rank = env_int("OMPI_COMM_WORLD_RANK");
    size = env_int("OMPI_COMM_WORLD_SIZE");
    if (!rank || !size) {
      rank = env_int("PMI_RANK");
      size = env_int("PMI_SIZE");
    }
    if (!rank || !size) {
      rank = env_int("PMIX_RANK");
      size = env_int("SLURM_NTASKS");
    }
  }
  if (!rank || !size || *size <= 1) return std::nullopt;
  info.rank = *rank;
  info.world_size = *size;
  info.local_rank = env_int("LOCAL_RANK").value_or(
      env_int("OMPI_COMM_WORLD_LOCAL_RANK").value_or(env_int("SLURM_LOCALID").value_or(0)));
  if (const char* addr = std::getenv("MASTER_ADDR"); addr && *addr) info.address = addr;
  if (auto p = env_int("SHARDMERGE_PORT")) info.port = *p;
  else if (auto m = env_int("MASTER_PORT")) info.port = *m + 1;
  if (info.rank < 0 || info.rank >= info.world_size) throw usage_error("RANK is outside [0, WORLD_SIZE)");
  return info;
}

std::string ProcessGroup::broadcast(const std::string& from_root, bool ok) {
  return all_gather(rank() == 0 ? from_root : std::string(), rank() == 0 ? ok : true).at(0);
}

std::unique_ptr<ProcessGroup> join_process_group(const LaunchInfo& info, int timeout_s) {
#ifdef SHARDMERGE_HAVE_MPI
  if (info.mpi) return std::make_unique<MpiProcessGroup>(info);
#endif
  return std::make_unique<TcpProcessGroup>(info, timeout_s);
}

}  // namespace shardmerge::dist
