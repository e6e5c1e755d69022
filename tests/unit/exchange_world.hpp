// A multi-process merge's data plane, with each "process" a thread of this test: it serves the
// sources it owns (file % size == rank) and reads ranges of the others' from several threads,
// checking every byte against source_byte, which no part of the exchange computes. The same world
// runs over threads (ThreadLink, test_round_exchange.cpp) and over GPUs (NCCL, test_nccl_link.cpp).
#pragma once

#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "exec/dist/round_exchange.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::testing {

// The oracle: byte `offset` of source `file`, as its owner serves it.
inline char source_byte(uint32_t file, uint64_t offset) {
  uint64_t x = (static_cast<uint64_t>(file) << 40) ^ offset ^ 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return static_cast<char>(x ^ (x >> 31));
}

struct WorldOptions {
  int size = 3;
  unsigned threads = 3;          // readers per process
  unsigned reads = 30;           // per reader
  uint64_t max_read = 3u << 20;  // bytes, uniform in [1, max_read]
  uint64_t round_bytes = 1u << 20;
  uint32_t files = 7;
  std::vector<int> idle;         // ranks that read nothing (they end serving at once)
  uint32_t failing_file = UINT32_MAX;  // its owner throws for every read of it
  bool read_own = false;         // readers also ask their own process (a world of one)
};

struct WorldResult {
  std::vector<uint64_t> served, fetched;  // per rank: bytes it served, bytes its readers got
  std::vector<std::string> failures;      // the errors readers saw, in no order
  uint64_t wrong_bytes = 0;
};

// Makes process `rank`'s link; called on that process's own thread (an NCCL link's constructor is
// collective).
using LinkFactory = std::function<std::unique_ptr<dist::PeerLink>(int rank)>;

inline WorldResult run_world(const WorldOptions& o, const LinkFactory& make_link) {
  WorldResult result;
  result.served.assign(static_cast<size_t>(o.size), 0);
  result.fetched.assign(static_cast<size_t>(o.size), 0);
  std::mutex mutex;
  std::vector<std::thread> processes;
  for (int rank = 0; rank < o.size; ++rank) {
    processes.emplace_back([&, rank] {
      dist::RoundExchange plane(make_link(rank), o.round_bytes);
      plane.begin_serving([&](uint32_t file, uint64_t offset, void* buf, size_t n) {
        if (static_cast<int>(file % static_cast<uint32_t>(o.size)) != rank) throw Error("not mine");
        if (file == o.failing_file) throw Error("disk on fire").file("/ckpt/file" + std::to_string(file)).offset(offset);
        for (size_t i = 0; i < n; ++i) static_cast<char*>(buf)[i] = source_byte(file, offset + i);
      });
      const bool idle = std::find(o.idle.begin(), o.idle.end(), rank) != o.idle.end();
      std::vector<std::thread> readers;
      for (unsigned t = 0; t < (idle ? 0u : o.threads); ++t) {
        readers.emplace_back([&, t] {
          std::mt19937_64 rng(static_cast<uint64_t>(rank) * 1000 + t);
          std::vector<char> buf;
          for (unsigned i = 0; i < o.reads; ++i) {
            uint32_t file = static_cast<uint32_t>(rng() % o.files);
            const int owner = static_cast<int>(file % static_cast<uint32_t>(o.size));
            if (owner == rank && !o.read_own) continue;
            const uint64_t n = 1 + rng() % o.max_read;
            const uint64_t offset = rng() % (1ull << 32);
            buf.assign(n, 0);
            try {
              plane.read(owner, file, offset, buf.data(), n);
            } catch (const std::exception& e) {
              std::lock_guard<std::mutex> lock(mutex);
              result.failures.push_back(e.what());
              continue;
            }
            uint64_t wrong = 0;
            for (uint64_t k = 0; k < n; ++k) wrong += buf[k] != source_byte(file, offset + k);
            std::lock_guard<std::mutex> lock(mutex);
            result.wrong_bytes += wrong;
            result.fetched[static_cast<size_t>(rank)] += n;
          }
        });
      }
      for (auto& r : readers) r.join();
      plane.end_serving();
      std::lock_guard<std::mutex> lock(mutex);
      result.served[static_cast<size_t>(rank)] = plane.bytes_served();
    });
  }
  for (auto& p : processes) p.join();
  return result;
}

}  // namespace shardmerge::testing
