#include "plan/peft_names.hpp"

#include <algorithm>
#include <unordered_map>

#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    size_t dot = s.find('.', pos);
    out.push_back(s.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
    if (dot == std::string::npos) return out;
    pos = dot + 1;
  }
}

std::string join_dots(const std::vector<std::string>& parts, size_t begin, size_t end) {
  std::string s;
  for (size_t i = begin; i < end; ++i) s += (i > begin ? "." : "") + parts[i];
  return s;
}

// Parameter names of PEFT methods other than LoRA, which a LoRA fold would silently ignore.
bool is_other_peft_param(const std::string& part) {
  for (const char* prefix : {"ia3_", "hada_", "lokr_", "vera_", "oft_", "boft_", "fourierft_", "hra_", "bone_"})
    if (part.rfind(prefix, 0) == 0) return true;
  return part == "lora_magnitude_vector" || part == "lora_E" || part == "ranknum";
}

class Splitter {
 public:
  explicit Splitter(PeftSplit& out) : out_(out) {
    for (size_t i = 0; i < out_.lora.size(); ++i) lora_index_[out_.lora[i].module] = i;
    for (size_t i = 0; i < out_.base.size(); ++i) base_index_[out_.base[i].first] = i;
  }

  // `with_adapter_segment`: whether LoRA names carry the adapter name ("lora_A.default.weight").
  void add(const SourceTensor& t, bool with_adapter_segment) {
    std::string name = strip_wrapper_segments(t.name);
    const std::string prefix = "base_model.model.";
    if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
    const auto parts = split_dots(name);
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::string& p = parts[i];
      if (p == "lora_A" || p == "lora_B" || p == "lora_embedding_A" || p == "lora_embedding_B") {
        add_lora(t, parts, i, with_adapter_segment);
        return;
      }
      if (is_other_peft_param(p) || p.rfind("lora_", 0) == 0) {
        out_.unsupported.push_back(t.name);
        return;
      }
      if (p == "base_layer") {
        std::vector<std::string> rest = parts;
        rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(i));
        add_base(join_dots(rest, 0, rest.size()), t);
        return;
      }
      if (p == "original_module") return;  // superseded by the trained modules_to_save copy
      if (p == "modules_to_save") {
        // <module>.modules_to_save.<adapter>.<param>
        if (i + 2 >= parts.size()) break;
        note_adapter(parts[i + 1]);
        add_base(join_dots(parts, 0, i) + "." + join_dots(parts, i + 2, parts.size()), t);
        return;
      }
    }
    add_base(name, t);
  }

 private:
  void add_base(const std::string& name, const SourceTensor& t) {
    auto [it, fresh] = base_index_.try_emplace(name, out_.base.size());
    if (fresh) {
      out_.base.emplace_back(name, &t);
    } else {
      out_.base[it->second].second = &t;
      out_.replaced.push_back(name);
    }
  }

  void add_lora(const SourceTensor& t, const std::vector<std::string>& parts, size_t i, bool with_adapter) {
    const bool embedding = parts[i].rfind("lora_embedding_", 0) == 0;
    const bool is_a = parts[i].back() == 'A';
    // Remaining segments: [adapter] + ["weight"] for Linear, [adapter] for embeddings.
    std::vector<std::string> rest(parts.begin() + static_cast<std::ptrdiff_t>(i) + 1, parts.end());
    if (with_adapter) {
      if (rest.empty()) throw Error("LoRA tensor without an adapter name").tensor(t.name);
      note_adapter(rest.front());
      rest.erase(rest.begin());
    }
    const bool ok = embedding ? rest.empty() : (rest.size() == 1 && rest[0] == "weight");
    if (!ok) {  // e.g. lora_B.default.bias (lora_bias=True): not foldable as W + BA
      out_.unsupported.push_back(t.name);
      return;
    }
    const std::string module = join_dots(parts, 0, i);
    auto [it, fresh] = lora_index_.try_emplace(module, out_.lora.size());
    if (fresh) out_.lora.push_back({module, nullptr, nullptr, embedding});
    LoraModule& m = out_.lora[it->second];
    const SourceTensor*& slot = is_a ? m.a : m.b;
    if (slot) throw Error("module '" + module + "' has two LoRA " + (is_a ? "A" : "B") + " tensors").tensor(t.name);
    slot = &t;
    m.embedding = embedding;
  }

  void note_adapter(const std::string& name) {
    if (std::find(out_.adapter_names.begin(), out_.adapter_names.end(), name) == out_.adapter_names.end())
      out_.adapter_names.push_back(name);
  }

  PeftSplit& out_;
  std::unordered_map<std::string, size_t> lora_index_;
  std::unordered_map<std::string, size_t> base_index_;
};

}  // namespace

std::string strip_wrapper_segments(const std::string& name) {
  std::string out = name;
  for (const char* seg : {"_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."}) {
    const std::string s(seg);
    for (size_t pos; (pos = out.find(s)) != std::string::npos;) out.erase(pos, s.size());
  }
  return out;
}

void add_peft_tensors(PeftSplit& split, std::span<const SourceTensor> tensors, bool saved_adapter) {
  Splitter splitter(split);
  for (const auto& t : tensors) splitter.add(t, /*with_adapter_segment=*/!saved_adapter);
}

PeftSplit split_peft_names(const SourceSet& checkpoint) {
  PeftSplit out;
  add_peft_tensors(out, checkpoint.tensors, false);
  return out;
}

}  // namespace shardmerge
