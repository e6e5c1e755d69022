// The zip CRC-32 check of every record a merge reads (src/exec/record_checker.*, wired into the
// executors through SourceFds::read), and the refusal of sources that change between planning
// and the end of the run. The oracle is a bitwise CRC-32 written here, not the library under test.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <mutex>
#include <thread>

#include "exec/record_checker.hpp"
#include "exec/sources.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

// CRC-32 (IEEE, reflected), one bit at a time: slow, obviously right.
uint32_t reference_crc(const std::string& bytes) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

// A source file of `content`, with records at the given [offset, offset + size) ranges whose
// CRC-32 the oracle computes from `content`.
struct Source {
  TempDir dir;
  std::string path = dir / "rank0.pt";
  std::string content;
  std::vector<RecordCheck> records;
  File file;
  SourceFds fds;

  Source(std::string bytes, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) : content(std::move(bytes)) {
    for (size_t i = 0; i < ranges.size(); ++i) {
      const auto [offset, size] = ranges[i];
      records.push_back({0, offset, size, reference_crc(content.substr(offset, size)), "archive/data/" + std::to_string(i),
                         "layers." + std::to_string(i) + ".weight"});
    }
    write(content);
    file = File::open_read(path);
    fds.fds = {file.fd()};
    fds.names = {path};
  }
  void write(const std::string& bytes) const {
    File f = File::create(path, /*overwrite=*/true);
    f.write_exact(0, bytes.data(), bytes.size());
  }
  RecordChecker checker() const { return RecordChecker(records, {path}); }
  // Reports [offset, offset + n) as read, from `bytes` (the file's content unless given).
  void consume(RecordChecker& c, uint64_t offset, uint64_t n, const std::string* bytes = nullptr) const {
    c.consume(0, offset, (bytes ? *bytes : content).data() + offset, n);
  }
};

// The Error `f` throws; fails the test when it throws none.
template <typename F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no Error thrown";
  return Error("");
}

