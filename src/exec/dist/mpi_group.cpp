#include "exec/dist/mpi_group.hpp"

// The C API only: mpi.h would otherwise pull in the deprecated C++ bindings, which need a
// library we do not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "shardmerge/error.hpp"

namespace shardmerge::dist {
namespace {

constexpr int kRequestTag = 0;  // replies use tags 1 .. tag_limit_
constexpr unsigned kServingThreads = 2;

// What one process asks another for: bytes of a source it owns, or a control word.
struct Request {
  enum Kind : uint32_t { Read, Done, Stop };  // Done: the sender reads no more; Stop: a serving thread ends
  uint32_t kind = Read;
  uint32_t file = 0;
  int32_t reply_tag = 0;
  uint32_t unused = 0;
  uint64_t offset = 0;
  uint64_t n = 0;
};

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string("MPI: ") + what + " failed: " + std::string(text, static_cast<size_t>(len)));
}

// Waits for `done()` to say true, giving the core away between polls: Open MPI's blocking calls
// spin, and the executor's threads and the serving threads of every process on a node would spin
// beside the work they wait for. The sleep stays short (at most 100 us) so that replies of a
// few hundred KiB to a few MiB lose little to it.
template <typename Done>
void poll_until(Done done) {
  for (unsigned i = 0;; ++i) {
    if (done()) return;
    if (i >= 16) std::this_thread::sleep_for(std::chrono::microseconds(std::min(100u, 5u << std::min(i - 16, 5u))));
  }
}

void wait(MPI_Request& request, const char* what, MPI_Status* status = MPI_STATUS_IGNORE) {
  poll_until([&] {
    int flag = 0;
    check(MPI_Test(&request, &flag, status), what);
    return flag != 0;
  });
}

// One message carries at most INT_MAX bytes; reads are split well below that.
constexpr uint64_t kMaxMessage = 1ull << 30;

// MPI can be initialised once per process, and never again after MPI_Finalize: a Python process
// may merge several times, and may have initialised MPI itself (mpi4py). So the first group
// initialises it unless someone did, and it is finalised at exit, by whoever initialised it.
void initialise_mpi_once() {
  int finalized = 0, initialized = 0, provided = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw Error("MPI was already finalized in this process: a multi-process merge cannot start again");
  MPI_Initialized(&initialized);
  if (!initialized) {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    });
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw Error("the MPI library runs without MPI_THREAD_MULTIPLE" +
                std::string(initialized ? " (it was initialised before shardmerge: ask for MPI_THREAD_MULTIPLE there)" : "") +
                ", which the data plane needs");
}

}  // namespace

struct MpiProcessGroup::Communicators {
  MPI_Comm control = MPI_COMM_NULL;
  MPI_Comm data = MPI_COMM_NULL;
};

MpiProcessGroup::MpiProcessGroup(const LaunchInfo& info) : ProcessGroup(info), comms_(std::make_unique<Communicators>()) {
  initialise_mpi_once();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != info.rank || size != info.world_size)
    throw Error("MPI says rank " + std::to_string(rank) + " of " + std::to_string(size) + ", the launcher's variables rank " +
                std::to_string(info.rank) + " of " + std::to_string(info.world_size));
  MPI_Comm_dup(MPI_COMM_WORLD, &comms_->control);
  MPI_Comm_dup(MPI_COMM_WORLD, &comms_->data);
  void* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub) tag_limit_ = *static_cast<int*>(ub);
}

MpiProcessGroup::~MpiProcessGroup() {
  if (!servers_.empty()) {
    try {
      end_serving();
    } catch (...) {  // the job is failing already
    }
  }
  MPI_Comm_free(&comms_->data);
  MPI_Comm_free(&comms_->control);
}

std::vector<std::string> MpiProcessGroup::all_gather(const std::string& mine, bool ok) {
  if (mine.size() > static_cast<size_t>(INT_MAX) / static_cast<size_t>(size()))
    throw Error("multi-process merge: a control message of " + std::to_string(mine.size()) + " bytes is too large");
  // The length carries the status: -(length + 1) for a process that failed.
  const int64_t mine_len = ok ? static_cast<int64_t>(mine.size()) : -static_cast<int64_t>(mine.size()) - 1;
  std::vector<int64_t> lens(static_cast<size_t>(size()));
  check(MPI_Allgather(&mine_len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, comms_->control), "MPI_Allgather");
  std::vector<int> counts(lens.size()), displs(lens.size());
  int total = 0;
  for (size_t r = 0; r < lens.size(); ++r) {
    counts[r] = static_cast<int>(lens[r] >= 0 ? lens[r] : -lens[r] - 1);
    displs[r] = total;
    total += counts[r];
  }
  std::string packed(static_cast<size_t>(total), '\0');
  check(MPI_Allgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, packed.data(), counts.data(), displs.data(),
                       MPI_BYTE, comms_->control),
        "MPI_Allgatherv");
  std::vector<std::string> all(lens.size());
  for (size_t r = 0; r < lens.size(); ++r) {
    all[r] = packed.substr(static_cast<size_t>(displs[r]), static_cast<size_t>(counts[r]));
    if (lens[r] < 0) throw Error("process rank " + std::to_string(r) + ": " + all[r]);
  }
  return all;
}

