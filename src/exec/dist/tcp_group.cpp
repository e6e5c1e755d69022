#include "exec/dist/tcp_group.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "shardmerge/error.hpp"
#include "util/bytes.hpp"

namespace shardmerge::dist {
namespace {

Error net_error(const std::string& what) { return Error("multi-process bootstrap: " + what + ": " + std::strerror(errno)); }

void send_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw net_error("a peer process went away (send)");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) throw Error("multi-process bootstrap: a peer process exited before finishing");
    if (k < 0) throw net_error("receive failed");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

// Frame: status byte (1 ok, 0 failed), u64 length, payload.
void send_frame(int fd, bool ok, const std::string& payload) {
  std::string head(1, ok ? '\1' : '\0');
  append_le<uint64_t>(head, payload.size());
  send_all(fd, head.data(), head.size());
  send_all(fd, payload.data(), payload.size());
}

std::pair<bool, std::string> recv_frame(int fd) {
  char head[9];
  recv_all(fd, head, sizeof head);
  const auto n = load_le<uint64_t>(head + 1);
  if (n > (1ull << 32)) throw Error("multi-process bootstrap: implausible message of " + std::to_string(n) + " bytes");
  std::string payload(n, '\0');
  recv_all(fd, payload.data(), n);
  return {head[0] == 1, std::move(payload)};
}

sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res); rc != 0 || !res)
    throw Error("multi-process bootstrap: cannot resolve MASTER_ADDR '" + host + "': " + gai_strerror(rc));
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

void no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

TcpProcessGroup::TcpProcessGroup(const LaunchInfo& info, int timeout_s) : ProcessGroup(info) {
  const sockaddr_in addr = resolve(info.address, info.port);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  if (info.rank == 0) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in any = addr;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&any), sizeof any) != 0)
      throw net_error("rank 0 cannot listen on port " + std::to_string(info.port) + " (set SHARDMERGE_PORT)");
    ::listen(listen_fd_, info.world_size);
    peers_.assign(static_cast<size_t>(info.world_size - 1), -1);
    for (int accepted = 0; accepted < info.world_size - 1; ++accepted) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) throw net_error("accept failed");
      no_delay(fd);
      int32_t peer_rank = -1;
      recv_all(fd, &peer_rank, sizeof peer_rank);
      if (peer_rank < 1 || peer_rank >= info.world_size || peers_[static_cast<size_t>(peer_rank - 1)] != -1)
        throw Error("multi-process bootstrap: unexpected hello from rank " + std::to_string(peer_rank));
      peers_[static_cast<size_t>(peer_rank - 1)] = fd;
    }
  } else {
    int fd = -1;
    while (true) {
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) break;
      ::close(fd);
      if (std::chrono::steady_clock::now() > deadline)
        throw net_error("rank " + std::to_string(info.rank) + " cannot reach rank 0 at " + info.address + ":" +
                        std::to_string(info.port));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    no_delay(fd);
    const int32_t me = info.rank;
    send_all(fd, &me, sizeof me);
    peers_.push_back(fd);
  }
}

TcpProcessGroup::~TcpProcessGroup() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

std::vector<std::string> TcpProcessGroup::all_gather(const std::string& mine, bool ok) {
  // Star through rank 0: everyone sends to the root, the root sends the lot back.
  std::vector<std::string> all(static_cast<size_t>(size()));
  std::string failure;
  if (rank() == 0) {
    all[0] = mine;
    if (!ok) failure = "rank 0: " + mine;
    for (int r = 1; r < size(); ++r) {
      auto [peer_ok, payload] = recv_frame(peers_[static_cast<size_t>(r - 1)]);
      if (!peer_ok && failure.empty()) failure = "rank " + std::to_string(r) + ": " + payload;
      all[static_cast<size_t>(r)] = std::move(payload);
    }
    std::string packed;
    for (const auto& s : all) {
      append_le<uint64_t>(packed, s.size());
      packed += s;
    }
    for (int fd : peers_) send_frame(fd, failure.empty(), failure.empty() ? packed : failure);
  } else {
    send_frame(peers_[0], ok, mine);
    auto [all_ok, payload] = recv_frame(peers_[0]);
    if (!all_ok) {
      failure = std::move(payload);
    } else {
      size_t pos = 0;
      for (auto& s : all) {
        const auto n = load_le<uint64_t>(payload.data() + pos);
        s = payload.substr(pos + 8, n);
        pos += 8 + n;
      }
    }
  }
  if (!failure.empty()) throw Error("process " + failure);
  return all;
}

}  // namespace shardmerge::dist
