// shardmerge-cpu-rates: what one CPU core does per second on each step a merge puts its bytes
// through, in the executor's 2 MiB pieces: memcpy (the ceiling), the CRC-32 of every source
// record, the fp32 -> bf16 cast (with and without the finite check a fold's result gets), a
// same-dtype bf16 copy, and the LoRA fold's sgemm W += B·A on a 2 MiB fp32 slab of W. Run with
// --threads N, every thread does the same on its own buffers at once (aggregate rate).
// These figures size a merge on paper: cores needed = storage GB/s / per-core GB/s of the
// steps its bytes take (docs/benchmarks.md).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "exec/blas.hpp"
#include "exec/convert_cpu.hpp"
#include "util/crc32.hpp"

using namespace shardmerge;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kPiece = 2u << 20;  // the CPU executor's task size

struct Buffers {
  std::vector<float> f32;     // the source stream, fp32
  std::vector<uint16_t> b16;  // a bf16 source stream of the same element count
  std::vector<uint16_t> out;  // destination
};

Buffers make_buffers(size_t bytes, unsigned seed) {
  Buffers b;
  const size_t n = bytes / sizeof(float);
  b.f32.resize(n);
  b.b16.resize(n);
  b.out.resize(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < n; ++i) b.f32[i] = normal(rng);
  for (size_t i = 0; i < n; ++i) b.b16[i] = static_cast<uint16_t>(rng());
  return b;
}

// Seconds for `threads` threads each running work(buffers of its own) once, started together.
double timed(std::vector<Buffers>& per_thread, const std::function<void(Buffers&)>& work) {
  std::vector<std::thread> pool;
  const auto start = Clock::now();
  for (auto& b : per_thread) pool.emplace_back([&work, &b] { work(b); });
  for (auto& t : pool) t.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-core rates of the steps a merge's bytes go through (2 MiB pieces)"};
  unsigned threads = 1;
  size_t mib = 256;
  int rounds = 5;
  int rank = 64;
  app.add_option("--threads", threads, "Threads doing the same work at once (aggregate rate)")->check(CLI::Range(1u, 1024u));
  app.add_option("--mib", mib, "Source bytes per thread, MiB (larger than the caches: the bytes stream as in a merge)")
      ->check(CLI::Range(size_t{4}, size_t{1} << 16));
  app.add_option("--rounds", rounds, "Repetitions; the median is shown")->check(CLI::Range(1, 1000));
  app.add_option("--lora-rank", rank, "r of the fold's B (rows x r) and A (r x cols)")->check(CLI::Range(1, 4096));
  CLI11_PARSE(app, argc, argv);

  std::vector<Buffers> bufs;
  for (unsigned t = 0; t < threads; ++t) bufs.push_back(make_buffers(mib << 20, 1234 + t));
  const size_t fp32_bytes = bufs[0].f32.size() * sizeof(float);
  const size_t pieces = fp32_bytes / kPiece;

  // The fold's slab: 2 MiB of fp32 W, rows x cols with cols = 4096 (a 7B layer is 3584 or 18944 wide).
  const int cols = 4096, rows = static_cast<int>(kPiece / sizeof(float) / cols);
  const SgemmFn sgemm = blas_sgemm();
  std::vector<std::vector<float>> lora_b(threads, std::vector<float>(size_t(rows) * rank, 0.01f));
  std::vector<std::vector<float>> lora_a(threads, std::vector<float>(size_t(rank) * cols, 0.02f));

  struct Step {
    const char* name;
    double bytes;  // per thread, per round: what the rate is counted on
    double flops;  // per thread, per round; 0 where not meaningful
    std::function<void(Buffers&)> work;
  };
  volatile uint32_t sink = 0;
  std::vector<Step> steps = {
      {"memcpy (ceiling)", double(fp32_bytes) / 2, 0,
       [&](Buffers& b) {
         for (size_t p = 0; p < pieces / 2; ++p)
           std::memcpy(reinterpret_cast<char*>(b.out.data()) + p * kPiece, reinterpret_cast<const char*>(b.b16.data()) + p * kPiece, kPiece);
       }},
      {"CRC-32", double(fp32_bytes), 0,
       [&](Buffers& b) {
         uint32_t crc = 0;
         for (size_t p = 0; p < pieces; ++p)
           crc = crc32_update(crc, reinterpret_cast<const char*>(b.f32.data()) + p * kPiece, kPiece);
         sink = sink + crc;
       }},
      {"cast fp32 -> bf16", double(fp32_bytes), 0,
       [&](Buffers& b) {
         const size_t n = kPiece / sizeof(float);
         for (size_t p = 0; p < pieces; ++p)
           convert_elements(b.f32.data() + p * n, DType::F32, 1, b.out.data() + p * n, DType::BF16, n);
       }},
      {"cast fp32 -> bf16, finite", double(fp32_bytes), 0,
       [&](Buffers& b) {
         const size_t n = kPiece / sizeof(float);
         size_t bad = 0;
         for (size_t p = 0; p < pieces; ++p) bad += convert_finite_f32(b.f32.data() + p * n, b.out.data() + p * n, DType::BF16, n) != n;
         sink = sink + static_cast<uint32_t>(bad);
       }},
      {"copy bf16 -> bf16", double(fp32_bytes) / 2, 0,
       [&](Buffers& b) {
         const size_t n = kPiece / sizeof(uint16_t);
         for (size_t p = 0; p < pieces / 2; ++p)
           convert_elements(b.b16.data() + p * n, DType::BF16, 1, b.out.data() + p * n, DType::BF16, n);
       }},
  };
  // W += B·A, one 2 MiB slab at a time over the fp32 stream (the fold's inner step).
  steps.push_back({"fold sgemm W += B*A", double(fp32_bytes), 2.0 * rows * cols * rank * double(pieces), [&](Buffers& b) {
                     const size_t t = static_cast<size_t>(&b - bufs.data());
                     for (size_t p = 0; p < pieces; ++p)
                       sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, cols, rank, 1.0f, lora_b[t].data(), rank,
                             lora_a[t].data(), cols, 1.0f, b.f32.data() + p * (kPiece / sizeof(float)), cols);
                   }});

  std::printf("# shardmerge-cpu-rates: %u thread(s), %zu MiB of fp32 per thread in 2 MiB pieces, median of %d; "
              "fold slab %d x %d, r = %d\n",
              threads, mib, rounds, rows, cols, rank);
  std::printf("#%-28s %12s %14s %12s\n", "step", "GB/s total", "GB/s per core", "GFLOP/s");
  for (auto& s : steps) {
    s.work(bufs[0]);  // first touch, and OpenBLAS's setup, outside the timing
    std::vector<double> secs;
    for (int r = 0; r < rounds; ++r) secs.push_back(timed(bufs, s.work));
    const double t = median(secs);
    const double total = s.bytes * threads / t / 1e9;
    char flops[32] = "-";
    if (s.flops > 0) std::snprintf(flops, sizeof flops, "%.1f", s.flops * threads / t / 1e9);
    std::printf(" %-28s %12.2f %14.2f %12s\n", s.name, total, total / threads, flops);
  }
  return 0;
}
