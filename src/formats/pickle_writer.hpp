// Emits pickle protocol 2, opcode by opcode: enough to write torch.save state dicts (plain
// tensors and DTensors) that torch itself loads. Used by the synthetic checkpoint generator
// and by tests; the reader never depends on it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shardmerge::pickle {

class Writer {
 public:
  Writer();  // starts with PROTO 2

  Writer& mark();
  Writer& none();
  Writer& boolean(bool v);
  Writer& integer(int64_t v);
  Writer& big_integer(std::string_view le_bytes);  // LONG1/LONG4: little-endian two's complement
  Writer& real(double v);                           // BINFLOAT: exact (8-byte IEEE double)
  Writer& bytes(std::string_view b);                // BINBYTES (a protocol-3 opcode Python reads at any protocol)
  Writer& str(std::string_view s);
  Writer& global(std::string_view module, std::string_view name);
  Writer& empty_tuple();
  Writer& tuple();              // MARK ... TUPLE
  Writer& tuple(size_t n);      // TUPLE1/2/3 for n <= 3
  Writer& int_tuple(const std::vector<int64_t>& v);
  Writer& empty_list();
  Writer& empty_dict();
  Writer& append();
  Writer& appends();
  Writer& setitem();
  Writer& setitems();
  Writer& reduce();
  Writer& newobj();
  Writer& build();
  Writer& binpersid();
  uint32_t put();               // memoizes the top of the stack, returns its index
  Writer& get(uint32_t index);
  std::string finish();         // STOP; returns the bytes

 private:
  Writer& op(uint8_t code);
  std::string out_;
  uint32_t next_memo_ = 0;
};

}  // namespace shardmerge::pickle
