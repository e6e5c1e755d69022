#include "exec/dist/mpi_group.hpp"

#include "exec/dist/mpi_progress.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "shardmerge/error.hpp"

namespace shardmerge::dist {
namespace {

constexpr int kRequestTag = 0;  // a reply uses an odd tag, an error reply's text the even tag after it
// Threads answering requests. They only read (the page cache, or the disk) and hand the reply
// to MPI; the replies themselves are sent in the background, up to kReplyBytesInFlight.
constexpr unsigned kServingThreads = 4;
constexpr uint64_t kReplyBytesInFlight = 48ull << 20;
// Reads a process keeps in flight where the data plane carries them (an executor task reads at
// most 2 MiB): on the netns harness, 2 nodes at 10 Gbit/s, a 0.5B fp32 merge took 3.0 s with 8,
// 2.3 s with 32 and 64 at 5 ms of round trip; 5.9, 2.95 and 2.94 s at 20 ms.
constexpr unsigned kReadsInFlight = 32;
// Replies up to this size are sent eagerly (no rendezvous round trip before the data moves):
// Open MPI's TCP transport defaults to 64 KiB. Set unless the user set it; the executor's reads
// are at most 2 MiB (plus a header).
constexpr const char* kTcpEagerLimit = "2228224";
constexpr size_t kMaxErrorText = 4096;

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

// A liveness message: a ping, its answer, or the end of this process's pinger.
struct Beat {
  enum Kind : uint32_t { Ping, Pong, Stop };
  uint32_t kind = Ping;
};
const Beat kPing{Beat::Ping}, kPong{Beat::Pong}, kStopBeat{Beat::Stop};
const Request kDone{Request::Done}, kStopServing{Request::Stop};

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string("MPI: ") + what + " failed: " + std::string(text, static_cast<size_t>(len)));
}

// One message carries at most INT_MAX bytes; reads are split well below that.
constexpr uint64_t kMaxMessage = 1ull << 30;

// Set when a peer stopped answering: MPI_Finalize would wait for it forever, so the process
// ends the job with MPI_Abort at exit instead (the launcher then ends the others).
std::atomic<bool> g_abort_at_exit{false};

// MPI can be initialised once per process, and never again after MPI_Finalize: a Python process
// may merge several times, and may have initialised MPI itself (mpi4py). So the first group
// initialises it unless someone did, and it is finalised (or aborted) at exit, by whoever
// initialised it. MPI_Init waits for every process of the job: one that is stopped before it
// gets there would hold this one for ever, with nothing to clean up yet, so a watchdog ends the
// process after the peer timeout (the launcher then ends the job).
void initialise_mpi_once(double peer_timeout_s) {
  int finalized = 0, initialized = 0, provided = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw Error("MPI was already finalized in this process: a multi-process merge cannot start again");
  MPI_Initialized(&initialized);
  if (!initialized) {
    ::setenv("OMPI_MCA_btl_tcp_eager_limit", kTcpEagerLimit, /*overwrite=*/0);
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::thread watchdog([&] {
      std::unique_lock<std::mutex> lock(mutex);
      if (cv.wait_for(lock, std::chrono::duration<double>(peer_timeout_s), [&] { return done; })) return;
      std::fprintf(stderr, "shardmerge: MPI_Init did not finish in %.0f s (--peer-timeout): a process of this job is "
                   "stopped or cannot be reached\n", peer_timeout_s);
      std::_Exit(1);
    });
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
    }
    cv.notify_all();
    watchdog.join();
    check(rc, "MPI_Init_thread");
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (done) return;
      if (g_abort_at_exit) MPI_Abort(MPI_COMM_WORLD, 1);
      MPI_Finalize();
    });
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw Error("the MPI library runs without MPI_THREAD_MULTIPLE" +
                std::string(initialized ? " (it was initialised before shardmerge: ask for MPI_THREAD_MULTIPLE there)" : "") +
                ", which the data plane needs");
}

std::string processor_name() {
  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(name, &len);
  return std::string(name, static_cast<size_t>(len));
}

}  // namespace

struct MpiProcessGroup::Communicators {
  MPI_Comm control = MPI_COMM_NULL;
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm alive = MPI_COMM_NULL;
};

