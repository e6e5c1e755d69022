// The restricted pickle VM (src/formats/pickle.*): every opcode of protocols 0-5, the
// semantics that are easy to get wrong (research torch-formats.md A.6), the allowlisted
// reconstructors, the code-execution denylist, and golden pickles written by Python itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "formats/pickle.hpp"
#include "formats/torch_pt.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

using pickle::Document;
using pickle::Kind;
using pickle::Value;
using namespace std::string_literals;

// ---- helpers -------------------------------------------------------------------------------

std::string le32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// BINUNICODE with its length prefix.
// (Appended piece by piece: GCC 12 warns falsely about "X" + a + b here, -Wrestrict.)
std::string bin_unicode(const std::string& text) {
  std::string out = "X";
  out += le32(static_cast<uint32_t>(text.size()));
  out += text;
  return out;
}

std::string from_hex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    unsigned byte = 0;
    std::from_chars(hex.data() + i, hex.data() + i + 2, byte, 16);
    out.push_back(static_cast<char>(byte));
  }
  return out;
}

std::string hex_of(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

// A BigInt's bytes with redundant sign-extension bytes removed: the VM may keep a longer
// encoding (LONG text, non-minimal LONG1), Python's int.to_bytes gives the minimal one.
std::string minimal_twos_complement(std::string bytes) {
  while (bytes.size() > 1) {
    const auto last = static_cast<uint8_t>(bytes.back());
    const auto prev = static_cast<uint8_t>(bytes[bytes.size() - 2]);
    if ((last == 0x00 && !(prev & 0x80)) || (last == 0xFF && (prev & 0x80)))
      bytes.pop_back();
    else
      break;
  }
  return bytes;
}

std::string quoted(const std::string& text, const char* prefix) {
  std::string out = std::string(prefix) + "'";
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7F) {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out + "'";
}

// A Python-like rendering of a value tree, so expectations are one readable string. Values
// already being rendered further up (reference cycles) print as "...".
std::string repr(const Value& v, std::vector<const Value*>& path);

std::string join(const std::vector<Value*>& items, std::vector<const Value*>& path) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + repr(*items[i], path);
  return out;
}

std::string join_entries(const std::vector<std::pair<Value*, Value*>>& entries, std::vector<const Value*>& path) {
  std::string out;
  for (size_t i = 0; i < entries.size(); ++i)
    out += (i ? ", " : "") + repr(*entries[i].first, path) + ": " + repr(*entries[i].second, path);
  return out;
}

std::string repr(const Value& v, std::vector<const Value*>& path) {
  if (std::find(path.begin(), path.end(), &v) != path.end()) return "...";
  path.push_back(&v);
  std::string out;
  switch (v.kind) {
    case Kind::None: out = "None"; break;
    case Kind::Bool: out = v.boolean ? "True" : "False"; break;
    case Kind::Int: out = std::to_string(v.integer); break;
    case Kind::BigInt: out = "bigint<" + hex_of(minimal_twos_complement(v.text)) + ">"; break;
    case Kind::Float: {
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof buf, v.real);
      out.assign(buf, r.ptr);
      break;
    }
    case Kind::Str: out = quoted(v.text, ""); break;
    case Kind::Bytes: out = quoted(v.text, "b"); break;
    case Kind::Tuple: out = "(" + join(v.items, path) + (v.items.size() == 1 ? ",)" : ")"); break;
    case Kind::List: out = "[" + join(v.items, path) + "]"; break;
    case Kind::Dict: out = "{" + join_entries(v.entries, path) + "}"; break;
    case Kind::Set: out = "set{" + join(v.items, path) + "}"; break;
    case Kind::FrozenSet: out = "frozenset{" + join(v.items, path) + "}"; break;
    case Kind::Global: out = v.text + ":" + v.name; break;
    case Kind::Object:
      out = "Object(" + (v.callable ? repr(*v.callable, path) : "?") + ", " + (v.args ? repr(*v.args, path) : "?");
      if (v.state) out += ", state=" + repr(*v.state, path);
      if (v.kwargs) out += ", kwargs=" + repr(*v.kwargs, path);
      if (!v.items.empty()) out += ", items=[" + join(v.items, path) + "]";
      if (!v.entries.empty()) out += ", entries={" + join_entries(v.entries, path) + "}";
      out += ")";
      break;
    case Kind::Native: out = "native"; break;
  }
  path.pop_back();
  return out;
}

std::string repr(const Value& v) {
  std::vector<const Value*> path;
  return repr(v, path);
}

// Records persistent ids and returns them wrapped, so tests can see exactly what the hook got.
class RecordingHooks : public pickle::Reconstructors {
 public:
  Value* reduce(Document&, const Value&, Value&) override { return nullptr; }
  Value* persistent_load(Document& doc, Value& pid) override {
    Value* out = doc.make(Kind::Object);
    out->callable = doc.make_global("hook", "persistent");
    out->args = doc.make(Kind::Tuple);
    out->args->items.push_back(&pid);
    return out;
  }
};

std::string parse_repr(const std::string& bytes) {
  RecordingHooks hooks;
  const Document doc = pickle::parse(bytes, &hooks);
  return repr(doc.root());
}