TEST(RecordChecker, PiecesInAnyOrderAddUpToTheRecord) {
  const Source src(random_bytes(4096, 1), {{64, 3000}});
  for (uint32_t seed : {1u, 2u, 3u}) {
    RecordChecker c = src.checker();
    // Cut [0, 4096) into random pieces, reported in random order; bytes outside the record too.
    std::mt19937 rng(seed);
    std::vector<std::pair<uint64_t, uint64_t>> pieces;
    for (uint64_t at = 0; at < 4096;) {
      const uint64_t n = std::min<uint64_t>(4096 - at, 1 + rng() % 500);
      pieces.emplace_back(at, n);
      at += n;
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    for (const auto& [at, n] : pieces) src.consume(c, at, n);
    EXPECT_EQ(c.records_checked(), 1u) << "checked as soon as its last byte is in, before finish()";
    c.finish(src.fds);
    EXPECT_EQ(c.records_checked(), 1u);
  }
}

TEST(RecordChecker, AMismatchNamesFileRecordTensorAndOffset) {
  Source src(random_bytes(1024, 2), {{0, 100}, {128, 512}});
  std::string read = src.content;
  read[300] ^= 0x01;  // what a task saw differs from what the zip directory's CRC covers
  RecordChecker c = src.checker();
  src.consume(c, 0, 100);
  const Error e = error_of([&] { src.consume(c, 0, 1024, &read); });
  EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch: record archive/data/1"), std::string::npos) << e.what();
  EXPECT_EQ(e.file(), src.path);
  EXPECT_EQ(e.tensor(), "layers.1.weight");
  EXPECT_NE(std::string(e.what()).find("at byte 128"), std::string::npos) << e.what();
  EXPECT_EQ(c.records_checked(), 2u);
}

TEST(RecordChecker, FinishReadsTheGapsNoTaskRead) {
  // A padded storage: tasks read the first 200 bytes of a 512-byte record, and a middle piece.
  Source src(random_bytes(1024, 3), {{256, 512}});
  {
    RecordChecker c = src.checker();
    src.consume(c, 256, 200);
    src.consume(c, 600, 50);
    EXPECT_EQ(c.records_checked(), 0u);
    c.finish(src.fds);
    EXPECT_EQ(c.records_checked(), 1u);
  }
  // The same, with a byte flipped on disk in the part no task read (the padding).
  std::string corrupt = src.content;
  corrupt[256 + 500] ^= 0x40;
  src.write(corrupt);
  RecordChecker c = src.checker();
  src.consume(c, 256, 200);
  const Error e = error_of([&] { c.finish(src.fds); });
  EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch: record archive/data/0"), std::string::npos) << e.what();
  EXPECT_EQ(e.tensor(), "layers.0.weight");
}

TEST(RecordChecker, RecordsNoTaskReadAreNotChecked) {
  Source src(random_bytes(512, 4), {{0, 100}, {200, 100}});
  src.records[1].crc32 ^= 1;  // wrong, but never read
  RecordChecker c = src.checker();
  src.consume(c, 0, 100);
  src.consume(c, 150, 40);  // between the records
  c.finish(src.fds);
  EXPECT_EQ(c.records_checked(), 1u);
}

TEST(RecordChecker, OverlappingReadsCountEachByteOnce) {
  const Source src(random_bytes(2048, 5), {{100, 1500}});
  RecordChecker c = src.checker();
  // Strided gathers read spans that overlap other tasks' spans, and re-read bytes.
  src.consume(c, 0, 700);
  src.consume(c, 500, 300);
  src.consume(c, 650, 50);
  src.consume(c, 900, 400);
  src.consume(c, 0, 1000);
  src.consume(c, 1200, 848);
  EXPECT_EQ(c.records_checked(), 1u);
  // Reads after the check are not looked at again.
  std::string other = random_bytes(2048, 6);
  src.consume(c, 0, 2048, &other);
  c.finish(src.fds);
}

TEST(RecordChecker, ManyThreadsReadingOneRecord) {
  const Source src(random_bytes(1 << 20, 7), {{0, 1 << 20}, {10, 0}});
  for (int round = 0; round < 4; ++round) {
    RecordChecker c = src.checker();
    std::atomic<uint64_t> next{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        // Overlapping 4 KiB windows every 3 KiB, taken in whatever order the threads run.
        for (uint64_t at; (at = next.fetch_add(3072)) < (1u << 20);)
          src.consume(c, at, std::min<uint64_t>(4096, (1u << 20) - at));
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(c.records_checked(), 1u);
  }
}

TEST(RecordChecker, RefusesOverlappingRecords) {
  const Source src(random_bytes(512, 8), {{0, 100}, {50, 100}});
  const Error e = error_of([&] { src.checker(); });
  EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();
}

// ---- through the CPU executor ----------------------------------------------------------------

// Discards the output; `on_write` runs before the first write (to change a source mid-run).
class NullSink : public OutputSink {
 public:
  std::function<void()> on_write;
  void write(uint32_t, uint64_t, const void*, size_t) const override {
    std::call_once(once_, [&] {
      if (on_write) on_write();
    });
  }
  bool copy_from(int, uint64_t, uint32_t, uint64_t, uint64_t) const override { return true; }

 private:
  mutable std::once_flag once_;
};

// A rank file: 64 bytes of header, then one record of 64 floats (256 bytes) of which the
// tensor reads the first 48 (the rest is padding, as in FSDP2's short ranks), then a tail.
struct RankFile {
  TempDir dir;
  std::string path = dir / "model_world_size_1_rank_0.pt";
  std::string bytes = random_bytes(64 + 256 + 64, 9);

  RankFile() { rewrite(bytes); }
  void rewrite(const std::string& b) const {
    File f = File::create(path, /*overwrite=*/true);
    f.write_exact(0, b.data(), b.size());
  }
  MergePlan plan(DType out) const {
    const FileStamp stamp = file_stamp(File::open_read(path));
    OutputTensor t{"w", out, {48}, 0, 0, 0, {}, std::nullopt, ""};
    t.copies = {Slice{0, 64, DType::F32, {1}, {0}, {48}}};
    MergePlan p = test::one_file_plan({t}, {SourceFile{path, stamp.size, stamp}});
    p.records = {{0, 64, 256, reference_crc(bytes.substr(64, 256)), "archive/data/0", "model.w"}};
    return p;
  }
};

ExecStats run(const MergePlan& p, bool check_crc, const NullSink& sink = NullSink()) {
  ExecOptions opt;
  opt.check_crc = check_crc;
  opt.threads = 2;
  return make_cpu_executor()->run(p, sink, opt);
}

TEST(RecordCheckerExecutor, EveryRecordReadIsChecked) {
  const RankFile rank;
  for (DType out : {DType::F32, DType::BF16}) {  // a plain copy (no copy_file_range) and a cast
    const MergePlan p = rank.plan(out);
    EXPECT_EQ(run(p, true).records_checked, 1u);
    EXPECT_EQ(run(p, false).records_checked, 0u);
  }
}

TEST(RecordCheckerExecutor, AFlippedByteInTheDataOrThePaddingFailsTheRun) {
  for (size_t at : {64 + 10, 64 + 48 * 4 + 7}) {  // in what the tensor reads, in the padding
    SCOPED_TRACE(at);
    const RankFile rank;
    for (DType out : {DType::F32, DType::BF16}) {
      const MergePlan p = rank.plan(out);
      std::string corrupt = rank.bytes;
      corrupt[at] ^= 0x10;
      rank.rewrite(corrupt);
      MergePlan stale = rank.plan(out);
      stale.records = p.records;  // the CRC the zip directory holds is the uncorrupted data's
      const Error e = error_of([&] { run(stale, true); });
      EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch: record archive/data/0"), std::string::npos) << e.what();
      EXPECT_EQ(e.file(), rank.path);
      EXPECT_EQ(e.tensor(), "model.w");
      EXPECT_NO_THROW(run(stale, false)) << "--no-crc reads what is there";
      rank.rewrite(rank.bytes);
    }
  }
}

TEST(RecordCheckerExecutor, ASourceChangedSincePlanningIsRefused) {
  const RankFile rank;
  const MergePlan p = rank.plan(DType::BF16);
  // Same size, other content, mtime moved: the size check alone would not see it.
  std::string changed = rank.bytes;
  changed[300] ^= 1;
  rank.rewrite(changed);
  struct timespec times[2] = {{0, UTIME_OMIT}, {p.sources[0].planned->mtime_ns / 1000000000 + 5, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, rank.path.c_str(), times, 0), 0);
  for (bool crc : {true, false}) {
    const Error e = error_of([&] { run(p, crc); });
    EXPECT_NE(std::string(e.what()).find("changed since the plan was made"), std::string::npos) << e.what();
    EXPECT_EQ(e.file(), rank.path);
  }
  // Replaced by another file with the same size and times: a new inode.
  const std::string other = rank.path + ".new";
  std::filesystem::copy_file(rank.path, other);
  std::filesystem::rename(other, rank.path);
  const Error e = error_of([&] { run(p, false); });
  EXPECT_NE(std::string(e.what()).find("changed since the plan was made"), std::string::npos) << e.what();
}

TEST(RecordCheckerExecutor, ASourceChangedDuringTheRunFailsIt) {
  const RankFile rank;
  const MergePlan p = rank.plan(DType::BF16);
  NullSink sink;
  sink.on_write = [&] {
    // Another process rewrites the rank file in place while the merge runs.
    const int fd = ::open(rank.path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, "x", 1, 10), 1);
    struct timespec times[2] = {{0, UTIME_OMIT}, {p.sources[0].planned->mtime_ns / 1000000000 + 5, 0}};
    ASSERT_EQ(::futimens(fd, times), 0);
    ::close(fd);
  };
  const Error e = error_of([&] { run(p, false, sink); });  // without CRC, so only the stamps can tell
  EXPECT_NE(std::string(e.what()).find("changed during the merge"), std::string::npos) << e.what();
  EXPECT_EQ(e.file(), rank.path);
}

}  // namespace
}  // namespace shardmerge
