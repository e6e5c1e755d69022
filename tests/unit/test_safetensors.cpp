// safetensors (src/formats/safetensors.*, hf_index.*): the writer against headers written by
// the reference implementation, round trips of every dtype, each validation rule of research
// torch-formats.md B.3 on hand-made headers, the hostile fixture files, and sharded HF dirs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/hf_index.hpp"
#include "formats/safetensors.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/bytes.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

using test::fixtures_dir;
using test::TempDir;

std::string length_prefix(uint64_t n) {
  std::string s;
  append_le<uint64_t>(s, n);
  return s;
}

// ---- the writer against the reference writer -----------------------------------------------

// Headers written by safetensors 0.8.0 (safetensors.torch.save with metadata {'format': 'pt'},
// torch 2.15), generated once with /tmp/venv/bin/python. The first is the mixed-dtype example
// of research B.4; the second has one tensor of every dtype, handed over in scrambled order.
const std::string kReferenceMixed =
    R"({"__metadata__":{"format":"pt"},"c.idx":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
    R"("a.bias":{"dtype":"F32","shape":[3],"data_offsets":[8,20]},"e.empty":{"dtype":"F32","shape":[0,4],"data_offsets":[20,20]},)"
    R"("s":{"dtype":"F32","shape":[],"data_offsets":[20,24]},"b.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[24,36]},)"
    R"("f8":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[36,38]},"z.flag":{"dtype":"BOOL","shape":[1],"data_offsets":[38,39]}})"
    "     ";
const std::string kReferenceAllDtypes =
    R"({"__metadata__":{"format":"pt"},"u64":{"dtype":"U64","shape":[2],"data_offsets":[0,16]},)"
    R"("i64":{"dtype":"I64","shape":[1],"data_offsets":[16,24]},"f64":{"dtype":"F64","shape":[1],"data_offsets":[24,32]},)"
    R"("c64":{"dtype":"C64","shape":[1],"data_offsets":[32,40]},"f32":{"dtype":"F32","shape":[1],"data_offsets":[40,44]},)"
    R"("u32":{"dtype":"U32","shape":[1],"data_offsets":[44,48]},"i32":{"dtype":"I32","shape":[1],"data_offsets":[48,52]},)"
    R"("bf16":{"dtype":"BF16","shape":[1],"data_offsets":[52,54]},"f16":{"dtype":"F16","shape":[1],"data_offsets":[54,56]},)"
    R"("u16":{"dtype":"U16","shape":[1],"data_offsets":[56,58]},"i16":{"dtype":"I16","shape":[1],"data_offsets":[58,60]},)"
    R"("f8_e5m2fnuz":{"dtype":"F8_E5M2FNUZ","shape":[1],"data_offsets":[60,61]},)"
    R"("f8_e4m3fnuz":{"dtype":"F8_E4M3FNUZ","shape":[1],"data_offsets":[61,62]},)"
    R"("f8_e8m0":{"dtype":"F8_E8M0","shape":[1],"data_offsets":[62,63]},"f8_e4m3":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[63,64]},)"
    R"("f8_e5m2":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[64,65]},"i8":{"dtype":"I8","shape":[1],"data_offsets":[65,66]},)"
    R"("u8":{"dtype":"U8","shape":[3],"data_offsets":[66,69]},"bool":{"dtype":"BOOL","shape":[1],"data_offsets":[69,70]}})"
    "      ";

