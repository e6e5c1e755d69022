#include "formats/pickle.hpp"

#include <charconv>
#include <cmath>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "shardmerge/error.hpp"
#include "util/bytes.hpp"

namespace shardmerge::pickle {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::BigInt: return "int (>64 bit)";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::Tuple: return "tuple";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Set: return "set";
    case Kind::FrozenSet: return "frozenset";
    case Kind::Global: return "global";
    case Kind::Object: return "object";
    case Kind::Native: return "reconstructed value";
  }
  return "?";
}

// ---- Value ---------------------------------------------------------------------------------

bool Value::is_global(std::string_view m, std::string_view n) const {
  return kind == Kind::Global && text == m && name == n;
}

bool Value::is_instance_of(std::string_view m, std::string_view n) const {
  return kind == Kind::Object && callable && callable->is_global(m, n);
}

namespace {
Error type_error(const char* expected, const Value& v) {
  std::string found = kind_name(v.kind);
  if (v.kind == Kind::Global || (v.kind == Kind::Object && v.callable && v.callable->kind == Kind::Global)) {
    const Value& g = v.kind == Kind::Global ? v : *v.callable;
    found += " " + g.text + "." + g.name;
  }
  return Error(std::string("pickle: expected ") + expected + ", found " + found);
}
}  // namespace

int64_t Value::as_int() const {
  if (kind == Kind::Int) return integer;
  if (kind == Kind::Bool) return boolean ? 1 : 0;
  throw type_error("an int", *this);
}

double Value::as_float() const {
  if (kind == Kind::Float) return real;
  if (kind == Kind::Int) return static_cast<double>(integer);
  throw type_error("a float", *this);
}

bool Value::as_bool() const {
  if (kind == Kind::Bool) return boolean;
  if (kind == Kind::Int) return integer != 0;
  throw type_error("a bool", *this);
}

const std::string& Value::as_str() const {
  if (kind == Kind::Str) return text;
  throw type_error("a str", *this);
}

const std::vector<Value*>& Value::as_sequence() const {
  if (is_sequence()) return items;
  throw type_error("a tuple or list", *this);
}

const Value* Value::get(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k->kind == Kind::Str && k->text == key) return v;
  return nullptr;
}

// ---- Document ------------------------------------------------------------------------------

void Document::charge(uint64_t bytes) {
  if (bytes <= budget_ - charged_) {
    charged_ += bytes;
    return;
  }
  throw Error("pickle: its values need more than " + std::to_string(budget_ >> 20) + " MiB of memory for " +
              std::to_string(input_bytes_) +
              " bytes of pickle; it references its own data over and over, as no checkpoint does");
}

Value* Document::make(Kind kind) {
  charge(sizeof(Value));
  if (!free_.empty()) {
    Value* v = free_.back();
    free_.pop_back();
    v->free_slot = false;
    v->kind = kind;
    return v;
  }
  Value& v = arena_.emplace_back();
  v.kind = kind;
  return &v;
}

void Document::free_unmarked(uint32_t epoch, std::vector<const Value*>& freed) {
  for (Value& v : arena_) {
    if (v.free_slot || v.gc_epoch == epoch) continue;
    freed.push_back(&v);
    v = Value{};
    v.free_slot = true;
    free_.push_back(&v);
  }
}

Value* Document::make_str(std::string text, Kind kind) {
  charge(text.size());
  Value* v = make(kind);
  v->text = std::move(text);
  return v;
}

Value* Document::make_int(int64_t i) {
  Value* v = make(Kind::Int);
  v->integer = i;
  return v;
}

Value* Document::make_global(std::string module, std::string name) {
  charge(module.size() + name.size());  // getattr() names grow by a memoized string each time
  Value* v = make(Kind::Global);
  v->text = std::move(module);
  v->name = std::move(name);
  return v;
}

// ---- VM ------------------------------------------------------------------------------------