// The what() of the Error that parsing `bytes` throws; fails the test when nothing is thrown.
std::string parse_error(const std::string& bytes) {
  try {
    RecordingHooks hooks;
    pickle::parse(bytes, &hooks);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsing " << hex_of(bytes) << " did not fail";
  return "";
}

// ---- every opcode ---------------------------------------------------------------------------

// Python's pickle opcodes for protocols 0-5 (pickletools.opcodes: 68 of them).
struct OpcodeName {
  const char* name;
  uint8_t byte;
};
constexpr OpcodeName kAllOpcodes[] = {
    {"MARK", '('},          {"STOP", '.'},          {"POP", '0'},           {"POP_MARK", '1'},
    {"DUP", '2'},           {"FLOAT", 'F'},         {"INT", 'I'},           {"BININT", 'J'},
    {"BININT1", 'K'},       {"LONG", 'L'},          {"BININT2", 'M'},       {"NONE", 'N'},
    {"PERSID", 'P'},        {"BINPERSID", 'Q'},     {"REDUCE", 'R'},        {"STRING", 'S'},
    {"BINSTRING", 'T'},     {"SHORT_BINSTRING", 'U'}, {"UNICODE", 'V'},     {"BINUNICODE", 'X'},
    {"APPEND", 'a'},        {"BUILD", 'b'},         {"GLOBAL", 'c'},        {"DICT", 'd'},
    {"APPENDS", 'e'},       {"GET", 'g'},           {"BINGET", 'h'},        {"INST", 'i'},
    {"LONG_BINGET", 'j'},   {"LIST", 'l'},          {"EMPTY_LIST", ']'},    {"OBJ", 'o'},
    {"PUT", 'p'},           {"BINPUT", 'q'},        {"LONG_BINPUT", 'r'},   {"SETITEM", 's'},
    {"TUPLE", 't'},         {"EMPTY_TUPLE", ')'},   {"SETITEMS", 'u'},      {"BINFLOAT", 'G'},
    {"EMPTY_DICT", '}'},    {"PROTO", 0x80},        {"NEWOBJ", 0x81},       {"EXT1", 0x82},
    {"EXT2", 0x83},         {"EXT4", 0x84},         {"TUPLE1", 0x85},       {"TUPLE2", 0x86},
    {"TUPLE3", 0x87},       {"NEWTRUE", 0x88},      {"NEWFALSE", 0x89},     {"LONG1", 0x8a},
    {"LONG4", 0x8b},        {"BINBYTES", 'B'},      {"SHORT_BINBYTES", 'C'}, {"SHORT_BINUNICODE", 0x8c},
    {"BINUNICODE8", 0x8d},  {"BINBYTES8", 0x8e},    {"EMPTY_SET", 0x8f},    {"ADDITEMS", 0x90},
    {"FROZENSET", 0x91},    {"NEWOBJ_EX", 0x92},    {"STACK_GLOBAL", 0x93}, {"MEMOIZE", 0x94},
    {"FRAME", 0x95},        {"BYTEARRAY8", 0x96},   {"NEXT_BUFFER", 0x97},  {"READONLY_BUFFER", 0x98},
};

struct OpcodeCase {
  const char* name;
  uint8_t opcode;
  std::string pickle;
  std::string expected;        // repr of the root
  std::string expected_error;  // instead: parsing must fail with this substring
};

// One case per opcode; `pickle` exercises that opcode and `expected` pins down its effect.
// (Adjacent literals are split after each \x escape so no hex digit is swallowed by it.)
const std::vector<OpcodeCase>& opcode_cases() {
  static const std::vector<OpcodeCase> cases = {
      {"MARK", '(', "(K\x01" "K\x02" "t.", "(1, 2)", ""},
      {"STOP", '.', "K\x07" ".ignored after STOP", "7", ""},
      {"POP", '0', "K\x01" "K\x02" "0.", "1", ""},
      {"POP_MARK", '1', "K\x09" "(K\x01" "K\x02" "1.", "9", ""},
      {"DUP", '2', "(K\x05" "2t.", "(5, 5)", ""},
      {"FLOAT", 'F', "F-1.25\n.", "-1.25", ""},
      {"INT", 'I', "(I-42\nI01\nI00\nI+7\nt.", "(-42, True, False, 7)", ""},
      {"BININT", 'J', "J\xfe\xff\xff\xff" ".", "-2", ""},
      {"BININT1", 'K', "K\xff" ".", "255", ""},
      {"LONG", 'L', "(L-123456789012345678901234567890L\nL5\nt.", "(bigint<2ef5c0b1111f8c3c09f01671fe>, 5)", ""},
      {"BININT2", 'M', "M\xff\xfe" ".", "65279", ""},  // unsigned, little-endian
      {"NONE", 'N', "N.", "None", ""},
      {"PERSID", 'P', "Pkey7\n.", "Object(hook:persistent, ('key7',))", ""},
      {"BINPERSID", 'Q', "(" + bin_unicode("storage") + "K\x03" "tQ.", "Object(hook:persistent, (('storage', 3),))", ""},
      {"REDUCE", 'R', "cmod\nfn\n(K\x01" "tR.", "Object(mod:fn, (1,))", ""},
      {"STRING", 'S', "S'a\\nb\\x41\\'c'\n.", "'a\\x0abA'c'", ""},
      {"BINSTRING", 'T', "T\x03\x00\x00\x00" "abc."s, "'abc'", ""},
      {"SHORT_BINSTRING", 'U', "U\x02" "hi.", "'hi'", ""},
      {"UNICODE", 'V', "Vcaf\\u00e9\n.", "'caf\\xc3\\xa9'", ""},
      {"BINUNICODE", 'X', "X\x03\x00\x00\x00" "\xc3\xa9" "z."s, "'\\xc3\\xa9z'", ""},
      {"APPEND", 'a', "]K\x01" "a.", "[1]", ""},
      {"BUILD", 'b', "cmod\nCls\n)\x81}" + bin_unicode("x") + "K\x01" "sb.", "Object(mod:Cls, (), state={'x': 1})", ""},
      {"GLOBAL", 'c', "cmod.sub\nName\n.", "mod.sub:Name", ""},
      {"DICT", 'd', "(" + bin_unicode("b") + "K\x02" + bin_unicode("a") + "K\x01" "d.", "{'b': 2, 'a': 1}", ""},
      {"APPENDS", 'e', "](K\x01" "K\x02" "e.", "[1, 2]", ""},
      {"GET", 'g', "K\x07" "p3\n0g3\n.", "7", ""},
      {"BINGET", 'h', "K\x07" "q\x05" "0h\x05" ".", "7", ""},
      {"INST", 'i', "(K\x01" "imod\nCls\n.", "Object(mod:Cls, (1,))", ""},
      {"LONG_BINGET", 'j', "K\x07" "r\x00\x01\x00\x00" "0j\x00\x01\x00\x00" "."s, "7", ""},
      {"LIST", 'l', "(K\x01" "K\x02" "l.", "[1, 2]", ""},
      {"EMPTY_LIST", ']', "].", "[]", ""},
      {"OBJ", 'o', "(cmod\nCls\nK\x01" "o.", "Object(mod:Cls, (1,))", ""},
      {"PUT", 'p', "(K\x07" "p12\ng12\nt.", "(7, 7)", ""},  // PUT does not pop
      {"BINPUT", 'q', "(K\x07" "q\x01" "h\x01" "t.", "(7, 7)", ""},
      {"LONG_BINPUT", 'r', "(K\x07" "r\xff\xff\xff\xff" "j\xff\xff\xff\xff" "t.", "(7, 7)", ""},
      {"SETITEM", 's', "}" + bin_unicode("k") + "K\x01" "s.", "{'k': 1}", ""},
      {"TUPLE", 't', "((tK\x01" "t.", "((), 1)", ""},
      {"EMPTY_TUPLE", ')', ").", "()", ""},
      {"SETITEMS", 'u', "}(" + bin_unicode("b") + "K\x02" + bin_unicode("a") + "K\x01" "u.", "{'b': 2, 'a': 1}", ""},
      {"BINFLOAT", 'G', "(G\x3f\xf8\x00\x00\x00\x00\x00\x00" "G\xbf\x66\x87\x2b\x02\x0c\x49\xba" "t."s,
       "(1.5, -0.00275)", ""},  // big-endian doubles
      {"EMPTY_DICT", '}', "}.", "{}", ""},
      {"PROTO", 0x80, "\x80\x05" "N.", "None", ""},
      {"NEWOBJ", 0x81, "cmod\nCls\n(K\x01" "t\x81" ".", "Object(mod:Cls, (1,))", ""},
      {"EXT1", 0x82, "\x82\x07" ".", "<copyreg extension>:7", ""},
      {"EXT2", 0x83, "\x83\x01\x02" ".", "<copyreg extension>:513", ""},
      {"EXT4", 0x84, "\x84\x01\x00\x01\x00" "."s, "<copyreg extension>:65537", ""},
      {"TUPLE1", 0x85, "K\x01" "\x85" ".", "(1,)", ""},
      {"TUPLE2", 0x86, "K\x01" "K\x02" "\x86" ".", "(1, 2)", ""},
      {"TUPLE3", 0x87, "K\x01" "K\x02" "K\x03" "\x87" ".", "(1, 2, 3)", ""},
      {"NEWTRUE", 0x88, "\x88" ".", "True", ""},
      {"NEWFALSE", 0x89, "\x89" ".", "False", ""},
      {"LONG1", 0x8a, "(\x8a\x01\xff" "\x8a\x02\xff\x00" "\x8a\x00" "t."s, "(-1, 255, 0)", ""},
      {"LONG4", 0x8b, "\x8b\x09\x00\x00\x00" "\x00\x00\x00\x00\x00\x00\x00\x00\x01" "."s, "bigint<000000000000000001>", ""},
      {"BINBYTES", 'B', "B\x03\x00\x00\x00" "\x00\x01" "z."s, "b'\\x00\\x01z'", ""},
      {"SHORT_BINBYTES", 'C', "C\x02" "hi.", "b'hi'", ""},
      {"SHORT_BINUNICODE", 0x8c, "\x8c\x02" "hi.", "'hi'", ""},
      {"BINUNICODE8", 0x8d, "\x8d\x02\x00\x00\x00\x00\x00\x00\x00" "hi."s, "'hi'", ""},
      {"BINBYTES8", 0x8e, "\x8e\x02\x00\x00\x00\x00\x00\x00\x00" "hi."s, "b'hi'", ""},
      {"EMPTY_SET", 0x8f, "\x8f" ".", "set{}", ""},
      {"ADDITEMS", 0x90, "\x8f(K\x01" "K\x02" "\x90" ".", "set{1, 2}", ""},
      {"FROZENSET", 0x91, "(K\x01" "K\x02" "\x91" ".", "frozenset{1, 2}", ""},
      {"NEWOBJ_EX", 0x92, "cmod\nCls\n)}" + bin_unicode("k") + "K\x01" "s\x92" ".",
       "Object(mod:Cls, (), kwargs={'k': 1})", ""},
      {"STACK_GLOBAL", 0x93, "\x8c\x03" "mod\x8c\x04" "Name\x93" ".", "mod:Name", ""},
      {"MEMOIZE", 0x94, "(K\x07" "\x94h\x00" "t."s, "(7, 7)", ""},
      {"FRAME", 0x95, "\x95\x03\x00\x00\x00\x00\x00\x00\x00" "K\x01" "."s, "1", ""},
      {"BYTEARRAY8", 0x96, "\x96\x02\x00\x00\x00\x00\x00\x00\x00" "xy."s, "b'xy'", ""},
      {"NEXT_BUFFER", 0x97, "\x97" ".", "", "NEXT_BUFFER"},
      {"READONLY_BUFFER", 0x98, "C\x01" "x\x98" ".", "b'x'", ""},
  };
  return cases;
}

TEST(PickleOpcodes, TableCoversEveryOpcodeOfProtocols0To5) {
  std::set<std::string> covered;
  for (const auto& c : opcode_cases()) {
    EXPECT_TRUE(covered.insert(c.name).second) << c.name << " is listed twice";
    EXPECT_NE(c.pickle.find(static_cast<char>(c.opcode)), std::string::npos) << c.name << "'s pickle lacks its opcode";
  }
  for (const auto& op : kAllOpcodes) {
    const auto it = std::find_if(opcode_cases().begin(), opcode_cases().end(),
                                 [&](const OpcodeCase& c) { return c.name == std::string(op.name); });
    if (it == opcode_cases().end()) {
      ADD_FAILURE() << "no test case for opcode " << op.name;
      continue;
    }
    EXPECT_EQ(it->opcode, op.byte) << op.name;
  }
  EXPECT_EQ(std::size(kAllOpcodes), 68u);
  EXPECT_EQ(opcode_cases().size(), std::size(kAllOpcodes));
}

// What ctest's test list shows for a case: its opcode, not a dump of the struct's bytes.
void PrintTo(const OpcodeCase& c, std::ostream* os) { *os << c.name; }

class PickleOpcode : public ::testing::TestWithParam<OpcodeCase> {};

TEST_P(PickleOpcode, HasItsEffect) {
  const OpcodeCase& c = GetParam();
  if (!c.expected_error.empty()) {
    const std::string what = parse_error(c.pickle);
    EXPECT_NE(what.find(c.expected_error), std::string::npos) << what;
    return;
  }
  EXPECT_EQ(parse_repr(c.pickle), c.expected);
}

INSTANTIATE_TEST_SUITE_P(Pickle, PickleOpcode, ::testing::ValuesIn(opcode_cases()),
                         [](const ::testing::TestParamInfo<OpcodeCase>& info) { return std::string(info.param.name); });

// ---- semantics that are easy to get wrong --------------------------------------------------

TEST(PickleVm, MemoSharesByReference) {
  // MARK, [], BINPUT 0, BINGET 0, APPEND 1 to the *second* reference, TUPLE.
  const Document doc = pickle::parse("(]q\x00" "h\x00" "K\x01" "at."s);
  const Value& t = doc.root();
  ASSERT_EQ(t.kind, Kind::Tuple);
  ASSERT_EQ(t.items.size(), 2u);
  EXPECT_EQ(t.items[0], t.items[1]);
  ASSERT_EQ(t.items[0]->items.size(), 1u);  // the append through one reference shows through the other
  EXPECT_EQ(t.items[0]->items[0]->integer, 1);
}

TEST(PickleVm, MarkScoping) {
  EXPECT_EQ(parse_repr("(K\x01" "(K\x02" "K\x03" "tK\x04" "t."), "(1, (2, 3), 4)");
  // SETITEMS and APPENDS act on the object just below *their* mark, not below an outer one.
  EXPECT_EQ(parse_repr("(}(" + bin_unicode("a") + "K\x01" "u](K\x02" "et."), "({'a': 1}, [2])");
  EXPECT_NE(parse_error("(K\x01" "tt.").find("no MARK"), std::string::npos);
  // Ops cannot reach below the innermost mark: TUPLE2 sees only one item above it.
  EXPECT_NE(parse_error("K\x01" "(K\x02" "\x86" "t.").find("stack underflow"), std::string::npos);
}

TEST(PickleVm, DictKeepsInsertionOrderAndReplacesInPlace) {
  const std::string p = "}(" + bin_unicode("z") + "K\x01" + bin_unicode("a") + "K\x02" + bin_unicode("z") + "K\x03" "u.";
  EXPECT_EQ(parse_repr(p), "{'z': 3, 'a': 2}");  // as Python's dict: the first position, the last value
}

// A dict of `batches` x `per_batch` items {"k<i>": (i, i, [i])} written as Python's pickler
// writes one (MARK ... SETITEMS per batch), each key memoized, one shared memoized tuple as the
// value of every 100th item.
std::string batched_dict(int batches, int per_batch) {
  std::string out = "\x80\x02}q\x00"s;
  uint32_t memo = 1;
  for (int b = 0; b < batches; ++b) {
    out += "(";
    for (int j = 0; j < per_batch; ++j) {
      const int i = b * per_batch + j;
      std::string key = "k";
      key += std::to_string(i);
      out += bin_unicode(key);
      out += 'r';
      out += le32(memo++);
      if (i == 0) {
        out += "K\x07" "\x85" "q\x01";  // (7,), memo 1 (the key took 1: memo indices only grow)
        continue;
      }
      if (i % 100 == 0) {
        out += "h\x01";  // the shared tuple
        continue;
      }
      const std::string v = le32(static_cast<uint32_t>(i));
      for (const std::string& piece : {std::string("J"), v, std::string("J"), v, std::string("]J"), v, std::string("a\x87")})
        out += piece;
    }
    out += "u";
  }
  return out + ".";
}

// Collects what a streamed parse hands over, checking each value as it arrives.
struct CountingSink : pickle::RootItems {
  size_t items = 0, freed_values = 0, shared_seen = 0;
  void add(const std::vector<std::pair<Value*, Value*>>& batch) override {
    for (const auto& [k, v] : batch) {
      const int i = std::stoi(k->text.substr(1));
      if (i % 100 == 0) {
        EXPECT_EQ(v->kind, Kind::Tuple);
        EXPECT_EQ(v->items.at(0)->integer, 7) << k->text;  // the memoized tuple outlives its batch
        ++shared_seen;
      } else {
        EXPECT_EQ(v->items.at(0)->integer, i);
        EXPECT_EQ(v->items.at(2)->items.at(0)->integer, i) << k->text;
      }
      ++items;
    }
  }
  void freed(const std::vector<const Value*>& values) override { freed_values += values.size(); }
};

TEST(PickleStreaming, RootItemsArriveBatchByBatchAndTheirValuesAreFreed) {
  const std::string p = batched_dict(40, 1000);
  const Document whole = pickle::parse(p);
  ASSERT_EQ(whole.root().entries.size(), 40000u);
  CountingSink sink;
  const Document streamed = pickle::parse(p, nullptr, {}, &sink);
  EXPECT_EQ(sink.items, 40000u);
  EXPECT_EQ(sink.shared_seen, 400u);
  EXPECT_GT(sink.freed_values, 100000u);
  // Slots are reused: the arena holds a few batches' values, not the file's.
  EXPECT_LT(streamed.size(), whole.size() / 2) << streamed.size() << " of " << whole.size();
  // The root keeps its keys, each with a None placeholder.
  ASSERT_EQ(streamed.root().entries.size(), 40000u);
  EXPECT_EQ(streamed.root().entries[5].first->text, "k5");
  EXPECT_EQ(streamed.root().entries[5].second->kind, Kind::None);
}

// Concatenated piece by piece (GCC 12 warns falsely about chained + on literals, -Wrestrict).
std::string cat(std::initializer_list<std::string> pieces) {
  std::string out;
  for (const std::string& p : pieces) out += p;
  return out;
}

TEST(PickleStreaming, WhatWouldNotStreamExactlyIsRefusedForAWholeParse) {
  struct : pickle::RootItems {
    void add(const std::vector<std::pair<Value*, Value*>>&) override {}
    void freed(const std::vector<const Value*>&) override {}
  } sink;
  // A key given again in a later batch: Python keeps the later value, already handed over.
  const std::string repeated = cat({"}(", bin_unicode("a"), "K\x01", bin_unicode("b"), "K\x02", "u(", bin_unicode("a"),
                                    "K\x03", bin_unicode("c"), "K\x04", "u."});
  EXPECT_THROW(pickle::parse(repeated, nullptr, {}, &sink), pickle::NotStreamable);
  EXPECT_EQ(parse_repr(repeated), "{'a': 3, 'b': 2, 'c': 4}");
  // The streamed dict is not the result: its items belong under another path.
  const std::string wrapped = cat({"}(", bin_unicode("a"), "K\x01", bin_unicode("b"), "K\x02", "u\x85."});
  EXPECT_THROW(pickle::parse(wrapped, nullptr, {}, &sink), pickle::NotStreamable);
  // Nested dicts are not streamed: only the bottom of the stack is.
  CountingSink nested;
  const std::string inner = cat({"(}(", bin_unicode("a"), "K\x01", bin_unicode("b"), "K\x02", "ut."});
  EXPECT_EQ(repr(pickle::parse(inner, nullptr, {}, &nested).root()), "({'a': 1, 'b': 2},)");
  EXPECT_EQ(nested.items, 0u);
}

TEST(PickleVm, Long1SignExtensionAndWidth) {
  EXPECT_EQ(parse_repr("\x8a\x01\x80" "."), "-128");
  EXPECT_EQ(parse_repr("\x8a\x02\x80\x00" "."s), "128");
  EXPECT_EQ(parse_repr("\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f" "."), "9223372036854775807");
  EXPECT_EQ(parse_repr("\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80" "."s), "-9223372036854775808");
  // Redundant sign-extension bytes still fit in 64 bits.
  EXPECT_EQ(parse_repr("\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff" "."), "-1");
  // 2**63 needs a ninth byte: a BigInt, not a wrapped negative number.
  const Document big = pickle::parse("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00" "."s);
  EXPECT_EQ(big.root().kind, Kind::BigInt);
  EXPECT_EQ(hex_of(big.root().text), "000000000000008000");
  // -(2**64): negative and wider than 64 bits.
  const Document neg = pickle::parse("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xff" "."s);
  EXPECT_EQ(neg.root().kind, Kind::BigInt);
  EXPECT_THROW(neg.root().as_int(), Error);
}

TEST(PickleVm, LongTextBeyond64Bits) {
  // Python: (123456789012345678901234567890).to_bytes(13, 'little', signed=True).hex()
  EXPECT_EQ(parse_repr("L123456789012345678901234567890L\n."), "bigint<d20a3f4eeee073c3f60fe98e01>");
  EXPECT_EQ(parse_repr("L-9223372036854775808\n."), "-9223372036854775808");
  EXPECT_NE(parse_error("L12x\n.").find("malformed integer"), std::string::npos);
}

TEST(PickleVm, StackGlobalPopsNameFirst) {
  EXPECT_EQ(parse_repr("\x8c\x03" "mod\x8c\x04" "Name\x93" "."), "mod:Name");
  EXPECT_EQ(parse_repr("\x8c\x04" "Name\x8c\x03" "mod\x93" "."), "Name:mod");
  EXPECT_NE(parse_error("K\x01" "\x8c\x01" "x\x93" ".").find("STACK_GLOBAL needs two strings"), std::string::npos);
}

TEST(PickleVm, MapsPython2ModuleNames) {
  EXPECT_EQ(parse_repr("c__builtin__\nlen\n."), "builtins:len");
  EXPECT_EQ(parse_repr("ccopy_reg\n_reconstructor\n."), "copyreg:_reconstructor");
  EXPECT_EQ(parse_repr("\x8c\x0b" "__builtin__\x8c\x03" "len\x93" "."), "builtins:len");
  EXPECT_EQ(parse_repr("c__builtin__x\nlen\n."), "__builtin__x:len");  // only the exact name maps
}

TEST(PickleVm, FrameIsIgnoredAnywhere) {
  EXPECT_EQ(parse_repr("\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00" "(K\x01" "\x95\x01\x00\x00\x00\x00\x00\x00\x00" "t."s),
            "(1,)");
}

TEST(PickleVm, PersistentIdsGoToTheHook) {
  RecordingHooks hooks;
  const Document doc = pickle::parse("(Pabc\n(K\x01" "K\x02" "tQt."s, &hooks);
  EXPECT_EQ(repr(doc.root()), "(Object(hook:persistent, ('abc',)), Object(hook:persistent, ((1, 2),)))");
  // Without a hook the id is kept, inertly.
  const Document plain = pickle::parse("(K\x01" "tQ.");
  EXPECT_EQ(repr(plain.root()), "Object(<persistent_id>:, ((1,),))");
}

TEST(PickleVm, GetattrOnAGlobalNamesTheNestedClass) {
  // ShardedTensor.ProcessGroupState is pickled as getattr(ShardedTensor, 'ProcessGroupState').
  const std::string p = "c__builtin__\ngetattr\ncmod\nOuter\n" + bin_unicode("Inner") + "\x86R)\x81.";
  EXPECT_EQ(parse_repr(p), "Object(mod:Outer.Inner, ())");
}

TEST(PickleVm, EvaluatesGenericReconstructors) {
  EXPECT_EQ(parse_repr("ccollections\nOrderedDict\n)R(" + bin_unicode("z") + "K\x01" + bin_unicode("a") + "K\x02" "u."),
            "{'z': 1, 'a': 2}");
  EXPECT_EQ(parse_repr("ccollections\nOrderedDict\n](" + bin_unicode("k") + "K\x01" "\x86" "e\x85R."), "{'k': 1}");
  EXPECT_EQ(parse_repr("c__builtin__\nset\n](K\x01" "K\x02" "e\x85R."), "set{1, 2}");
  EXPECT_EQ(parse_repr("c__builtin__\nfrozenset\n](K\x03" "e\x85R."), "frozenset{3}");
  // bytes at protocol 2: _codecs.encode(<latin-1 text as UTF-8>, 'latin1').
  EXPECT_EQ(parse_repr("c_codecs\nencode\n" + bin_unicode("\x00\xc3\xbf"s) + bin_unicode("latin1") + "\x86R."),
            "b'\\x00\\xff'");
  EXPECT_EQ(parse_repr("c__builtin__\nbytes\n)R."), "b''");
  EXPECT_EQ(parse_repr("c__builtin__\nbytearray\nC\x02" "xy\x85R."), "b'xy'");
}

TEST(PickleVm, CodecsEncodeOutsideLatin1StaysOpaque) {
  // U+0100 has no latin-1 byte; another encoding would give other bytes. Neither may be guessed.
  const std::string not_latin1 = "c_codecs\nencode\n" + bin_unicode("\xc4\x80") + bin_unicode("latin1") + "\x86R.";
  EXPECT_EQ(parse_repr(not_latin1), "Object(_codecs:encode, ('\\xc4\\x80', 'latin1'))");
  const std::string utf8 = "c_codecs\nencode\n" + bin_unicode("\xc3\xa9") + bin_unicode("utf-8") + "\x86R.";
  EXPECT_EQ(parse_repr(utf8), "Object(_codecs:encode, ('\\xc3\\xa9', 'utf-8'))");
}

TEST(PickleVm, UnknownCallablesStayInertAndParsingContinues) {
  const std::string p = "(" + bin_unicode("a") + "cfoo.bar\nBaz\n(K\x01" "tR" + bin_unicode("b") + "K\x02" "d.";
  EXPECT_EQ(parse_repr(p), "{'a': Object(foo.bar:Baz, (1,)), 'b': 2}");
  // BUILD on it records the state, SETITEMS/APPENDS on it keep their items.
  const std::string q = "cfoo\nBaz\n)\x81" "(K\x01" "K\x02" "u(K\x03" "e}b.";
  EXPECT_EQ(parse_repr(q), "Object(foo:Baz, (), state={}, items=[3], entries={1: 2})");
}

TEST(PickleVm, RefusesCodeExecution) {
  const std::string system_call = "cposix\nsystem\n(" + bin_unicode("echo pwned") + "tR.";
  std::string what = parse_error(system_call);
  EXPECT_NE(what.find("posix.system"), std::string::npos) << what;
  EXPECT_NE(what.find("refusing"), std::string::npos) << what;

  what = parse_error("c__builtin__\neval\n(" + bin_unicode("1+1") + "tR.");
  EXPECT_NE(what.find("builtins.eval"), std::string::npos) << what;

  what = parse_error("\x8c\x0a" "subprocess\x8c\x05" "Popen\x93" ")\x81" ".");  // NEWOBJ
  EXPECT_NE(what.find("subprocess.Popen"), std::string::npos) << what;

  what = parse_error("(" + bin_unicode("ls") + "ios\nsystem\n.");  // INST
  EXPECT_NE(what.find("os.system"), std::string::npos) << what;

  // Naming a function is not calling it: a bare GLOBAL stays an inert reference.
  EXPECT_EQ(parse_repr("cposix\nsystem\n."), "posix:system");
}

TEST(PickleVm, CyclicStructuresAreSafe) {
  {
    const Document doc = pickle::parse("]q\x00" "h\x00" "a."s);  // l = []; l.append(l)
    const Value& l = doc.root();
    ASSERT_EQ(l.kind, Kind::List);
    ASSERT_EQ(l.items.size(), 1u);
    EXPECT_EQ(l.items[0], &l);
    EXPECT_EQ(repr(l), "[...]");
    EXPECT_TRUE(collect_tensors(l).empty());  // the collector must not loop
  }
  {
    const Document doc = pickle::parse("}q\x00"s + bin_unicode("self") + "h\x00" "s."s);  // d['self'] = d
    EXPECT_EQ(repr(doc.root()), "{'self': ...}");
    EXPECT_TRUE(collect_tensors(doc.root()).empty());
  }
}

TEST(PickleVm, PopOnAMarkDiscardsTheMark) {
  // Python: l = []; t = (l, 1); l.append(t); pickle.dumps(t, 0): the third POP removes the MARK.
  const std::string proto0 = "((lp0\n(g0\nI1\ntp1\naI1\n000g1\n.";
  const Document doc = pickle::parse(proto0);
  const Value& t = doc.root();
  ASSERT_EQ(t.kind, Kind::Tuple);
  ASSERT_EQ(t.items.size(), 2u);
  EXPECT_EQ(t.items[1]->integer, 1);
  ASSERT_EQ(t.items[0]->kind, Kind::List);
  ASSERT_EQ(t.items[0]->items.size(), 1u);
  EXPECT_EQ(repr(*t.items[0]->items[0]), "([...], 1)");
  // The same object at protocol 1 uses POP_MARK instead.
  const Document p1 = pickle::parse("(]q\x00" "(h\x00" "K\x01" "tq\x01" "aK\x01" "1h\x01" "."s);
  EXPECT_EQ(repr(p1.root()), "([...], 1)");
}

// ---- malformed input: errors carry the opcode and its byte position -------------------------

TEST(PickleErrors, NameTheOpcodeAndPosition) {
  struct Case {
    std::string pickle;
    std::string expected;  // substrings, in order, that must all occur
    std::string position;
  };
  const Case cases[] = {
      {"\x80\x02" "X\x09\x00\x00\x00" "abc"s, "runs past the end", "opcode 0x58 at byte 2"},
      {"\x80\x02" "K\x01", "truncated", "at byte 4"},
      {"K\x01" "\x86" ".", "stack underflow", "opcode 0x86 at byte 2"},
      {"K\x01" "K\x02" "e.", "no MARK", "opcode 0x65 at byte 4"},
      {"N0h\x03" ".", "memo index 3 was never stored", "opcode 0x68 at byte 2"},
      {"N\xff" ".", "unknown opcode", "opcode 0xff at byte 1"},
      {".", "STOP with an empty stack", "opcode 0x2e at byte 0"},
      {"\x80\x06" "N.", "unsupported pickle protocol 6", "opcode 0x80 at byte 0"},
      {"\x8b\xff\xff\xff\xff" ".", "negative LONG4 length", "opcode 0x8b at byte 0"},
      {"NK\x01" "R.", "REDUCE arguments are not a tuple", "opcode 0x52 at byte 3"},
      {"]K\x01" "K\x02" "s.", "SETITEM on a list", "opcode 0x73 at byte 5"},
      {"N(K\x01" "a.", "stack underflow", "opcode 0x61 at byte 4"},
      {"Iabc\n.", "malformed integer", "opcode 0x49 at byte 0"},
      {"S'unterminated\n.", "malformed STRING", "opcode 0x53 at byte 0"},
      {"S'\\x4'\n.", "malformed STRING", "opcode 0x53 at byte 0"},
      {"cmod\n", "unterminated", "opcode 0x63 at byte 0"},
  };
  for (const auto& c : cases) {
    const std::string what = parse_error(c.pickle);
    EXPECT_NE(what.find("pickle: "), std::string::npos) << what;
    EXPECT_NE(what.find(c.expected), std::string::npos) << hex_of(c.pickle) << ": " << what;
    EXPECT_NE(what.find(c.position), std::string::npos) << hex_of(c.pickle) << ": " << what;
  }
}

TEST(PickleErrors, MemoryIsBoundedByTheInputLength) {
  // One value per input byte fits a budget of sizeof(Value) per byte.
  pickle::Limits limits;
  limits.base = 0;
  limits.per_input_byte = 256;
  const std::string many_nones = std::string(10000, 'N') + ".";
  EXPECT_NO_THROW(pickle::parse(many_nones, nullptr, limits));
  limits.per_input_byte = 16;
  try {
    pickle::parse(many_nones, nullptr, limits);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("references its own data over and over"), std::string::npos) << e.what();
  }
}