TEST(SafetensorsWriter, HeaderIsByteIdenticalToTheReferenceWriter) {
  const SafetensorsLayout mixed = layout_safetensors({{"z.flag", DType::Bool, {1}},
                                                      {"s", DType::F32, {}},
                                                      {"b.weight", DType::BF16, {2, 3}},
                                                      {"f8", DType::F8_E4M3, {2}},
                                                      {"a.bias", DType::F32, {3}},
                                                      {"e.empty", DType::F32, {0, 4}},
                                                      {"c.idx", DType::I64, {1}}});
  EXPECT_EQ(mixed.header, length_prefix(kReferenceMixed.size()) + kReferenceMixed);
  EXPECT_EQ(mixed.file_size, 8 + kReferenceMixed.size() + 39);

  const SafetensorsLayout all = layout_safetensors({{"bool", DType::Bool, {1}},
                                                    {"f8_e4m3", DType::F8_E4M3, {1}},
                                                    {"u16", DType::U16, {1}},
                                                    {"c64", DType::C64, {1}},
                                                    {"u8", DType::U8, {3}},
                                                    {"f64", DType::F64, {1}},
                                                    {"f8_e8m0", DType::F8_E8M0, {1}},
                                                    {"i32", DType::I32, {1}},
                                                    {"f16", DType::F16, {1}},
                                                    {"u64", DType::U64, {2}},
                                                    {"f8_e5m2fnuz", DType::F8_E5M2FNUZ, {1}},
                                                    {"i16", DType::I16, {1}},
                                                    {"bf16", DType::BF16, {1}},
                                                    {"i8", DType::I8, {1}},
                                                    {"f32", DType::F32, {1}},
                                                    {"f8_e5m2", DType::F8_E5M2, {1}},
                                                    {"u32", DType::U32, {1}},
                                                    {"f8_e4m3fnuz", DType::F8_E4M3FNUZ, {1}},
                                                    {"i64", DType::I64, {1}}});
  EXPECT_EQ(all.header, length_prefix(kReferenceAllDtypes.size()) + kReferenceAllDtypes);
}

TEST(SafetensorsWriter, OrderIsAlignmentDescendingThenName) {
  // Same dtype: by name. Different dtypes: wider first, whatever the names.
  const SafetensorsLayout layout = layout_safetensors(
      {{"b", DType::F32, {1}}, {"a", DType::F32, {1}}, {"a8", DType::U8, {1}}, {"z64", DType::I64, {1}}}, {});
  std::vector<std::string> order;
  for (const auto& t : layout.tensors) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"z64", "a", "b", "a8"}));
  // Without metadata there is no __metadata__ entry; the JSON still pads to 8 bytes.
  EXPECT_EQ(layout.header.substr(8, 8), R"({"z64":{)");
  EXPECT_EQ(layout.header.size() % 8, 0u);
  EXPECT_EQ(load_le<uint64_t>(layout.header.data()), layout.header.size() - 8);
  uint64_t expected_offset = layout.header.size();
  for (const auto& t : layout.tensors) {
    EXPECT_EQ(t.file_offset, expected_offset) << t.name;
    EXPECT_EQ(t.file_offset % dtype_size(t.dtype), 0u) << t.name << " is naturally aligned";
    expected_offset += t.nbytes;
  }
  EXPECT_EQ(layout.file_size, expected_offset);
}

TEST(SafetensorsWriter, NamesAreEscapedAsJson) {
  // Quotes, backslashes and control characters escaped, UTF-8 kept: what safetensors' writer
  // (serde_json) writes, and what the header parser reads back.
  const SafetensorsLayout layout = layout_safetensors(
      {{"a\"q", DType::U8, {1}}, {"b\\s", DType::U8, {1}}, {"c\tt", DType::U8, {1}}, {"d\xc3\xa9", DType::U8, {1}}}, {});
  EXPECT_EQ(layout.header.substr(8, layout.header.find_last_not_of(' ') - 7),
            R"({"a\"q":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b\\s":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
            R"("c\tt":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},"d)" "\xc3\xa9" R"(":{"dtype":"U8","shape":[1],"data_offsets":[3,4]}})");
  const SafetensorsFile back = SafetensorsFile::from_header(layout.header.substr(8), layout.file_size);
  ASSERT_EQ(back.tensors().size(), 4u);
  EXPECT_EQ(back.tensors()[0].name, "a\"q");
  EXPECT_EQ(back.tensors()[3].name, "d\xc3\xa9");
}

