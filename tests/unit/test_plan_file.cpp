// Plan files (plan/plan_file.hpp): plan -> JSON -> plan gives the same plan, field by field,
// for plans built by hand and for plans of real checkpoints; every malformed field is refused
// with the plan file and the field named; sources changed since planning are refused.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "plan/plan_file.hpp"
#include "pipeline/planner.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "util/file_stamp.hpp"

namespace shardmerge {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const std::string kPlanFile = "/plans/p.json";

Slice dense(uint32_t file, uint64_t offset, DType dtype, std::vector<int64_t> start, std::vector<int64_t> extent,
            std::vector<int64_t> strides) {
  Slice s;
  s.file = file;
  s.offset = offset;
  s.dtype = dtype;
  s.start = std::move(start);
  s.extent = std::move(extent);
  s.strides = std::move(strides);
  return s;
}

// A plan using every field: two pieces and a cast, a LoRA fold, a compressed source owned by
// one rank, zip records, sidecars copied and generated (non-ASCII and control characters),
// notes and warnings, and a header whose length prefix holds bytes >= 0x80.
MergePlan hand_plan() {
  OutputTensor w;
  w.name = "model.layers.0.w\xc3\xa9ight";  // UTF-8 in a name
  w.dtype = DType::BF16;
  w.shape = {4, 3};
  w.copies = {dense(0, 64, DType::F32, {0, 0}, {2, 3}, {3, 1}), dense(1, 0, DType::F32, {2, 0}, {2, 3}, {1, 2})};
  LoraFold fold;
  fold.rank = 2;
  fold.scale = 0.1;  // not exact in binary: must still read back equal
  fold.a = {dense(0, 200, DType::F32, {0, 0}, {2, 3}, {3, 1})};
  fold.b = {dense(0, 300, DType::BF16, {0, 0}, {4, 2}, {2, 1})};
  w.lora = fold;
  w.origin = "Shard(0) x2 + LoRA fold";
  OutputTensor step;
  step.name = "step";
  step.dtype = DType::I64;
  step.shape = {};
  step.copies = {dense(0, 8, DType::I64, {}, {}, {})};
  step.origin = "plain";
  std::string big_name(420, 'x');  // makes the header 640 bytes: its length prefix starts with 0x80
  OutputTensor pad;
  pad.name = big_name;
  pad.dtype = DType::U8;
  pad.shape = {0};
  pad.origin = "empty";
  MergePlan p = test::one_file_plan(
      {w, step, pad},
      {SourceFile{"/ckpt/rank0.pt", 4096, FileStamp{4096, 1700000000123456789, 1700000000987654321, 42, 7}},
       SourceFile{"/ckpt/__0_0.distcp", 1000, FileStamp{1000, -5, 3, 1ull << 63, 0}}});
  p.sources[1].compressed = CompressedItem{"zstd", 100, 400, 24};
  p.sources[1].owner = 1;
  p.records = {{0, 64, 24, 0xdeadbeef, "archive/data/0", w.name}, {0, 200, 300, 0, "archive/data/1", "a"}};
  p.source_dir = "/ckpt";
  p.layout = "fsdp2 world_size=2 mesh=(fsdp)";
  p.sidecars = {{"config.json", "/ckpt/huggingface/config.json", std::string("{\n  \"x\": \"\xe2\x82\xac\\u0001\t\"\n}\n")},
                {"tokenizer.json", "/ckpt/huggingface/tokenizer.json", std::nullopt},
                {"empty.txt", "", std::string()}};
  p.notes = {"a note", "\xf0\x9f\x98\x80 and a tab\t"};
  p.warnings = {"a bf16 <-> fp16 cast"};
  return p;
}

Json options() { return {{"local_dir", "/ckpt"}, {"dtype", "bf16"}}; }

std::string plan_text(const MergePlan& p) { return plan_to_json(p, options()).dump(2); }

// plan -> JSON -> plan is equal field by field (each part first, so a failure says which).
void expect_round_trip(const MergePlan& p) {
  const MergePlan back = parse_plan_file(plan_text(p), kPlanFile);
  EXPECT_EQ(back.sources, p.sources);
  EXPECT_EQ(back.records, p.records);
  EXPECT_EQ(back.files, p.files);
  EXPECT_EQ(back.tensors, p.tensors);
  EXPECT_EQ(back.sidecars, p.sidecars);
  EXPECT_EQ(back, p);
}

TEST(PlanFile, HandBuiltPlanRoundTripsFieldByField) {
  const MergePlan p = hand_plan();
  ASSERT_GE(static_cast<unsigned char>(p.files[0].header[0]), 0x80u) << p.files[0].header.size();  // not UTF-8 text
  expect_round_trip(p);
  // Compact output reads back too.
  EXPECT_EQ(parse_plan_file(plan_to_json(p, options()).dump(), kPlanFile), p);
}

TEST(PlanFile, WriteIsAtomicAndReadsBack) {
  test::TempDir dir;
  const std::string path = dir / "plan.json";
  write_small_file(path, "old", false);
  write_plan_file(path, hand_plan(), options());
  EXPECT_EQ(read_plan_file(path), hand_plan());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"plan.json"});  // no temp file left beside it
  EXPECT_THROW(write_plan_file(dir / "missing/plan.json", hand_plan(), options()), Error);
}