// A memoized list of `n` Nones (memo 0), a callable (memo 1) and its argument tuple (memo 2),
// then `calls` times "callable(*args)" at 5 bytes each, popped right away.
std::string repeated_calls(const std::string& callable, const std::string& args, int n, int calls) {
  std::string p = "\x80\x02("s + std::string(static_cast<size_t>(n), 'N') + "lq\x00" "0"s + callable + "q\x01" "0"s + args +
                  "q\x02" "0"s;
  for (int i = 0; i < calls; ++i) p += "h\x01" "h\x02" "R0"s;
  return p + "N.";
}

TEST(PickleErrors, CopyingReconstructorsCannotAmplifyMemory) {
  // set(L) copies L's 100,000 references for 5 bytes of pickle: 400 calls would build 320 MB
  // of sets from 102 kB, past 256 bytes per input byte + 64 MiB.
  const std::string sets = repeated_calls("c__builtin__\nset\n", "h\x00\x85"s, 100000, 400);
  try {
    pickle::parse(sets);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MiB of memory for 102"), std::string::npos) << e.what();
  }
  // _codecs.encode(S, 'latin1') copies a 1 MB string the same way.
  std::string encode = "\x80\x02X\x00\x00\x10\x00"s + std::string(1 << 20, 'a') + "q\x00" "0"s +
                       "c_codecs\nencode\nq\x01" "0" "h\x00X\x06\x00\x00\x00latin1\x86q\x02" "0"s;
  for (int i = 0; i < 400; ++i) encode += "h\x01" "h\x02" "R0"s;
  EXPECT_THROW(pickle::parse(encode + "N."), Error);
  // A few copies are fine.
  EXPECT_NO_THROW(pickle::parse(repeated_calls("c__builtin__\nset\n", "h\x00\x85"s, 100000, 10)));
}