TEST(SafetensorsWriter, RefusesWhatSafetensorsCannotHold) {
  auto error_of = [](std::vector<TensorDecl> decls) -> std::string {
    try {
      layout_safetensors(std::move(decls));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({{"w", DType::F32, {1}}, {"w", DType::F32, {2}}}).find("tensor 'w': appears twice"), std::string::npos);
  EXPECT_NE(error_of({{"w", DType::F32, {1}}, {"w", DType::BF16, {2}}}).find("appears twice"), std::string::npos);
  EXPECT_NE(error_of({{"__metadata__", DType::F32, {1}}}).find("reserved name"), std::string::npos);
  EXPECT_NE(error_of({{"c", DType::C128, {1}}}).find("complex128 cannot be stored in safetensors"), std::string::npos);
  EXPECT_NE(error_of({{"n", DType::F32, {2, -1}}}).find("negative dimension"), std::string::npos);

  TempDir dir;
  try {
    write_safetensors(dir / "short.safetensors", {{"w", DType::F32, {2}}}, {std::string(4, '\0')});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w': has 4 bytes, expected 8"), std::string::npos) << e.what();
  }
}

// ---- round trip ----------------------------------------------------------------------------

TEST(SafetensorsRoundTrip, EveryDtypeSafetensorsSupports) {
  const DType all[] = {DType::Bool,    DType::U8,          DType::I8,         DType::I16,     DType::U16,
                       DType::I32,     DType::U32,         DType::I64,        DType::U64,     DType::F16,
                       DType::BF16,    DType::F32,         DType::F64,        DType::C64,     DType::F8_E4M3,
                       DType::F8_E5M2, DType::F8_E8M0,     DType::F8_E4M3FNUZ, DType::F8_E5M2FNUZ};
  std::vector<TensorDecl> decls;
  std::vector<std::string> data;
  for (size_t i = 0; i < std::size(all); ++i) {
    const std::vector<int64_t> shape = i % 3 == 0 ? std::vector<int64_t>{} : std::vector<int64_t>{2, static_cast<int64_t>(i)};
    std::string name = "t";  // (built with +=: GCC 12 warns falsely on "t" + to_string(), -Wrestrict)
    name += std::to_string(i) + "." + std::string(dtype_name(all[i]));
    decls.push_back({name, all[i], shape});
    std::string bytes(decls.back().nbytes(), '\0');
    for (size_t b = 0; b < bytes.size(); ++b) bytes[b] = static_cast<char>(i * 31 + b * 7 + 1);  // distinct per tensor
    data.push_back(bytes);
  }
  decls.push_back({"empty", DType::F32, {0, 3}});
  data.emplace_back();

  TempDir dir;
  const std::string path = dir / "all.safetensors";
  write_safetensors(path, decls, data);
  const SafetensorsFile st = SafetensorsFile::open(path);
  EXPECT_EQ(st.path(), path);
  EXPECT_EQ(st.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(st.tensors().size(), decls.size());

  const std::string file = test::read_file(path);
  const uint64_t header_len = load_le<uint64_t>(file.data());
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(file.substr(8, 16), R"({"__metadata__":)");
  for (size_t i = 0; i < decls.size(); ++i) {
    SCOPED_TRACE(decls[i].name);
    const SafetensorsTensor* t = st.find(decls[i].name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, decls[i].dtype);
    EXPECT_EQ(t->shape, decls[i].shape);
    EXPECT_EQ(t->nbytes, data[i].size());
    EXPECT_EQ(file.substr(t->file_offset, t->nbytes), data[i]);
  }
  // tensors() is in data order, which is the writer's order.
  for (size_t i = 1; i < st.tensors().size(); ++i)
    EXPECT_EQ(st.tensors()[i].file_offset, st.tensors()[i - 1].file_offset + st.tensors()[i - 1].nbytes);
  EXPECT_EQ(st.tensors().front().file_offset, 8 + header_len);
  EXPECT_EQ(st.find("absent"), nullptr);
}

// ---- validation (research B.3) -------------------------------------------------------------

std::string header_error(const std::string& header, uint64_t buffer_bytes) {
  try {
    SafetensorsFile::from_header(header, 8 + header.size() + buffer_bytes);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << header;
  return "";
}

TEST(SafetensorsValidation, EveryRuleOfTheReferenceReader) {
  struct Case {
    const char* rule;
    std::string header;
    uint64_t buffer_bytes;
    const char* error;
  };
  const std::string w8 = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const Case cases[] = {
      {"not UTF-8", "{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "not valid UTF-8 JSON"},
      {"not JSON", R"({"w":{"dtype":"F32",)", 8, "not valid UTF-8 JSON"},
      {"not an object", "[1, 2]", 0, "top level is not a JSON object"},
      {"metadata not a map", R"({"__metadata__":["pt"]})", 0, "__metadata__ is not an object"},
      {"metadata value not a string", R"({"__metadata__":{"format":1}})", 0, "__metadata__ value for 'format' is not a string"},
      {"tensor info not an object", R"({"w":[0,8]})", 8, "entry 'w' is not an object"},
      {"missing dtype", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8, "'w' has no dtype string"},
      {"missing shape", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8, "'w' has no shape array"},
      {"missing offsets", R"({"w":{"dtype":"F32","shape":[2]}})", 8, "'w' has no [begin, end] data_offsets"},
      {"three offsets", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", 8, "no [begin, end] data_offsets"},
      {"unknown dtype", R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype 'F33'"},
      {"lower-case dtype", R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype 'f32'"},
      {"negative dim", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "non-integer or negative dimension"},
      {"fractional dim", R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, "non-integer or negative dimension"},
      {"dim past int64", R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8, "dimension too large"},
      {"negative offset", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8, "negative or non-integer offset"},
      {"end before begin", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, "'w' ends before it begins"},
      {"element count overflow", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
       "size of tensor 'w' overflows"},
      {"size mismatch", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "has 8 bytes of data but its shape and dtype need 12"},
      {"overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12,
       "tensor 'b' overlaps"},
      {"hole", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16,
       "hole of 4 bytes before tensor 'b'"},
      {"buffer not starting at 0", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "hole of 4 bytes before tensor 'a'"},
      {"trailing bytes", "{" + w8 + "}", 9, "1 trailing bytes after the tensor data"},
      {"truncated buffer", "{" + w8 + "}", 7, "file is truncated"},
      {"duplicate names", "{" + w8 + "," + w8 + "}", 8, "tensor name 'w' appears twice"},
      // serde_json (the reference reader) refuses anything but JSON whitespace after the
      // object; nlohmann's parser would stop at a NUL and ignore what follows it.
      {"NUL padding", "{" + w8 + "}" + std::string(3, '\0'), 8, "byte 0x00 at header byte"},
      {"NUL then text", "{" + w8 + "}" + std::string(1, '\0') + "{\"x\":1}", 8, "byte 0x00 at header byte"},
      {"text after the object", "{" + w8 + "}  {}", 8, "not valid UTF-8 JSON"},
  };
  for (const auto& c : cases) {
    const std::string what = header_error(c.header, c.buffer_bytes);
    EXPECT_NE(what.find("invalid safetensors header"), std::string::npos) << c.rule << ": " << what;
    EXPECT_NE(what.find(c.error), std::string::npos) << c.rule << ": " << what;
  }
}

TEST(SafetensorsValidation, WhatTheReferenceReaderAccepts) {
  // Entries in any order (sorted by offset), zero-size tensors, unknown fields, padding spaces,
  // scalars, and a repeated name nested below the top level (not a duplicate tensor).
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12],"extra":{"w":1}},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[4,0],"data_offsets":[12,12]},)"
      R"("s":{"dtype":"U8","shape":[],"data_offsets":[12,13]},"__metadata__":{"format":"pt","w":"x"}})"
      "   ";
  const SafetensorsFile st = SafetensorsFile::from_header(header, 8 + header.size() + 13);
  ASSERT_EQ(st.tensors().size(), 4u);
  std::vector<std::string> order;
  for (const auto& t : st.tensors()) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b", "e", "s"}));
  EXPECT_EQ(st.find("b")->file_offset, 8 + header.size() + 8);
  EXPECT_EQ(st.find("s")->shape, std::vector<int64_t>{});
  EXPECT_EQ(st.metadata().at("w"), "x");
  // JSON whitespace around the object, as serde_json allows it.
  EXPECT_EQ(SafetensorsFile::from_header(" \t\r\n{}\n\t\r ", 8 + 10).tensors().size(), 0u);
  // An empty header object: no tensors, no data.
  EXPECT_TRUE(SafetensorsFile::from_header("{}", 10).tensors().empty());
}

TEST(SafetensorsValidation, HeaderLengthLimits) {
  // 100,000,000 bytes is the reference reader's MAX_HEADER_SIZE.
  const std::string too_large(kSafetensorsMaxHeader + 1, ' ');
  try {
    SafetensorsFile::from_header(too_large, too_large.size() + 8);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds 100 MB"), std::string::npos) << e.what();
  }

  TempDir dir;
  auto open_error = [&](const std::string& name, const std::string& bytes) -> std::string {
    const std::string path = dir / name;
    write_small_file(path, bytes);
    try {
      SafetensorsFile::open(path);
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << "the error must name the file: " << what;
      return what;
    }
    ADD_FAILURE() << name << " opened";
    return "";
  };
  EXPECT_NE(open_error("short", "1234567").find("fewer than the 8-byte header length"), std::string::npos);
  EXPECT_NE(open_error("huge", length_prefix(kSafetensorsMaxHeader + 1) + "{}").find("exceeds 100 MB"), std::string::npos);
  EXPECT_NE(open_error("past_eof", length_prefix(64) + "{}").find("runs past the end"), std::string::npos);
  EXPECT_NE(open_error("max_u64", length_prefix(~uint64_t{0}) + "{}").find("exceeds 100 MB"), std::string::npos);
}

// ---- hostile fixtures ----------------------------------------------------------------------

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

TEST(SafetensorsHostile, EveryHostileFileFailsNamingTheProblemAndTheFile) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const auto manifest = nlohmann::json::parse(test::read_file(fixtures_dir() + "/manifest.json"));
  // The manifest's substrings are loose ("header" is in every header error); these are exact.
  const std::map<std::string, std::string> precise = {
      {"hostile/st_overlap.safetensors", "tensor 'a' overlaps the tensor before it"},
      {"hostile/st_hole.safetensors", "hole of 16 bytes before tensor 'a'"},
      {"hostile/st_header_len_past_eof.safetensors", "runs past the end of the 360-byte file"},
      {"hostile/st_unknown_dtype.safetensors", "unknown dtype 'F33'"},
      {"hostile/st_truncated_buffer.safetensors", "file is truncated"},
  };
  size_t checked = 0;
  for (const auto& h : manifest["hostile"]) {
    const std::string file = h["file"].get<std::string>();
    if (file.find(".safetensors") == std::string::npos) continue;
    SCOPED_TRACE(file);
    const std::string path = fixtures_dir() + "/" + file;
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "opened without an error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      EXPECT_NE(lower(what).find(lower(h["expect_error_contains"].get<std::string>())), std::string::npos) << what;
      EXPECT_NE(what.find(precise.at(file)), std::string::npos) << what;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 5u);
  const SafetensorsFile control = SafetensorsFile::open(fixtures_dir() + "/hostile/st_control.safetensors");
  EXPECT_GE(control.tensors().size(), 2u);
}

// ---- HF model directories ------------------------------------------------------------------

std::string f32_bytes(size_t n, float start) {
  std::string out(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float v = start + static_cast<float>(i);
    std::memcpy(out.data() + 4 * i, &v, 4);
  }
  return out;
}

// Two shards and their index, as save_pretrained writes them.
void write_sharded(const TempDir& dir, const std::string& index_json) {
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    {{"model.embed.weight", DType::F32, {4, 2}}, {"model.norm.weight", DType::F32, {2}}},
                    {f32_bytes(8, 0), f32_bytes(2, 100)});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"lm_head.weight", DType::F32, {4, 2}}}, {f32_bytes(8, 50)});
  write_small_file(dir / "model.safetensors.index.json", index_json);
}