// Plans of real checkpoints: every layout family the planner reads.
TEST(PlanFile, FixturePlansRoundTripFieldByField) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const std::string fx = test::fixtures_dir();
  struct Case {
    std::string dir;
    std::string hf_model_path;
  };
  const std::vector<Case> cases = {
      {"qwen2_fsdp2_w2/global_step_3/actor", ""},
      {"qwen2_hsdp_2x2/global_step_3/actor", ""},
      {"qwen2_fsdp1_sharded_tensor_w2/global_step_3/actor", ""},
      {"qwen2_lora_fsdp2_w2/global_step_3/actor", ""},
      {"qwen2_megatron_tp2/global_step_1/actor", ""},
      {"qwen2_megatron_tp2_pp2_legacy/global_step_1/actor", ""},
      {"qwen2_megatron_tp2_zstd/global_step_1/actor", ""},
      {"qwen2_megatron_lora_tp2/global_step_1/actor", "hf_base_megatron/qwen2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    MergeRequest req;
    req.local_dir = fx + "/" + c.dir;
    if (!c.hf_model_path.empty()) req.hf_model_path = fx + "/" + c.hf_model_path;
    req.lora_alpha = 16;
    const MergePlan p = plan_merge(req).plan;
    ASSERT_FALSE(p.tensors.empty());
    for (const SourceFile& s : p.sources) EXPECT_TRUE(s.planned.has_value()) << s.path;
    expect_round_trip(p);
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The hand plan's JSON with one change; then what reading it says.
std::string refusal(const std::function<void(Json&)>& edit) {
  Json j = plan_to_json(hand_plan(), options());
  edit(j);
  return error_of([&] { parse_plan_file(j.dump(), kPlanFile); });
}

struct Hostile {
  std::string what;
  std::function<void(Json&)> edit;
  std::string says;  // the whole message after "<plan file>: "
};

TEST(PlanFile, EveryMalformedFieldIsRefusedNamingTheFileAndTheField) {
  auto set = [](std::string pointer, Json v) {
    return [pointer, v](Json& j) { j[Json::json_pointer(pointer)] = v; };
  };
  auto drop = [](std::string parent, std::string key) {
    return [parent, key](Json& j) { j[Json::json_pointer(parent)].erase(key); };
  };
  const std::vector<Hostile> cases = {
      {"no version", drop("", "shardmerge_plan"),
       "not a shardmerge plan file: no 'shardmerge_plan' version field (write one with `shardmerge plan --out`)"},
      {"a later version", set("/shardmerge_plan", 2),
       "'shardmerge_plan' is 2: this shardmerge reads plan files of version 1 only (make the plan again with this "
       "shardmerge)"},
      {"version as a string", set("/shardmerge_plan", "1"), "'shardmerge_plan' is \"1\": this shardmerge reads plan"},
      {"negative offset", set("/tensors/0/offset", -1), "'tensors[0].offset' is -1, not a non-negative integer"},
      {"fractional offset", set("/tensors/0/offset", 1.5), "'tensors[0].offset' is 1.5, not a non-negative integer"},
      {"size past 2^64", set("/sources/0/size", 1.8446744073709552e19),
       "'sources[0].size' is 1.8446744073709552e+19, not a non-negative integer"},
      {"crc past 32 bits", set("/records/0/crc32", 4294967296ull),
       "'records[0].crc32' is 4294967296, not an integer in [0, 4294967295]"},
      {"owner below -1", set("/sources/1/owner", -2), "'sources[1].owner' is -2, not a rank or -1 (any process)"},
      {"owner past 32 bits", set("/sources/1/owner", 2147483648ull),
       "'sources[1].owner' is 2147483648, not an integer in [-2147483648, 2147483647]"},
      {"mtime as a string", set("/sources/0/stamp/mtime_ns", "now"), "'sources[0].stamp.mtime_ns' is \"now\", not an integer"},
      {"unknown codec", set("/sources/1/compressed/codec", "gzip"),
       "'sources[1].compressed.codec' is \"gzip\"; the only codec is \"zstd\""},
      {"compressed item past the file", set("/sources/1/compressed/length", 901),
       "'sources[1].compressed.length' runs past the end of the file (1000 bytes)"},
      {"piece of a missing source", set("/tensors/0/copies/1/source", 2),
       "'tensors[0].copies[1].source' is 2, but the plan has 2 sources"},
      {"record of a missing source", set("/records/1/source", 5), "'records[1].source' is 5, but the plan has 2 sources"},
      {"record past its source", set("/records/1/size", 3897), "'records[1].size' runs past the end of its source (4096 bytes)"},
      {"name as a number", set("/tensors/0/name", 5), "'tensors[0].name' is 5, not a string"},
      {"missing dtype", drop("/tensors/1", "dtype"), "'tensors[1].dtype' is missing"},
      {"null dtype", set("/tensors/1/dtype", nullptr), "'tensors[1].dtype' is null"},
      {"unknown dtype", set("/tensors/1/dtype", "bfloat17"), "'tensors[1].dtype' is \"bfloat17\", not a dtype name such as \"bfloat16\""},
      {"missing sources", drop("", "sources"), "'sources' is missing"},
      {"tensors as an object", set("/tensors", Json::object()), "'tensors' is {}, not a list"},
      {"a tensor as a list", set("/tensors/2", Json::array()), "'tensors[2]' is [], not an object"},
      {"options as a list", set("/options", Json::array()), "'options' is [], not an object"},
      {"a note as a number", set("/notes/1", 3), "'notes[1]' is 3, not a string"},
      {"a shape entry negative", set("/tensors/2/shape/0", -1), "'tensors[2].shape[0]' is -1: a dimension cannot be negative"},
      {"a stride as a string", set("/tensors/0/copies/0/strides/1", "1"),
       "'tensors[0].copies[0].strides[1]' is \"1\", not an integer"},
      {"sidecar content as a number", set("/sidecars/0/content", 3), "'sidecars[0].content' is 3, not a string"},
      {"missing sidecar content", drop("/sidecars/1", "content"), "'sidecars[1].content' is missing"},
      {"header not base64", set("/files/0/header_base64", "AB$="),
       "'files[0].header_base64' is not base64 (RFC 4648, padded)"},
      {"header longer than its file", set("/files/0/size", 8), "'files[0].header_base64' holds"},
      {"tensor in an unknown file", set("/tensors/0/file", "other.safetensors"),
       "'tensors[0].file' is \"other.safetensors\", not the name of one of the plan's files"},
      {"wrong nbytes", set("/tensors/0/nbytes", 25), "'tensors[0].nbytes' is 25, but [4, 3] bfloat16 holds a different number of bytes"},
      {"tensor past its file", set("/tensors/1/offset", 1u << 20), "'tensors[1].offset' places the tensor outside the data of model.safetensors"},
      {"tensors sharing bytes", set("/tensors/1/offset", 664),
       "'tensors[1].offset' places 'step' over bytes of 'model.layers.0.w\xc3\xa9ight' in model.safetensors"},
      {"a file outside the target", set("/files/0/name", "../model.safetensors"),
       "'files[0].name' is \"../model.safetensors\", not a relative path inside the target directory"},
      {"an absolute sidecar", set("/sidecars/1/name", "/etc/x"),
       "'sidecars[1].name' is \"/etc/x\", not a relative path inside the target directory"},
      {"a sidecar in a dot dir", set("/sidecars/0/name", "a/./b"), "'sidecars[0].name' is \"a/./b\", not a relative path"},
      {"a piece outside its tensor", set("/tensors/0/copies/0/dst_start/0", 3),
       "'tensors[0].copies[0].dst_start' does not tile [4, 3]: piece at [3, 0] of size [2, 3] lies outside the tensor's shape [4, 3]"},
      {"pieces overlapping", set("/tensors/0/copies/1/dst_start/0", 1),
       "'tensors[0].copies[0].dst_start' does not tile [4, 3]: pieces at [0, 0] and [1, 0] overlap"},
      {"a piece of the wrong rank", set("/tensors/0/copies/0/strides", Json::array({1})),
       "'tensors[0].copies[0].strides' has 1 entries; the tensor has 2 dimensions"},
      {"a piece past its source", set("/tensors/0/copies/0/offset", 4090),
       "'tensors[0].copies[0].offset' with these strides and extents reads outside its source's 4096 bytes (/ckpt/rank0.pt)"},
      {"a piece past the decoded item", set("/tensors/0/copies/1/offset", 1),
       "'tensors[0].copies[1].offset' with these strides and extents reads outside its source's 24 bytes"},
      {"a stride reaching far past any file", set("/tensors/0/copies/0/strides/0", 9223372036854775807ll),
       "'tensors[0].copies[0].offset' with these strides and extents reads outside"},
      {"a negative stride reaching before the file", set("/tensors/0/copies/0/strides/0", -100),
       "'tensors[0].copies[0].offset' with these strides and extents reads outside"},
      {"an unknown op", set("/tensors/1/ops", Json::array({{{"op", "explode"}}})),
       "'tensors[1].ops[0].op' is \"explode\", not \"cast\" or \"lora_fold\""},
      {"a fold of rank 0", set("/tensors/0/ops/1/rank", 0), "'tensors[0].ops[1].rank' is 0, not positive"},
      {"a fold whose A does not tile [r, in]", set("/tensors/0/ops/1/rank", 3), "'tensors[0].ops[1].a[0].dst_start' does not tile [3, 3]"},
      {"a derived length edited", set("/tensors/0/copies/0/length", 3),
       "'tensors[0].copies[0].length' is 3, but the plan's other fields make it 24 (it is derived from them)"},
      {"a derived path edited", set("/tensors/0/copies/0/file", "/elsewhere.pt"),
       "'tensors[0].copies[0].file' is \"/elsewhere.pt\", but the plan's other fields make it \"/ckpt/rank0.pt\""},
      {"bytes_read edited", set("/bytes_read", 0), "'bytes_read' is 0, but the plan's other fields make it"},
      {"a cast op removed", [](Json& j) { j["tensors"][0]["ops"].erase(0); },
       "'tensors[0].ops' has 1 entries, but the plan's other fields make 2"},
      {"an unknown field", set("/tensors/0/copies/0/colour", "red"),
       "'tensors[0].copies[0].colour' is not a field of a version-1 plan file"},
  };
  for (const Hostile& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string message = refusal(c.edit);
    EXPECT_EQ(message.rfind(kPlanFile + ": " + c.says, 0), 0u) << message;
  }
}

TEST(PlanFile, TextThatIsNotOnePlanObjectIsRefused) {
  const std::string text = plan_text(hand_plan());
  EXPECT_EQ(error_of([&] { parse_plan_file("[1]", kPlanFile); }),
            kPlanFile + ": not a shardmerge plan file (the top level is not a JSON object)");
  EXPECT_EQ(error_of([&] { parse_plan_file(text.substr(0, text.size() / 2), kPlanFile); })
                .rfind(kPlanFile + ": not a valid JSON plan file (", 0),
            0u);
  // A key given twice: nlohmann would keep the last one silently.
  std::string twice = text;
  twice.replace(twice.find("\"layout\":"), 9, "\"layout\": \"x\", \"layout\":");
  EXPECT_EQ(error_of([&] { parse_plan_file(twice, kPlanFile); }), kPlanFile + ": the key 'layout' appears twice in one object");
  std::string nested = text;
  nested.replace(nested.find("\"crc32\":"), 8, "\"crc32\": 1, \"crc32\":");
  EXPECT_EQ(error_of([&] { parse_plan_file(nested, kPlanFile); }), kPlanFile + ": the key 'crc32' appears twice in one object");
}

// ---------------------------------------------------------------------------------------------
// Sources checked before a plan file runs

struct Written {
  std::string path;
  FileStamp stamp;
};

Written source_file(const test::TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir / name;
  write_small_file(path, bytes, true);
  return {path, file_stamp(File::open_read(path))};
}

void set_mtime(const std::string& path, int64_t mtime_ns) {
  const struct timespec times[2] = {{0, UTIME_OMIT}, {mtime_ns / 1000000000, mtime_ns % 1000000000}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

MergePlan plan_reading(const std::vector<Written>& files) {
  MergePlan p;
  for (const Written& w : files) p.sources.push_back(SourceFile{w.path, w.stamp.size, w.stamp});
  return p;
}

TEST(PlanFileSources, SameSizeAndMtimeIsEnoughAndTheStampIsTakenAgain) {
  test::TempDir dir;
  const Written a = source_file(dir, "a.pt", "0123456789");
  // Another file (another inode, ctime) with the same bytes and mtime: as on another machine.
  const std::string copy = dir / "copy.pt";
  fs::copy_file(a.path, copy);
  set_mtime(copy, a.stamp.mtime_ns);
  MergePlan p = plan_reading({{copy, a.stamp}});
  ASSERT_TRUE(stamp_change(a.stamp, file_stamp(File::open_read(copy)), StampMatch::Exact));
  confirm_sources_unchanged(p, kPlanFile, -1);
  EXPECT_EQ(p.sources[0].planned, file_stamp(File::open_read(copy)));  // the executor's exact check starts now
}

TEST(PlanFileSources, ChangedMissingOrUnstampedSourcesAreRefusedByName) {
  test::TempDir dir;
  const Written a = source_file(dir, "a.pt", "0123456789");
  const Written b = source_file(dir, "b.pt", "abcdef");
  {
    set_mtime(b.path, b.stamp.mtime_ns + 1000);
    MergePlan p = plan_reading({a, b});
    EXPECT_EQ(error_of([&] { confirm_sources_unchanged(p, kPlanFile, -1); }),
              b.path + ": changed since the plan " + kPlanFile + " was made (modified (mtime changed)); make the plan again");
  }
  {
    write_small_file(b.path, "abc", true);
    set_mtime(b.path, b.stamp.mtime_ns);
    MergePlan p = plan_reading({a, b});
    EXPECT_EQ(error_of([&] { confirm_sources_unchanged(p, kPlanFile, -1); }),
              b.path + ": changed since the plan " + kPlanFile + " was made (size 6 -> 3 bytes); make the plan again");
  }
  {
    fs::remove(b.path);
    MergePlan p = plan_reading({a, b});
    EXPECT_EQ(error_of([&] { confirm_sources_unchanged(p, kPlanFile, -1); }).rfind(b.path + ": cannot open for reading", 0), 0u);
    // Another process's file is its own to check.
    p.sources[1].owner = 1;
    EXPECT_NO_THROW(confirm_sources_unchanged(p, kPlanFile, 0));
    EXPECT_THROW(confirm_sources_unchanged(p, kPlanFile, 1), Error);
  }
  {
    MergePlan p = plan_reading({a});
    p.sources[0].planned.reset();
    EXPECT_EQ(error_of([&] { confirm_sources_unchanged(p, kPlanFile, -1); }).rfind(a.path + ": the plan file " + kPlanFile +
                                                                                       " records no size and mtime",
                                                                                   0),
              0u);
  }
}

TEST(FileStampMatch, SizeAndMtimeIgnoresInodeDeviceAndCtimeExactDoesNot) {
  const FileStamp then{10, 5, 6, 7, 8};
  FileStamp moved = then;
  moved.inode = 99;
  moved.device = 98;
  moved.ctime_ns = 97;
  EXPECT_FALSE(stamp_change(then, moved, StampMatch::SizeAndMtime));
  EXPECT_EQ(stamp_change(then, moved, StampMatch::Exact), "replaced by another file (inode changed)");
  FileStamp touched = then;
  touched.ctime_ns = 97;
  EXPECT_EQ(stamp_change(then, touched, StampMatch::Exact), "modified (ctime changed)");
  touched.mtime_ns = 1;
  EXPECT_EQ(stamp_change(then, touched, StampMatch::SizeAndMtime), "modified (mtime changed)");
  FileStamp grown = then;
  grown.size = 11;
  EXPECT_EQ(stamp_change(then, grown, StampMatch::SizeAndMtime), "size 10 -> 11 bytes");
}

}  // namespace
}  // namespace shardmerge
