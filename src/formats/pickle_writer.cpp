#include "formats/pickle_writer.hpp"

#include <cstring>

#include "util/bytes.hpp"

namespace shardmerge::pickle {

Writer::Writer() {
  out_.push_back(static_cast<char>(0x80));
  out_.push_back(2);
}

Writer& Writer::op(uint8_t code) {
  out_.push_back(static_cast<char>(code));
  return *this;
}

Writer& Writer::mark() { return op('('); }
Writer& Writer::none() { return op('N'); }
Writer& Writer::boolean(bool v) { return op(v ? 0x88 : 0x89); }

Writer& Writer::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    op('K');
    out_.push_back(static_cast<char>(v));
  } else if (v >= 0 && v < 65536) {
    op('M');
    append_le<uint16_t>(out_, static_cast<uint16_t>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op('J');
    append_le<int32_t>(out_, static_cast<int32_t>(v));
  } else {
    op(0x8a);  // LONG1: 8-byte two's complement is always enough
    out_.push_back(8);
    append_le<int64_t>(out_, v);
  }
  return *this;
}

Writer& Writer::big_integer(std::string_view le_bytes) {
  if (le_bytes.size() < 256) {
    op(0x8a);
    out_.push_back(static_cast<char>(le_bytes.size()));
  } else {
    op(0x8b);
    append_le<uint32_t>(out_, static_cast<uint32_t>(le_bytes.size()));
  }
  out_.append(le_bytes);
  return *this;
}

Writer& Writer::real(double v) {
  op('G');
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int shift = 56; shift >= 0; shift -= 8) out_.push_back(static_cast<char>(bits >> shift));  // big-endian
  return *this;
}

Writer& Writer::bytes(std::string_view b) {
  op('B');
  append_le<uint32_t>(out_, static_cast<uint32_t>(b.size()));
  out_.append(b);
  return *this;
}

Writer& Writer::str(std::string_view s) {
  op('X');
  append_le<uint32_t>(out_, static_cast<uint32_t>(s.size()));
  out_.append(s);
  return *this;
}

Writer& Writer::global(std::string_view module, std::string_view name) {
  op('c');
  out_.append(module);
  out_.push_back('\n');
  out_.append(name);
  out_.push_back('\n');
  return *this;
}

Writer& Writer::empty_tuple() { return op(')'); }
Writer& Writer::tuple() { return op('t'); }
Writer& Writer::tuple(size_t n) {
  if (n == 0) return empty_tuple();
  return op(static_cast<uint8_t>(0x84 + n));  // TUPLE1 0x85, TUPLE2 0x86, TUPLE3 0x87
}
Writer& Writer::int_tuple(const std::vector<int64_t>& v) {
  if (v.size() <= 3) {
    for (int64_t x : v) integer(x);
    return tuple(v.size());
  }
  mark();
  for (int64_t x : v) integer(x);
  return tuple();
}
Writer& Writer::empty_list() { return op(']'); }
Writer& Writer::empty_dict() { return op('}'); }
Writer& Writer::append() { return op('a'); }
Writer& Writer::appends() { return op('e'); }
Writer& Writer::setitem() { return op('s'); }
Writer& Writer::setitems() { return op('u'); }
Writer& Writer::reduce() { return op('R'); }
Writer& Writer::newobj() { return op(0x81); }
Writer& Writer::build() { return op('b'); }
Writer& Writer::binpersid() { return op('Q'); }

uint32_t Writer::put() {
  const uint32_t index = next_memo_++;
  if (index < 256) {
    op('q');
    out_.push_back(static_cast<char>(index));
  } else {
    op('r');
    append_le<uint32_t>(out_, index);
  }
  return index;
}

Writer& Writer::get(uint32_t index) {
  if (index < 256) {
    op('h');
    out_.push_back(static_cast<char>(index));
  } else {
    op('j');
    append_le<uint32_t>(out_, index);
  }
  return *this;
}

std::string Writer::finish() {
  op('.');
  return std::move(out_);
}

}  // namespace shardmerge::pickle