TEST(PickleVm, LargeDictsReplaceInPlaceInLinearTime) {
  // {i: None for i in range(400000)} as SETITEMS, then key 7 set again: 2.4 MB of pickle.
  // Scanning the entries for each new key took 8 * 10^10 comparisons (many minutes).
  std::string p("\x80\x02}(", 4);
  for (int32_t i = 0; i < 400000; ++i) {
    p.push_back('J');
    for (int b = 0; b < 4; ++b) p.push_back(static_cast<char>((i >> (8 * b)) & 0xFF));
    p.push_back('N');
  }
  p.append("uJ\x07\x00\x00\x00K\x01s.", 10);
  const auto start = std::chrono::steady_clock::now();
  const pickle::Document doc = pickle::parse(p);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  const auto& entries = doc.root().entries;
  ASSERT_EQ(entries.size(), 400000u);
  EXPECT_EQ(entries[7].first->integer, 7);
  EXPECT_EQ(entries[7].second->integer, 1);
  EXPECT_EQ(entries[8].second->kind, pickle::Kind::None);
  EXPECT_EQ(entries.back().first->integer, 399999);
}

TEST(PickleErrors, IntegerTextIsBoundedAsInPython) {
  // Decimal text to bytes is quadratic: CPython refuses more than 4300 digits, and so do we.
  EXPECT_NO_THROW(pickle::parse("L" + std::string(4300, '7') + "L\n."));
  const std::string what = parse_error("L" + std::string(100000, '7') + "L\n.");
  EXPECT_NE(what.find("100000 digits, more than Python's limit of 4300"), std::string::npos) << what;
}