namespace {

// Python 2 module names that protocol-2 pickles still use (torch maps these too).
std::string map_module(std::string module) {
  if (module == "__builtin__") return "builtins";
  if (module == "copy_reg") return "copyreg";
  return module;
}

// Callables that only an attack would put in a checkpoint: calling them runs code or touches
// the system. The VM never calls anything, but a file that tries is refused outright rather
// than parsed into an inert object, so the user learns what the file is.
bool is_code_execution(const Value& g) {
  static const char* const kModules[] = {"os", "posix", "nt", "subprocess", "sys", "shutil", "socket", "pty",
                                         "importlib", "runpy", "webbrowser", "code", "ctypes", "multiprocessing",
                                         "marshal", "pickle", "_pickle", "commands", "signal"};
  static const char* const kBuiltins[] = {"eval", "exec", "compile", "open", "__import__", "setattr", "delattr",
                                          "globals", "locals", "vars", "input", "breakpoint", "exit", "quit"};
  const std::string root = g.text.substr(0, g.text.find('.'));
  for (const char* m : kModules)
    if (root == m) return true;
  if (g.text == "builtins")
    for (const char* b : kBuiltins)
      if (g.name == b) return true;
  if (g.text == "operator" && (g.name == "attrgetter" || g.name == "methodcaller")) return true;
  if (g.text == "types" && (g.name == "FunctionType" || g.name == "CodeType" || g.name == "MethodType")) return true;
  return false;
}

// Little-endian two's complement bytes -> int64 when they fit.
bool small_long(std::string_view bytes, int64_t& out) {
  if (bytes.empty()) {
    out = 0;
    return true;
  }
  // Strip redundant sign-extension bytes, then check the width.
  size_t n = bytes.size();
  const bool negative = static_cast<uint8_t>(bytes[n - 1]) & 0x80;
  const uint8_t fill = negative ? 0xFF : 0x00;
  while (n > 1 && static_cast<uint8_t>(bytes[n - 1]) == fill &&
         ((static_cast<uint8_t>(bytes[n - 2]) & 0x80) != 0) == negative)
    --n;
  if (n > 8) return false;
  uint64_t u = negative ? ~uint64_t{0} : 0;
  for (size_t i = 0; i < n; ++i) {
    u &= ~(uint64_t{0xFF} << (8 * i));
    u |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  }
  out = static_cast<int64_t>(u);
  return true;
}

// Decimal text -> little-endian two's complement bytes (for protocol-0 LONGs beyond int64).
std::string decimal_to_le_bytes(std::string_view digits, bool negative) {
  std::vector<uint8_t> mag{0};
  for (char c : digits) {
    unsigned carry = static_cast<unsigned>(c - '0');
    for (auto& b : mag) {
      unsigned v = b * 10u + carry;
      b = static_cast<uint8_t>(v & 0xFF);
      carry = v >> 8;
    }
    while (carry) {
      mag.push_back(static_cast<uint8_t>(carry & 0xFF));
      carry >>= 8;
    }
  }
  mag.push_back(0);  // room for the sign bit
  if (negative) {
    unsigned carry = 1;
    for (auto& b : mag) {
      unsigned v = static_cast<uint8_t>(~b) + carry;
      b = static_cast<uint8_t>(v & 0xFF);
      carry = v >> 8;
    }
  }
  return std::string(mag.begin(), mag.end());
}

class Machine {
 public:
  Machine(std::string_view data, Reconstructors* hooks, Document& doc, RootItems* root_items)
      : data_(data), hooks_(hooks), doc_(doc), root_items_(root_items) {}