MpiProcessGroup::MpiProcessGroup(const LaunchInfo& info)
    : ProcessGroup(info),
      comms_(std::make_unique<Communicators>()),
      peer_timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(info.peer_timeout_s))),
      ping_interval_(std::min<Clock::duration>(peer_timeout_ / 4, std::chrono::seconds(5))) {
  initialise_mpi_once(info.peer_timeout_s);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != info.rank || size != info.world_size)
    throw Error("MPI says rank " + std::to_string(rank) + " of " + std::to_string(size) + ", the launcher's variables rank " +
                std::to_string(info.rank) + " of " + std::to_string(info.world_size));
  MPI_Comm_dup(MPI_COMM_WORLD, &comms_->control);
  MPI_Comm_dup(MPI_COMM_WORLD, &comms_->data);
  MPI_Comm_dup(MPI_COMM_WORLD, &comms_->alive);
  void* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub) tag_limit_ = *static_cast<int*>(ub);
  peer_state_.assign(static_cast<size_t>(size), PeerState{Clock::now(), {}, false});
  peer_done_.assign(static_cast<size_t>(size), false);
  progress_ = std::make_unique<MpiProgress>();
  pinger_ = std::thread([this] { answer_pings(); });
  try {
    hosts_ = all_gather(processor_name());
  } catch (...) {  // a peer silent already: no destructor will stop the threads
    stop_threads();
    throw;
  }
}

MpiProcessGroup::~MpiProcessGroup() {
  const bool broken = g_abort_at_exit;
  if (!servers_.empty() && !broken) {
    try {
      end_serving();
    } catch (...) {  // the job is failing already
    }
  }
  stop_threads();
  if (broken) return;  // freeing a communicator may talk to the peers
  MPI_Comm_free(&comms_->alive);
  MPI_Comm_free(&comms_->data);
  MPI_Comm_free(&comms_->control);
}

// Only messages to itself: a peer may be gone.
void MpiProcessGroup::stop_threads() {
  {
    std::lock_guard<std::mutex> lock(serving_mutex_);
    stopping_ = true;
  }
  serving_cv_.notify_all();
  for (size_t i = 0; i < servers_.size(); ++i)
    MPI_Send(&kStopServing, sizeof kStopServing, MPI_BYTE, rank(), kRequestTag, comms_->data);
  for (std::thread& t : servers_) t.join();
  servers_.clear();
  MPI_Send(&kStopBeat, sizeof kStopBeat, MPI_BYTE, rank(), 0, comms_->alive);
  pinger_.join();
  progress_.reset();
}

bool MpiProcessGroup::peer_lost() const { return g_abort_at_exit; }

std::vector<int> MpiProcessGroup::peers() const {
  std::vector<int> all;
  for (int r = 0; r < size(); ++r)
    if (r != rank()) all.push_back(r);
  return all;
}

std::string MpiProcessGroup::who(int r) const {
  std::string s = "process rank " + std::to_string(r);
  if (static_cast<size_t>(r) < hosts_.size()) s += " on host " + hosts_[static_cast<size_t>(r)];
  return s;
}

void MpiProcessGroup::check_alive(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  const Clock::time_point now = Clock::now();
  for (int r : ranks) {
    PeerState& s = peer_state_[static_cast<size_t>(r)];
    if (s.ping_out) {
      if (now - s.ping_sent < peer_timeout_) continue;
      g_abort_at_exit = true;
      const auto silent = std::chrono::duration_cast<std::chrono::seconds>(now - s.heard).count();
      throw Error(who(r) + " has not answered for " + std::to_string(silent) +
                  " s (--peer-timeout): it is stopped or its network is down; the job is ended");
    }
    if (now - s.heard < ping_interval_) continue;
    s.ping_out = true;
    s.ping_sent = now;
    MPI_Request sent;
    check(MPI_Isend(&kPing, sizeof kPing, MPI_BYTE, r, 0, comms_->alive, &sent), "MPI_Isend (ping)");
    progress_->detach(sent);
  }
}

void MpiProcessGroup::answer_pings() {
  while (true) {
    Beat beat;
    MPI_Request received;
    check(MPI_Irecv(&beat, sizeof beat, MPI_BYTE, MPI_ANY_SOURCE, 0, comms_->alive, &received), "MPI_Irecv (ping)");
    const MPI_Status status = progress_->wait(received, MpiProgress::Kind::Receive);
    if (beat.kind == Beat::Stop) return;
    if (beat.kind == Beat::Ping) {
      MPI_Request sent;
      check(MPI_Isend(&kPong, sizeof kPong, MPI_BYTE, status.MPI_SOURCE, 0, comms_->alive, &sent), "MPI_Isend (pong)");
      progress_->detach(sent);
    } else {
      std::lock_guard<std::mutex> lock(peers_mutex_);
      PeerState& s = peer_state_.at(static_cast<size_t>(status.MPI_SOURCE));
      s.heard = Clock::now();
      s.ping_out = false;
    }
  }
}

