// Which transport moves slices between the processes of a merge (--transport):
//  - nccl: ncclSend/ncclRecv between the processes' GPUs, in rounds (round_exchange.hpp), one GPU
//    per process; NCCL's id goes out over the process group (MPI or torchrun's bootstrap);
//  - mpi: MPI point-to-point from host memory (mpi_group.hpp), under mpirun or srun;
//  - auto: nccl where every process can use it (built with NCCL, libnccl loads, a GPU of its
//    own), else mpi where an MPI launcher started the processes, else none: then every output
//    file must be written where all its sources are (a filesystem all processes see).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exec/dist/process_group.hpp"

namespace shardmerge::dist {

inline const std::vector<std::string> kTransportChoices = {"auto", "mpi", "nccl"};

struct ChosenDataPlane {
  DataPlane* plane = nullptr;  // null: no bytes move between processes
  std::unique_ptr<DataPlane> owned;
};

// Collective. `needed`: the plan reads sources only some processes hold; without, no plane is
// made, though an explicit `transport` is still checked on every process. Throws a usage error
// naming the process that cannot use an explicitly asked transport.
ChosenDataPlane choose_data_plane(ProcessGroup& group, const std::string& transport, bool needed);

}  // namespace shardmerge::dist