  Value* run() {
    while (true) {
      if (pos_ >= data_.size())
        throw Error("pickle: data ends at byte " + std::to_string(pos_) + " before STOP (truncated)");
      op_pos_ = pos_;
      op_ = static_cast<uint8_t>(data_[pos_++]);
      if (op_ == '.') {  // STOP
        if (stack_.empty()) fail("STOP with an empty stack");
        if (streamed_ && stack_.back() != streamed_) throw NotStreamable{};
        return stack_.back();
      }
      step();
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", op_);
    throw Error("pickle: " + what + " (opcode " + hex + " at byte " + std::to_string(op_pos_) + ")");
  }

  // -- input ---------------------------------------------------------------------------------
  std::string_view take(uint64_t n) {
    if (n > data_.size() - pos_) fail("argument of " + std::to_string(n) + " bytes runs past the end of the data");
    std::string_view s = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  template <typename T>
  T take_le() {
    return load_le<T>(take(sizeof(T)).data());
  }
  std::string_view take_line() {
    size_t nl = data_.find('\n', pos_);
    if (nl == std::string_view::npos) fail("unterminated text argument");
    std::string_view s = data_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }

  // -- stack ---------------------------------------------------------------------------------
  void push(Value* v) { stack_.push_back(v); }
  Value* pop() {
    if (stack_.size() <= floor()) fail("stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Value* top() {
    if (stack_.size() <= floor()) fail("stack underflow");
    return stack_.back();
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops everything above the innermost MARK, and the mark itself.
  std::vector<Value*> pop_mark() {
    if (marks_.empty()) fail("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value*> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }

  Value* tuple_of(std::vector<Value*> items) {
    charge_slots(items.size());
    Value* t = doc_.make(Kind::Tuple);
    t->items = std::move(items);
    return t;
  }

  // -- memo ----------------------------------------------------------------------------------
  void memo_put(uint64_t index) { memo_[index] = top(); }
  void memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("memo index " + std::to_string(index) + " was never stored");
    push(it->second);
  }

  // -- helpers for containers ----------------------------------------------------------------
  void charge_slots(uint64_t n) { doc_.charge(n * sizeof(Value*)); }

  // SETITEM replaces the value of a str or int key already there, as Python's dict does.
  // Large containers get an index of their keys: a scan per SETITEM made n SETITEMs cost
  // n^2 / 2 comparisons (4 minutes for a 600 kB pickle). Entries are only ever appended or
  // have their value replaced, so an index extended over the entries it has not seen yet
  // stays valid whatever appended them.
  struct Key {
    Kind kind;
    std::string_view text;
    int64_t integer;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<std::string_view>{}(k.text) ^ (std::hash<int64_t>{}(k.integer) << 1) ^ static_cast<size_t>(k.kind);
    }
  };
  struct KeyIndex {
    size_t scanned = 0;  // entries[0, scanned) are in `position`
    std::unordered_map<Key, size_t, KeyHash> position;
  };
  static constexpr size_t kIndexFrom = 16;           // entries; smaller containers are scanned
  static constexpr uint64_t kIndexEntryBytes = 64;   // a hash node, charged to the memory budget

  static bool has_key_semantics(const Value* k) { return k->kind == Kind::Str || k->kind == Kind::Int; }
  static Key key_of(const Value* k) { return {k->kind, k->text, k->integer}; }

  // Position of `key` (a str or int) among `target`'s entries, or npos.
  size_t find_entry(Value* target, const Value* key) {
    const auto& entries = target->entries;
    if (entries.size() < kIndexFrom) {
      for (size_t j = 0; j < entries.size(); ++j)
        if (has_key_semantics(entries[j].first) && key_of(entries[j].first) == key_of(key)) return j;
      return std::string::npos;
    }
    KeyIndex& index = key_index_[target];
    for (; index.scanned < entries.size(); ++index.scanned)
      if (has_key_semantics(entries[index.scanned].first)) {
        doc_.charge(kIndexEntryBytes);
        index.position.try_emplace(key_of(entries[index.scanned].first), index.scanned);  // the first one wins
      }
    const auto it = index.position.find(key_of(key));
    return it == index.position.end() ? std::string::npos : it->second;
  }

  void set_items(Value* target, const std::vector<Value*>& kv) {
    if (kv.size() % 2) fail("odd number of items for SETITEMS");
    charge_slots(kv.size());
    if (target->kind != Kind::Dict && target->kind != Kind::Object) fail(std::string("SETITEM on a ") + kind_name(target->kind));
    // The outermost dict: at the bottom of the stack with no MARK below it (a pending one
    // would make it an item of something else). The streamed dict filled any other way
    // (pushed again by a memo reference) would mix kept and handed-over items.
    // (DICT fills a dict before pushing it: then the stack may be empty.)
    const bool outermost = marks_.empty() && !stack_.empty() && target == stack_.front();
    if (root_items_ && target->kind == Kind::Dict && (outermost || target == streamed_)) {
      if (!outermost) throw NotStreamable{};
      return stream_items(target, kv);
    }
    for (size_t i = 0; i < kv.size(); i += 2) {
      const size_t at = has_key_semantics(kv[i]) ? find_entry(target, kv[i]) : std::string::npos;
      if (at != std::string::npos)
        target->entries[at].second = kv[i + 1];
      else
        target->entries.emplace_back(kv[i], kv[i + 1]);
    }
  }
  // The outermost dict keeps its keys (so a repeated one is seen) with a None placeholder for
  // each value; the items go to the sink, and what only they reached is collected.
  void stream_items(Value* target, const std::vector<Value*>& kv) {
    if (streamed_ && streamed_ != target) throw NotStreamable{};  // another dict took the bottom slot
    if (!placeholder_) placeholder_ = doc_.make(Kind::None);
    std::vector<std::pair<Value*, Value*>> items;
    items.reserve(kv.size() / 2);
    for (size_t i = 0; i < kv.size(); i += 2) {
      if (has_key_semantics(kv[i]) && find_entry(target, kv[i]) != std::string::npos) throw NotStreamable{};
      target->entries.emplace_back(kv[i], placeholder_);
      items.emplace_back(kv[i], kv[i + 1]);
    }
    streamed_ = target;
    root_items_->add(items);
    // Collect when the live values have doubled since the last collection: amortised linear.
    if (doc_.live() > 2 * live_after_collection_ + (1u << 16)) collect();
  }

  // Marks what the stack and the memo reach; frees the rest.
  void collect() {
    ++epoch_;
    std::vector<const Value*> todo(stack_.begin(), stack_.end());
    for (const auto& [index, v] : memo_) todo.push_back(v);
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      if (!v || v->gc_epoch == epoch_) continue;
      const_cast<Value*>(v)->gc_epoch = epoch_;
      todo.insert(todo.end(), v->items.begin(), v->items.end());
      for (const auto& [k, x] : v->entries) {
        todo.push_back(k);
        todo.push_back(x);
      }
      for (const Value* p : {v->callable, v->args, v->kwargs, v->state}) todo.push_back(p);
      if (v->native) v->native->references(todo);
    }
    std::vector<const Value*> freed;
    doc_.free_unmarked(epoch_, freed);
    for (const Value* v : freed) key_index_.erase(v);
    root_items_->freed(freed);
    live_after_collection_ = doc_.live();
  }

  void append_items(Value* target, const std::vector<Value*>& values) {
    if (target->kind != Kind::List && target->kind != Kind::Object && target->kind != Kind::Set)
      fail(std::string("APPEND on a ") + kind_name(target->kind));
    charge_slots(values.size());
    target->items.insert(target->items.end(), values.begin(), values.end());
  }

  Value* global(std::string module, std::string name) {
    return doc_.make_global(map_module(std::move(module)), std::move(name));
  }

  // REDUCE/NEWOBJ: evaluate the allowlist, otherwise build an inert Object.
  Value* call(Value* callable, Value* args) {
    if (callable->kind == Kind::Global) {
      if (is_code_execution(*callable))
        fail("it calls " + callable->text + "." + callable->name +
             ", which no checkpoint needs: refusing the file (it looks like an attempt to run code)");
      if (Value* v = builtin_reduce(*callable, *args)) {
        // A dict built by OrderedDict() keeps its class, so a writer can emit it as one again.
        if (v->kind == Kind::Dict && callable->name == "OrderedDict") v->callable = callable;
        return v;
      }
      if (hooks_) {
        if (Value* v = hooks_->reduce(doc_, *callable, *args)) return v;
      }
    }
    Value* obj = doc_.make(Kind::Object);
    obj->callable = callable;
    obj->args = args;
    return obj;
  }

  // Generic Python reconstructors that are data, not code.
  Value* builtin_reduce(const Value& g, Value& args) {
    const auto& a = args.items;
    if (args.kind != Kind::Tuple) return nullptr;
    if (g.is_global("collections", "OrderedDict") || g.is_global("builtins", "dict")) {
      Value* d = doc_.make(Kind::Dict);
      if (!a.empty() && a[0]->is_sequence()) {
        charge_slots(2 * a[0]->items.size());
        for (Value* pair : a[0]->items)
          if (pair->is_sequence() && pair->items.size() == 2) d->entries.emplace_back(pair->items[0], pair->items[1]);
      }
      return d;
    }
    if (g.is_global("builtins", "set") || g.is_global("builtins", "frozenset")) {
      Value* s = doc_.make(g.name == "set" ? Kind::Set : Kind::FrozenSet);
      if (!a.empty() && (a[0]->is_sequence() || a[0]->kind == Kind::Set)) {
        charge_slots(a[0]->items.size());
        s->items = a[0]->items;
      }
      return s;
    }
    if (g.is_global("_codecs", "encode") && a.size() == 2 && a[0]->kind == Kind::Str && a[1]->kind == Kind::Str &&
        (a[1]->text == "latin1" || a[1]->text == "latin-1")) {
      // bytes pickled at protocol 2: the latin-1 text of the bytes, re-encoded. Other encodings
      // are not what Python writes for bytes, so they stay opaque rather than guessed at.
      std::string out;
      const std::string& s = a[0]->text;
      for (size_t i = 0; i < s.size(); ++i) {
        auto c = static_cast<uint8_t>(s[i]);
        if (c < 0x80) {
          out.push_back(static_cast<char>(c));
        } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s.size() &&
                   (static_cast<uint8_t>(s[i + 1]) & 0xC0) == 0x80) {  // U+0080..U+00FF as UTF-8
          out.push_back(static_cast<char>(((c & 0x1F) << 6) | (static_cast<uint8_t>(s[++i]) & 0x3F)));
        } else {
          return nullptr;  // not latin-1 text: leave it opaque
        }
      }
      return doc_.make_str(std::move(out), Kind::Bytes);
    }
    if (g.is_global("builtins", "bytes") || g.is_global("builtins", "bytearray")) {
      if (a.empty()) return doc_.make_str("", Kind::Bytes);
      if (a[0]->kind == Kind::Bytes) return doc_.make_str(a[0]->text, Kind::Bytes);
      return nullptr;
    }
    if (g.is_global("builtins", "getattr") && a.size() == 2 && a[0]->kind == Kind::Global && a[1]->kind == Kind::Str) {
      // Nested classes (ShardedTensor.ProcessGroupState): a name, not a call.
      return doc_.make_global(a[0]->text, a[0]->name + "." + a[1]->text);
    }
    return nullptr;
  }

  Value* persistent(Value* pid) {
    if (hooks_)
      if (Value* v = hooks_->persistent_load(doc_, *pid)) return v;
    Value* obj = doc_.make(Kind::Object);
    obj->callable = doc_.make_global("<persistent_id>", "");
    obj->args = tuple_of({pid});
    return obj;
  }

  void step();

  std::string_view data_;
  Reconstructors* hooks_;
  Document& doc_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  uint8_t op_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
  std::unordered_map<const Value*, KeyIndex> key_index_;
  RootItems* root_items_ = nullptr;
  Value* streamed_ = nullptr;     // the dict whose items went to root_items_
  Value* placeholder_ = nullptr;  // its values' stand-in
  uint32_t epoch_ = 0;
  size_t live_after_collection_ = 0;
};

// Parses the quoted Python repr used by protocol-0 STRING.
std::string unquote_repr(std::string_view s, bool& ok) {
  ok = false;
  if (s.size() < 2 || (s.front() != '\'' && s.front() != '"') || s.back() != s.front()) return {};
  s = s.substr(1, s.size() - 2);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out.push_back(s[i]);
      continue;
    }
    if (++i >= s.size()) return {};
    char c = s[i];
    switch (c) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case '\\': case '\'': case '"': out.push_back(c); break;
      case 'x': {
        if (i + 2 >= s.size()) return {};  // needs two hex digits
        unsigned v = 0;
        auto r = std::from_chars(s.data() + i + 1, s.data() + i + 3, v, 16);
        if (r.ptr != s.data() + i + 3) return {};
        out.push_back(static_cast<char>(v));
        i += 2;
        break;
      }
      default:
        if (c >= '0' && c <= '7') {
          unsigned v = 0;
          size_t j = i;
          while (j < s.size() && j < i + 3 && s[j] >= '0' && s[j] <= '7') v = v * 8 + static_cast<unsigned>(s[j++] - '0');
          out.push_back(static_cast<char>(v & 0xFF));
          i = j - 1;
        } else {
          out.push_back('\\');
          out.push_back(c);
        }
    }
  }
  ok = true;
  return out;
}