// ---- golden pickles written by CPython -----------------------------------------------------

// Generated once with /tmp/venv/bin/python (CPython 3.11):
//   shared = [1, 2]
//   obj = {'name': 'shard',
//          'ints': [0, 255, 256, 65535, 65536, -1, 2**31-1, -2**31, 2**40, -2**63, 2**64],
//          'float': -0.5, 'nested': {'t': (1, (2, 3), []), 'none': None, 'flags': (True, False)},
//          'bytes': b'\x00\xffab', 'ba': bytearray(b'xy'), 'shared': shared, 'shared_again': shared,
//          'set': {7}, 'frozen': frozenset({8}),
//          'od': collections.OrderedDict([('z', 1), ('a', 2)])}
//   pickle.dumps(obj, protocol=P).hex()   for P in 2, 4, 5
// Protocol 2 uses GLOBAL/_codecs.encode/__builtin__ set; 4 adds FRAME, MEMOIZE, STACK_GLOBAL,
// SHORT_BINBYTES, EMPTY_SET/ADDITEMS, FROZENSET; 5 adds BYTEARRAY8.
const char* const kGoldenProtocol2 =
    "80027d71002858040000006e616d6571015805000000736861726471025804000000696e747371035d7104284b004bff4d00"
    "014dffff4a000001004affffffff4affffff7f4a000000808a060000000000018a0800000000000000808a09000000000000"
    "000001655805000000666c6f6174710547bfe000000000000058060000006e657374656471067d7107285801000000747108"
    "4b014b024b038671095d710a87710b58040000006e6f6e65710c4e5805000000666c616773710d888986710e755805000000"
    "6279746573710f635f636f646563730a656e636f64650a7110580500000000c3bf6162711158060000006c6174696e317112"
    "867113527114580200000062617115635f5f6275696c74696e5f5f0a6279746561727261790a711668105802000000787971"
    "17681286711852711985711a52711b5806000000736861726564711c5d711d284b014b0265580c0000007368617265645f61"
    "6761696e711e681d5803000000736574711f635f5f6275696c74696e5f5f0a7365740a71205d71214b076185712252712358"
    "0600000066726f7a656e7124635f5f6275696c74696e5f5f0a66726f7a656e7365740a71255d71264b086185712752712858"
    "020000006f64712963636f6c6c656374696f6e730a4f726465726564446963740a712a2952712b2858010000007a712c4b01"
    "580100000061712d4b0275752e";