const char* const kIndex = R"({
  "metadata": {"total_size": 96, "total_parameters": 24},
  "weight_map": {
    "lm_head.weight": "model-00002-of-00002.safetensors",
    "model.embed.weight": "model-00001-of-00002.safetensors",
    "model.norm.weight": "model-00001-of-00002.safetensors"
  }
})";

std::string hf_error(const std::string& dir) {
  try {
    open_hf_weights(dir);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "opened " << dir;
  return "";
}

TEST(SafetensorsHfIndex, ShardedDirectory) {
  TempDir dir;
  write_sharded(dir, kIndex);
  const HfWeights w = open_hf_weights(dir.path().string());
  EXPECT_EQ(w.files.size(), 2u);
  ASSERT_EQ(w.tensors.size(), 3u);
  std::vector<std::string> names;
  for (const auto& [name, ref] : w.tensors) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"lm_head.weight", "model.embed.weight", "model.norm.weight"}));
  const auto& head = w.tensors.at("lm_head.weight");
  EXPECT_EQ(std::filesystem::path(w.path_of(head)).filename(), "model-00002-of-00002.safetensors");
  EXPECT_EQ(head.tensor->shape, (std::vector<int64_t>{4, 2}));
  const std::string shard2 = test::read_file(w.path_of(head));
  EXPECT_EQ(shard2.substr(head.tensor->file_offset, head.tensor->nbytes), f32_bytes(8, 50));
  EXPECT_EQ(std::filesystem::path(w.path_of(w.tensors.at("model.norm.weight"))).filename(),
            "model-00001-of-00002.safetensors");
}