void MpiProcessGroup::read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) {
  auto* out = static_cast<char*>(buf);
  while (n > 0) {
    const uint64_t piece = std::min<uint64_t>(n, kMaxMessage);
    Request q;
    q.file = file;
    q.offset = offset;
    q.n = piece;
    q.reply_tag = 1 + static_cast<int32_t>(next_tag_.fetch_add(1) % static_cast<uint32_t>(tag_limit_ - 1));
    MPI_Request sent;
    check(MPI_Isend(&q, sizeof q, MPI_BYTE, owner, kRequestTag, comms_->data, &sent), "MPI_Isend (read request)");
    wait(sent, "MPI_Isend (read request)");
    MPI_Message message;
    MPI_Status status;
    poll_until([&] {
      int flag = 0;
      check(MPI_Improbe(owner, q.reply_tag, comms_->data, &flag, &message, &status), "MPI_Improbe (read reply)");
      return flag != 0;
    });
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    if (static_cast<uint64_t>(count) != piece) {  // the owner's error instead of the bytes
      std::string text(static_cast<size_t>(count), '\0');
      MPI_Mrecv(text.data(), count, MPI_BYTE, &message, &status);
      throw Error("process rank " + std::to_string(owner) + ", which holds this source, could not read it: " + text);
    }
    check(MPI_Mrecv(out, count, MPI_BYTE, &message, &status), "MPI_Mrecv (read reply)");
    out += piece;
    offset += piece;
    n -= static_cast<size_t>(piece);
  }
}

void MpiProcessGroup::begin_serving(Serve serve) {
  serve_ = std::move(serve);
  done_peers_ = 0;
  for (unsigned i = 0; i < kServingThreads; ++i) servers_.emplace_back([this] { serve_requests(); });
}

void MpiProcessGroup::serve_requests() {
  std::vector<char> buffer;
  while (true) {
    Request q;
    MPI_Status status;
    MPI_Request received;
    check(MPI_Irecv(&q, sizeof q, MPI_BYTE, MPI_ANY_SOURCE, kRequestTag, comms_->data, &received), "MPI_Irecv (request)");
    wait(received, "MPI_Irecv (request)", &status);
    if (q.kind == Request::Stop) return;
    if (q.kind == Request::Done) {
      if (done_peers_.fetch_add(1) + 1 < size() - 1) continue;
      Request stop;  // every peer is done: end the other serving threads, then this one
      stop.kind = Request::Stop;
      for (unsigned i = 1; i < kServingThreads; ++i) MPI_Send(&stop, sizeof stop, MPI_BYTE, rank(), kRequestTag, comms_->data);
      return;
    }
    std::string failure;
    try {
      buffer.resize(q.n);
      serve_(q.file, q.offset, buffer.data(), q.n);
    } catch (const std::exception& e) {
      failure = e.what();
      if (failure.size() == q.n) failure += '.';  // a reply of n bytes means success
    }
    const std::string_view reply = failure.empty() ? std::string_view(buffer.data(), q.n) : std::string_view(failure);
    MPI_Request sent;
    check(MPI_Isend(reply.data(), static_cast<int>(reply.size()), MPI_BYTE, status.MPI_SOURCE, q.reply_tag, comms_->data, &sent),
          "MPI_Isend (reply)");
    wait(sent, "MPI_Isend (reply)");
    if (failure.empty()) served_ += q.n;
  }
}

void MpiProcessGroup::end_serving() {
  Request done;
  done.kind = Request::Done;
  for (int r = 0; r < size(); ++r)
    if (r != rank()) check(MPI_Send(&done, sizeof done, MPI_BYTE, r, kRequestTag, comms_->data), "MPI_Send (done)");
  for (std::thread& t : servers_) t.join();
  servers_.clear();
}

}  // namespace shardmerge::dist