std::vector<std::string> MpiProcessGroup::all_gather(const std::string& mine, bool ok) {
  if (mine.size() > static_cast<size_t>(INT_MAX) / static_cast<size_t>(size()))
    throw Error("multi-process merge: a control message of " + std::to_string(mine.size()) + " bytes is too large");
  const std::vector<int> others = peers();
  const auto alive = [&] { check_alive(others); };
  // The length carries the status: -(length + 1) for a process that failed.
  const int64_t mine_len = ok ? static_cast<int64_t>(mine.size()) : -static_cast<int64_t>(mine.size()) - 1;
  std::vector<int64_t> lens(static_cast<size_t>(size()));
  MPI_Request gathered;
  check(MPI_Iallgather(&mine_len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, comms_->control, &gathered),
        "MPI_Iallgather");
  progress_->wait(gathered, MpiProgress::Kind::Collective, alive);
  std::vector<int> counts(lens.size()), displs(lens.size());
  int total = 0;
  for (size_t r = 0; r < lens.size(); ++r) {
    counts[r] = static_cast<int>(lens[r] >= 0 ? lens[r] : -lens[r] - 1);
    displs[r] = total;
    total += counts[r];
  }
  std::string packed(static_cast<size_t>(total), '\0');
  check(MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, packed.data(), counts.data(),
                        displs.data(), MPI_BYTE, comms_->control, &gathered),
        "MPI_Iallgatherv");
  progress_->wait(gathered, MpiProgress::Kind::Collective, alive);
  std::vector<std::string> all(lens.size());
  for (size_t r = 0; r < lens.size(); ++r) {
    all[r] = packed.substr(static_cast<size_t>(displs[r]), static_cast<size_t>(counts[r]));
    if (lens[r] < 0) throw Error("process rank " + std::to_string(r) + ": " + all[r]);
  }
  return all;
}

unsigned MpiProcessGroup::reads_in_flight() const { return kReadsInFlight; }

void MpiProcessGroup::read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) {
  auto* out = static_cast<char*>(buf);
  const auto alive = [&] { check_alive({owner}); };
  while (n > 0) {
    const uint64_t piece = std::min<uint64_t>(n, kMaxMessage);
    Request q;
    q.file = file;
    q.offset = offset;
    q.n = piece;
    q.reply_tag = 1 + 2 * static_cast<int32_t>(next_tag_.fetch_add(1) % static_cast<uint32_t>((tag_limit_ - 1) / 2));
    // The reply's receive is posted before the request leaves: it lands in `out` directly.
    MPI_Request reply, sent;
    check(MPI_Irecv(out, static_cast<int>(piece), MPI_BYTE, owner, q.reply_tag, comms_->data, &reply),
          "MPI_Irecv (read reply)");
    check(MPI_Isend(&q, sizeof q, MPI_BYTE, owner, kRequestTag, comms_->data, &sent), "MPI_Isend (read request)");
    progress_->wait(sent, MpiProgress::Kind::Send, alive);
    MPI_Status status = progress_->wait(reply, MpiProgress::Kind::Receive, alive);
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    if (static_cast<uint64_t>(count) != piece) {  // an empty reply: the owner's error follows
      std::string text(kMaxErrorText, '\0');
      MPI_Request error;
      check(MPI_Irecv(text.data(), static_cast<int>(text.size()), MPI_BYTE, owner, q.reply_tag + 1, comms_->data, &error),
            "MPI_Irecv (read error)");
      status = progress_->wait(error, MpiProgress::Kind::Receive, alive);
      MPI_Get_count(&status, MPI_BYTE, &count);
      text.resize(static_cast<size_t>(count));
      throw Error(who(owner) + ", which holds this source, could not read it: " + text);
    }
    out += piece;
    offset += piece;
    n -= static_cast<size_t>(piece);
  }
}

void MpiProcessGroup::begin_serving(Serve serve) {
  serve_ = std::move(serve);
  std::fill(peer_done_.begin(), peer_done_.end(), false);
  stopping_ = false;
  for (unsigned i = 0; i < kServingThreads; ++i) servers_.emplace_back([this] { serve_requests(); });
}