const char* const kGoldenProtocol4 =
    "80049542010000000000007d94288c046e616d65948c057368617264948c04696e7473945d94284b004bff4d00014dffff4a"
    "000001004affffffff4affffff7f4a000000808a060000000000018a0800000000000000808a09000000000000000001658c"
    "05666c6f61749447bfe00000000000008c066e6573746564947d94288c0174944b014b024b0386945d9487948c046e6f6e65"
    "944e8c05666c6167739488898694758c05627974657394430400ff6162948c026261948c086275696c74696e73948c096279"
    "746561727261799493944302787994859452948c06736861726564945d94284b014b02658c0c7368617265645f616761696e"
    "9468198c03736574948f94284b07908c0666726f7a656e94284b0891948c026f64948c0b636f6c6c656374696f6e73948c0b"
    "4f72646572656444696374949394295294288c017a944b018c0161944b0275752e";
const char* const kGoldenProtocol5 =
    "8005952c010000000000007d94288c046e616d65948c057368617264948c04696e7473945d94284b004bff4d00014dffff4a"
    "000001004affffffff4affffff7f4a000000808a060000000000018a0800000000000000808a09000000000000000001658c"
    "05666c6f61749447bfe00000000000008c066e6573746564947d94288c0174944b014b024b0386945d9487948c046e6f6e65"
    "944e8c05666c6167739488898694758c05627974657394430400ff6162948c026261949602000000000000007879948c0673"
    "6861726564945d94284b014b02658c0c7368617265645f616761696e9468148c03736574948f94284b07908c0666726f7a65"
    "6e94284b0891948c026f64948c0b636f6c6c656374696f6e73948c0b4f72646572656444696374949394295294288c017a94"
    "4b018c0161944b0275752e";

