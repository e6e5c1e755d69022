// A restricted pickle virtual machine (protocols 0-5, every opcode). It never imports or
// calls anything: GLOBALs become inert Global values, and REDUCE/NEWOBJ/BUILD of callables
// build inert Object values, so parsing goes on past unknown classes and data nested anywhere
// is still found. A small, explicit allowlist of reconstructors is evaluated instead of being
// left opaque: the generic Python ones here (OrderedDict, set, frozenset, bytes, bytearray,
// _codecs.encode, getattr on a Global), and whatever a `Reconstructors` hook adds (torch's).
//
// Values live in an arena owned by the Document; references between them are plain
// pointers, so memo sharing and even reference cycles are cheap and safe to destroy. A parse
// may hand the items of its outermost dict to a RootItems sink as they arrive (a state dict of
// 100k tensors is about 7M values): the values no memo entry or stack slot can reach are then
// freed and their slots reused, so memory follows one batch of items, not the whole file.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shardmerge::pickle {

enum class Kind : uint8_t {
  None,
  Bool,
  Int,     // fits int64
  BigInt,  // wider integers: `text` holds the little-endian two's-complement bytes
  Float,
  Str,
  Bytes,
  Tuple,
  List,
  Dict,
  Set,
  FrozenSet,
  Global,  // a class or function reference: module + name, never resolved
  Object,  // an instance built by NEWOBJ/REDUCE/INST/OBJ of a callable we do not evaluate
  Native,  // a value built by an allowlisted reconstructor (see Reconstructors)
};

const char* kind_name(Kind k);

// Payload of a Native value; reconstructor hooks define their own subclasses.
struct Native {
  virtual ~Native() = default;
  // The values this payload points to (kept alive while it is).
  virtual void references(std::vector<const struct Value*>&) const {}
};

struct Value {
  Kind kind = Kind::None;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;                                   // Str, Bytes, BigInt bytes, Global module
  std::string name;                                   // Global name
  std::vector<Value*> items;                          // Tuple, List, Set, FrozenSet; APPENDs on an Object
  std::vector<std::pair<Value*, Value*>> entries;     // Dict; SETITEMs on an Object
  Value* callable = nullptr;                          // Object: the class or function; Dict: OrderedDict when built by it
  Value* args = nullptr;                              // Object: its argument tuple
  Value* kwargs = nullptr;                            // Object: NEWOBJ_EX keyword arguments
  Value* state = nullptr;                             // BUILD state (any kind)
  std::unique_ptr<Native> native;                     // Native payload
  uint32_t gc_epoch = 0;   // the last collection that found it reachable
  bool free_slot = false;  // freed by a collection; make() reuses it

  bool is(Kind k) const { return kind == k; }
  bool is_global(std::string_view module, std::string_view name) const;
  bool is_sequence() const { return kind == Kind::Tuple || kind == Kind::List; }
  // An Object whose class is the given Global.
  bool is_instance_of(std::string_view module, std::string_view name) const;

  // Checked accessors: throw an Error that names what was expected and what was found.
  int64_t as_int() const;
  double as_float() const;  // Int or Float
  bool as_bool() const;
  const std::string& as_str() const;
  const std::vector<Value*>& as_sequence() const;  // Tuple or List

  // Dict lookup by string key (also works on an Object's SETITEMs); nullptr when absent.
  const Value* get(std::string_view key) const;

  template <typename T>
  const T* native_as() const {
    return kind == Kind::Native ? dynamic_cast<const T*>(native.get()) : nullptr;
  }
};

class Document;

// Receives the items of the dict at the bottom of the VM's stack (what torch.save pickles: the
// state dict) as each SETITEM(S) adds them, instead of the dict keeping them. Values handed to
// add() may be freed once it returns, and their addresses reused: freed() names them.
class RootItems {
 public:
  virtual ~RootItems() = default;
  virtual void add(const std::vector<std::pair<Value*, Value*>>& items) = 0;
  virtual void freed(const std::vector<const Value*>& values) = 0;
};

// Thrown by parse() with a RootItems sink when the pickle is not one that streams exactly: a
// key of the outermost dict given twice (the later value would have replaced the one already
// handed over), or a result that is not that dict. Parse it again without a sink.
struct NotStreamable {};

// The allowlist extension point. Each hook returns the value to push, or nullptr to leave
// the operation opaque (an inert Object). Hooks must not execute anything either.
class Reconstructors {
 public:
  virtual ~Reconstructors() = default;
  virtual Value* reduce(Document& doc, const Value& callable, Value& args) = 0;
  // BINPERSID/PERSID: the default is an inert Object wrapping the id.
  virtual Value* persistent_load(Document& doc, Value& pid) = 0;
};

// Memory the VM may allocate for the values it builds: `per_input_byte` times the pickle's
// length, plus `base`. Every opcode reads at least one byte and builds at most one value
// (sizeof(Value), under 200 bytes) or moves one reference into a container, so a real pickle
// stays far below this; what it stops is a few bytes of memo references making a
// reconstructor copy a large container or string over and over (memory quadratic in the
// input). Values, string bytes and container slots are counted; the VM's stack and memo
// grow by at most one slot per input byte and are not.
struct Limits {
  uint64_t per_input_byte = 256;
  uint64_t base = 64ull << 20;
};

class Document {
 public:
  Document() = default;
  Document(Document&&) = default;
  Document& operator=(Document&&) = default;

  const Value& root() const { return *root_; }
  Value* make(Kind kind);
  Value* make_str(std::string text, Kind kind = Kind::Str);
  Value* make_int(int64_t v);
  Value* make_global(std::string module, std::string name);
  size_t size() const { return arena_.size(); }
  size_t live() const { return arena_.size() - free_.size(); }
  // The VM's collection: frees every value whose gc_epoch is not `epoch` (appending its
  // address to `freed`); make() reuses the slots.
  void free_unmarked(uint32_t epoch, std::vector<const Value*>& freed);
  // Counts `bytes` against the memory budget, before they are allocated; throws past it.
  // Reconstructor hooks call it for what they copy.
  void charge(uint64_t bytes);

 private:
  friend Document parse(std::string_view, Reconstructors*, const Limits&, RootItems*);
  std::deque<Value> arena_;
  std::vector<Value*> free_;
  Value* root_ = nullptr;
  uint64_t budget_ = UINT64_MAX;  // set by parse() from Limits and the input length
  uint64_t charged_ = 0;
  uint64_t input_bytes_ = 0;
};

// Runs the VM over one pickle (up to and including STOP). Throws Error("pickle: ...") with
// the opcode and byte position on malformed input, and when its values outgrow `limits`.
// With `root_items`, the outermost dict's items go there (see RootItems, NotStreamable).
Document parse(std::string_view data, Reconstructors* hooks = nullptr, const Limits& limits = {},
               RootItems* root_items = nullptr);

}  // namespace shardmerge::pickle