void MpiProcessGroup::serve_requests() {
  while (true) {
    Request q;
    MPI_Request received;
    if (MPI_Irecv(&q, sizeof q, MPI_BYTE, MPI_ANY_SOURCE, kRequestTag, comms_->data, &received) != MPI_SUCCESS) return;
    const MPI_Status status = progress_->wait(received, MpiProgress::Kind::Receive);
    const int from = status.MPI_SOURCE;
    if (q.kind == Request::Stop) return;
    std::unique_lock<std::mutex> lock(serving_mutex_);
    if (q.kind == Request::Done) {
      peer_done_.at(static_cast<size_t>(from)) = true;
      serving_cv_.notify_all();
      continue;
    }
    // Bounded memory: wait while earlier replies are still on their way (one always may go).
    serving_cv_.wait(lock, [&] { return stopping_ || reply_bytes_in_flight_ == 0 || reply_bytes_in_flight_ + q.n <= kReplyBytesInFlight; });
    if (stopping_) return;
    reply_bytes_in_flight_ += q.n;
    // The reply lives until MPI has sent it; then its bytes leave the budget and its buffer is
    // kept for a later reply.
    struct Reply {
      std::vector<char> bytes;
      std::string failure;
    };
    auto reply = std::make_shared<Reply>();
    if (!spare_buffers_.empty()) {
      reply->bytes = std::move(spare_buffers_.back());
      spare_buffers_.pop_back();
    }
    lock.unlock();
    try {
      reply->bytes.resize(q.n);
      serve_(q.file, q.offset, reply->bytes.data(), q.n);
    } catch (const std::exception& e) {
      reply->failure = std::string(e.what()).substr(0, kMaxErrorText);
    }
    auto finished = [this, n = q.n, reply] {
      std::lock_guard<std::mutex> done(serving_mutex_);
      reply_bytes_in_flight_ -= n;
      if (reply->failure.empty()) served_ += n;
      if (spare_buffers_.size() < kServingThreads * 2) spare_buffers_.push_back(std::move(reply->bytes));
      serving_cv_.notify_all();
    };
    MPI_Request sent;
    if (reply->failure.empty()) {
      check(MPI_Isend(reply->bytes.data(), static_cast<int>(q.n), MPI_BYTE, from, q.reply_tag, comms_->data, &sent),
            "MPI_Isend (reply)");
      progress_->detach(sent, std::move(finished));
    } else {  // an empty reply, then the text
      check(MPI_Isend(nullptr, 0, MPI_BYTE, from, q.reply_tag, comms_->data, &sent), "MPI_Isend (error reply)");
      progress_->detach(sent);
      check(MPI_Isend(reply->failure.data(), static_cast<int>(reply->failure.size()), MPI_BYTE, from, q.reply_tag + 1,
                      comms_->data, &sent),
            "MPI_Isend (error text)");
      progress_->detach(sent, std::move(finished));
    }
  }
}

void MpiProcessGroup::end_serving() {
  const std::vector<int> others = peers();
  for (int r : others) {
    MPI_Request sent;
    check(MPI_Isend(&kDone, sizeof kDone, MPI_BYTE, r, kRequestTag, comms_->data, &sent), "MPI_Isend (done)");
    progress_->detach(sent);
  }
  // Serves until every peer has read all it needs, pinging those still reading.
  std::unique_lock<std::mutex> lock(serving_mutex_);
  while (!serving_cv_.wait_for(lock, std::chrono::seconds(1), [&] {
    return std::count(peer_done_.begin(), peer_done_.end(), true) == static_cast<long>(others.size());
  })) {
    std::vector<int> reading;
    for (int r : others)
      if (!peer_done_[static_cast<size_t>(r)]) reading.push_back(r);
    lock.unlock();
    check_alive(reading);
    lock.lock();
  }
  stopping_ = true;
  lock.unlock();
  serving_cv_.notify_all();
  for (size_t i = 0; i < servers_.size(); ++i)
    check(MPI_Send(&kStopServing, sizeof kStopServing, MPI_BYTE, rank(), kRequestTag, comms_->data), "MPI_Send (stop)");
  for (std::thread& t : servers_) t.join();
  servers_.clear();
  // The replies still on their way have been received: every peer said it is done reading.
}

}  // namespace shardmerge::dist