const char* const kGoldenRepr =
    "{'name': 'shard', "
    "'ints': [0, 255, 256, 65535, 65536, -1, 2147483647, -2147483648, 1099511627776, -9223372036854775808, "
    "bigint<000000000000000001>], "
    "'float': -0.5, "
    "'nested': {'t': (1, (2, 3), []), 'none': None, 'flags': (True, False)}, "
    "'bytes': b'\\x00\\xffab', 'ba': b'xy', "
    "'shared': [1, 2], 'shared_again': [1, 2], "
    "'set': set{7}, 'frozen': frozenset{8}, "
    "'od': {'z': 1, 'a': 2}}";

const char* golden_pickle(int protocol) {
  return protocol == 2 ? kGoldenProtocol2 : protocol == 4 ? kGoldenProtocol4 : kGoldenProtocol5;
}

class PickleGolden : public ::testing::TestWithParam<int> {};

TEST_P(PickleGolden, MatchesWhatPythonPickled) {
  const Document doc = pickle::parse(from_hex(golden_pickle(GetParam())));
  EXPECT_EQ(repr(doc.root()), kGoldenRepr);
  // 'shared' and 'shared_again' are one list in Python: the memo must keep them one object.
  const Value* shared = doc.root().get("shared");
  ASSERT_NE(shared, nullptr);
  EXPECT_EQ(shared, doc.root().get("shared_again"));
}

INSTANTIATE_TEST_SUITE_P(Pickle, PickleGolden, ::testing::Values(2, 4, 5),
                         [](const ::testing::TestParamInfo<int>& info) { return "protocol" + std::to_string(info.param); });

}  // namespace
}  // namespace shardmerge