// raw-unicode-escape (protocol-0 UNICODE): \uXXXX and \UXXXXXXXX, everything else latin-1.
bool append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x110000) {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    return false;
  }
  return true;
}

bool decode_raw_unicode_escape(std::string_view s, std::string& out) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == 'u' || s[i + 1] == 'U')) {
      size_t digits = s[i + 1] == 'u' ? 4 : 8;
      if (i + 2 + digits > s.size()) return false;
      uint32_t cp = 0;
      auto r = std::from_chars(s.data() + i + 2, s.data() + i + 2 + digits, cp, 16);
      if (r.ptr != s.data() + i + 2 + digits || !append_utf8(out, cp)) return false;
      i += 1 + digits;
    } else {
      append_utf8(out, static_cast<uint8_t>(s[i]));
    }
  }
  return true;
}

void Machine::step() {
  switch (op_) {
    // ---- framing and protocol
    case 0x80: {  // PROTO
      uint8_t proto = take_le<uint8_t>();
      if (proto > 5) fail("unsupported pickle protocol " + std::to_string(proto));
      break;
    }
    case 0x95: take(8); break;  // FRAME: a read-ahead hint only

    // ---- marks and stack
    case '(': marks_.push_back(stack_.size()); break;  // MARK
    case '0':  // POP: the top item, or a MARK when nothing is above it (protocol-0 recursive tuples)
      if (!marks_.empty() && stack_.size() == marks_.back())
        marks_.pop_back();
      else
        pop();
      break;
    case '1': pop_mark(); break;                       // POP_MARK
    case '2': push(top()); break;                      // DUP

    // ---- constants
    case 'N': push(doc_.make(Kind::None)); break;
    case 0x88: case 0x89: {  // NEWTRUE / NEWFALSE
      Value* v = doc_.make(Kind::Bool);
      v->boolean = op_ == 0x88;
      push(v);
      break;
    }

    // ---- integers
    case 'J': push(doc_.make_int(take_le<int32_t>())); break;   // BININT
    case 'K': push(doc_.make_int(take_le<uint8_t>())); break;   // BININT1
    case 'M': push(doc_.make_int(take_le<uint16_t>())); break;  // BININT2
    case 0x8a: case 0x8b: {  // LONG1 / LONG4
      uint64_t n;
      if (op_ == 0x8a) {
        n = take_le<uint8_t>();
      } else {
        int32_t n4 = take_le<int32_t>();
        if (n4 < 0) fail("negative LONG4 length");
        n = static_cast<uint64_t>(n4);
      }
      std::string_view bytes = take(n);
      int64_t small;
      if (small_long(bytes, small)) {
        push(doc_.make_int(small));
      } else {
        push(doc_.make_str(std::string(bytes), Kind::BigInt));
      }
      break;
    }
    case 'I': case 'L': {  // INT / LONG (text)
      std::string_view line = take_line();
      if (op_ == 'I' && line == "00") {
        Value* v = doc_.make(Kind::Bool);
        push(v);
        break;
      }
      if (op_ == 'I' && line == "01") {
        Value* v = doc_.make(Kind::Bool);
        v->boolean = true;
        push(v);
        break;
      }
      if (op_ == 'L' && !line.empty() && line.back() == 'L') line.remove_suffix(1);
      bool negative = !line.empty() && line.front() == '-';
      std::string_view digits = line.substr(negative || (!line.empty() && line.front() == '+') ? 1 : 0);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos)
        fail("malformed integer text '" + std::string(line.substr(0, 64)) + "'");
      // CPython's int() refuses more digits than this (sys.int_info.default_max_str_digits),
      // so its unpickler does too; the conversion below takes time quadratic in the digits.
      constexpr size_t kMaxDigits = 4300;
      if (digits.size() > kMaxDigits)
        fail("integer text of " + std::to_string(digits.size()) + " digits, more than Python's limit of " +
             std::to_string(kMaxDigits));
      int64_t v = 0;
      auto r = std::from_chars(line.data() + (line.front() == '+' ? 1 : 0), line.data() + line.size(), v);
      if (r.ec == std::errc() && r.ptr == line.data() + line.size()) {
        push(doc_.make_int(v));
      } else {
        push(doc_.make_str(decimal_to_le_bytes(digits, negative), Kind::BigInt));
      }
      break;
    }

    // ---- floats
    case 'G': {  // BINFLOAT: big-endian double
      std::string_view b = take(8);
      uint64_t u = 0;
      for (char c : b) u = (u << 8) | static_cast<uint8_t>(c);
      Value* v = doc_.make(Kind::Float);
      std::memcpy(&v->real, &u, sizeof u);
      push(v);
      break;
    }
    case 'F': {  // FLOAT (text)
      std::string line(take_line());
      char* end = nullptr;
      double d = std::strtod(line.c_str(), &end);
      if (line.empty() || end != line.c_str() + line.size()) fail("malformed float text '" + line + "'");
      Value* v = doc_.make(Kind::Float);
      v->real = d;
      push(v);
      break;
    }

    // ---- strings and bytes
    case 'X': push(doc_.make_str(std::string(take(take_le<uint32_t>())))); break;  // BINUNICODE
    case 0x8c: push(doc_.make_str(std::string(take(take_le<uint8_t>())))); break;  // SHORT_BINUNICODE
    case 0x8d: push(doc_.make_str(std::string(take(take_le<uint64_t>())))); break;  // BINUNICODE8
    case 'T': {  // BINSTRING (py2 str)
      int32_t n = take_le<int32_t>();
      if (n < 0) fail("negative BINSTRING length");
      push(doc_.make_str(std::string(take(static_cast<uint64_t>(n)))));
      break;
    }
    case 'U': push(doc_.make_str(std::string(take(take_le<uint8_t>())))); break;  // SHORT_BINSTRING
    case 'B': push(doc_.make_str(std::string(take(take_le<uint32_t>())), Kind::Bytes)); break;  // BINBYTES
    case 'C': push(doc_.make_str(std::string(take(take_le<uint8_t>())), Kind::Bytes)); break;   // SHORT_BINBYTES
    case 0x8e: case 0x96:  // BINBYTES8 / BYTEARRAY8
      push(doc_.make_str(std::string(take(take_le<uint64_t>())), Kind::Bytes));
      break;
    case 'S': {  // STRING (quoted repr)
      bool ok = false;
      std::string s = unquote_repr(take_line(), ok);
      if (!ok) fail("malformed STRING argument");
      push(doc_.make_str(std::move(s)));
      break;
    }
    case 'V': {  // UNICODE (raw-unicode-escape)
      std::string s;
      if (!decode_raw_unicode_escape(take_line(), s)) fail("malformed UNICODE argument");
      push(doc_.make_str(std::move(s)));
      break;
    }

    // ---- containers
    case ')': push(doc_.make(Kind::Tuple)); break;  // EMPTY_TUPLE
    case 't': push(tuple_of(pop_mark())); break;    // TUPLE
    case 0x85: push(tuple_of({pop()})); break;      // TUPLE1
    case 0x86: {                                    // TUPLE2
      Value* b = pop();
      Value* a = pop();
      push(tuple_of({a, b}));
      break;
    }
    case 0x87: {  // TUPLE3
      Value* c = pop();
      Value* b = pop();
      Value* a = pop();
      push(tuple_of({a, b, c}));
      break;
    }
    case ']': push(doc_.make(Kind::List)); break;  // EMPTY_LIST
    case 'l': {                                    // LIST
      Value* l = doc_.make(Kind::List);
      l->items = pop_mark();
      charge_slots(l->items.size());
      push(l);
      break;
    }
    case 'a': {  // APPEND
      Value* v = pop();
      append_items(top(), {v});
      break;
    }
    case 'e': {  // APPENDS
      std::vector<Value*> items = pop_mark();
      append_items(top(), items);
      break;
    }
    case '}': push(doc_.make(Kind::Dict)); break;  // EMPTY_DICT
    case 'd': {                                    // DICT
      Value* d = doc_.make(Kind::Dict);
      set_items(d, pop_mark());
      push(d);
      break;
    }
    case 's': {  // SETITEM
      Value* v = pop();
      Value* k = pop();
      set_items(top(), {k, v});
      break;
    }
    case 'u': {  // SETITEMS
      std::vector<Value*> kv = pop_mark();
      set_items(top(), kv);
      break;
    }
    case 0x8f: push(doc_.make(Kind::Set)); break;  // EMPTY_SET
    case 0x90: {                                   // ADDITEMS
      std::vector<Value*> items = pop_mark();
      Value* s = top();
      if (s->kind != Kind::Set) fail(std::string("ADDITEMS on a ") + kind_name(s->kind));
      charge_slots(items.size());
      s->items.insert(s->items.end(), items.begin(), items.end());
      break;
    }
    case 0x91: {  // FROZENSET
      Value* s = doc_.make(Kind::FrozenSet);
      s->items = pop_mark();
      charge_slots(s->items.size());
      push(s);
      break;
    }

    // ---- memo
    case 'q': memo_put(take_le<uint8_t>()); break;     // BINPUT
    case 'r': memo_put(take_le<uint32_t>()); break;    // LONG_BINPUT
    case 0x94: memo_put(memo_.size()); break;          // MEMOIZE
    case 'h': memo_get(take_le<uint8_t>()); break;     // BINGET
    case 'j': memo_get(take_le<uint32_t>()); break;    // LONG_BINGET
    case 'p': case 'g': {                              // PUT / GET (text)
      std::string_view line = take_line();
      uint64_t index = 0;
      auto r = std::from_chars(line.data(), line.data() + line.size(), index);
      if (r.ec != std::errc() || r.ptr != line.data() + line.size()) fail("malformed memo index");
      if (op_ == 'p') memo_put(index); else memo_get(index);
      break;
    }

    // ---- classes and calls (all inert unless allowlisted)
    case 'c': {  // GLOBAL
      std::string module(take_line());
      std::string name(take_line());
      push(global(std::move(module), std::move(name)));
      break;
    }
    case 0x93: {  // STACK_GLOBAL
      Value* name = pop();
      Value* module = pop();
      if (module->kind != Kind::Str || name->kind != Kind::Str) fail("STACK_GLOBAL needs two strings");
      push(global(module->text, name->text));
      break;
    }
    case 'R': {  // REDUCE
      Value* args = pop();
      Value* callable = pop();
      if (args->kind != Kind::Tuple) fail("REDUCE arguments are not a tuple");
      push(call(callable, args));
      break;
    }
    case 0x81: {  // NEWOBJ
      Value* args = pop();
      Value* cls = pop();
      if (args->kind != Kind::Tuple) fail("NEWOBJ arguments are not a tuple");
      push(call(cls, args));
      break;
    }
    case 0x92: {  // NEWOBJ_EX
      Value* kwargs = pop();
      Value* args = pop();
      Value* cls = pop();
      if (args->kind != Kind::Tuple) fail("NEWOBJ_EX arguments are not a tuple");
      Value* obj = call(cls, args);
      if (obj->kind == Kind::Object) obj->kwargs = kwargs;
      push(obj);
      break;
    }
    case 'i': {  // INST
      std::string module(take_line());
      std::string name(take_line());
      Value* args = tuple_of(pop_mark());
      push(call(global(std::move(module), std::move(name)), args));
      break;
    }
    case 'o': {  // OBJ
      std::vector<Value*> items = pop_mark();
      if (items.empty()) fail("OBJ without a class");
      Value* cls = items.front();
      items.erase(items.begin());
      push(call(cls, tuple_of(std::move(items))));
      break;
    }
    case 'b': {  // BUILD: record the state; nothing is executed
      Value* state = pop();
      Value* target = top();
      if (target->state && target->state->kind == Kind::Dict && state->kind == Kind::Dict) {
        charge_slots(2 * state->entries.size());
        for (auto& e : state->entries) target->state->entries.push_back(e);
      } else {
        target->state = state;
      }
      break;
    }
    case 0x82: case 0x83: case 0x84: {  // EXT1 / EXT2 / EXT4: copyreg extension codes
      int64_t code = op_ == 0x82 ? take_le<uint8_t>() : op_ == 0x83 ? take_le<uint16_t>() : take_le<int32_t>();
      push(doc_.make_global("<copyreg extension>", std::to_string(code)));
      break;
    }

    // ---- persistent ids (torch storages)
    case 'Q': push(persistent(pop())); break;  // BINPERSID
    case 'P': push(persistent(doc_.make_str(std::string(take_line())))); break;  // PERSID

    // ---- out-of-band buffers never occur in files
    case 0x97: fail("NEXT_BUFFER (out-of-band buffer) is not supported in files");
    case 0x98: top(); break;  // READONLY_BUFFER: a flag on the buffer on top

    default: fail("unknown opcode");
  }
}

}  // namespace

Document parse(std::string_view data, Reconstructors* hooks, const Limits& limits, RootItems* root_items) {
  Document doc;
  doc.input_bytes_ = data.size();
  if (__builtin_mul_overflow(static_cast<uint64_t>(data.size()), limits.per_input_byte, &doc.budget_) ||
      __builtin_add_overflow(doc.budget_, limits.base, &doc.budget_))
    doc.budget_ = UINT64_MAX;
  Machine vm(data, hooks, doc, root_items);
  doc.root_ = vm.run();
  return doc;
}

}  // namespace shardmerge::pickle