TEST(SafetensorsHfIndex, SingleFileWithoutIndex) {
  TempDir dir;
  write_safetensors(dir / "model.safetensors", {{"w", DType::BF16, {3}}}, {std::string(6, '\x01')});
  const HfWeights w = open_hf_weights(dir.path().string());
  ASSERT_EQ(w.tensors.size(), 1u);
  EXPECT_EQ(w.tensors.at("w").tensor->dtype, DType::BF16);
  TempDir empty;
  EXPECT_NE(hf_error(empty.path().string()).find("no model.safetensors or model.safetensors.index.json"), std::string::npos);
}

TEST(SafetensorsHfIndex, MissingShard) {
  TempDir dir;
  write_sharded(dir, kIndex);
  std::filesystem::remove(dir / "model-00002-of-00002.safetensors");
  const std::string what = hf_error(dir.path().string());
  EXPECT_NE(what.find("model-00002-of-00002.safetensors"), std::string::npos) << what;
  EXPECT_NE(what.find("cannot open"), std::string::npos) << what;
}

TEST(SafetensorsHfIndex, TensorAssignedToTheWrongFile) {
  TempDir dir;
  std::string index = kIndex;
  const std::string right = R"("lm_head.weight": "model-00002-of-00002.safetensors")";
  index.replace(index.find(right), right.size(), R"("lm_head.weight": "model-00001-of-00002.safetensors")");
  write_sharded(dir, index);
  const std::string what = hf_error(dir.path().string());
  EXPECT_NE(what.find("index assigns 'lm_head.weight' to model-00001-of-00002.safetensors, which does not hold it"),
            std::string::npos)
      << what;
}

TEST(SafetensorsHfIndex, IndexProblems) {
  {
    TempDir dir;
    write_sharded(dir, R"({"weight_map": {"w": "../outside.safetensors"}})");
    EXPECT_NE(hf_error(dir.path().string()).find("outside the directory"), std::string::npos);
  }
  {
    TempDir dir;
    write_sharded(dir, R"({"metadata": {}})");
    EXPECT_NE(hf_error(dir.path().string()).find("not a valid safetensors index"), std::string::npos);
  }
  {
    TempDir dir;
    write_sharded(dir, R"({"weight_map": {"w": 5}})");
    EXPECT_NE(hf_error(dir.path().string()).find("not a valid safetensors index"), std::string::npos);
  }
  {
    TempDir dir;
    write_sharded(dir, "{not json");
    const std::string what = hf_error(dir.path().string());
    EXPECT_NE(what.find("model.safetensors.index.json"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace shardmerge
