#include "synth/synthetic_fsdp.hpp"

#include <filesystem>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <map>
#include <nlohmann/json.hpp>

#include "formats/pickle_writer.hpp"
#include "formats/torch_writer.hpp"
#include "layouts/names.hpp"
#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace shardmerge::synth {

const std::vector<ModelShape>& model_shapes() {
  // Public configs (config.json) of the models whose shapes we borrow.
  static const std::vector<ModelShape> shapes = {
      {"tiny", "Qwen2ForCausalLM", "qwen2", 64, 96, 2, 4, 2, 251, true, true},
      {"qwen2.5-0.5b", "Qwen2ForCausalLM", "qwen2", 896, 4864, 24, 14, 2, 151936, true, true},
      {"qwen2.5-1.5b", "Qwen2ForCausalLM", "qwen2", 1536, 8960, 28, 12, 2, 151936, true, true},
      {"qwen2.5-3b", "Qwen2ForCausalLM", "qwen2", 2048, 11008, 36, 16, 2, 151936, true, true},
      {"qwen2.5-7b", "Qwen2ForCausalLM", "qwen2", 3584, 18944, 28, 28, 4, 152064, false, true},
      {"llama-3-8b", "LlamaForCausalLM", "llama", 4096, 14336, 32, 32, 8, 128256, false, false},
      {"qwen2.5-14b", "Qwen2ForCausalLM", "qwen2", 5120, 13824, 48, 40, 8, 152064, false, true},
      {"qwen2.5-32b", "Qwen2ForCausalLM", "qwen2", 5120, 27648, 64, 40, 8, 152064, false, true},
      {"llama-3-70b", "LlamaForCausalLM", "llama", 8192, 28672, 80, 64, 8, 128256, false, false},
      {"qwen2.5-72b", "Qwen2ForCausalLM", "qwen2", 8192, 29568, 80, 64, 8, 152064, false, true},
      {"tiny-moe", "Qwen3MoeForCausalLM", "qwen3_moe", 64, 96, 2, 4, 2, 251, false, false, 16, 4, 32, 2, true},
      {"qwen3-30b-a3b", "Qwen3MoeForCausalLM", "qwen3_moe", 2048, 6144, 48, 32, 4, 151936, false, false, 128, 128, 768, 8, true},
  };
  return shapes;
}

const ModelShape& find_model(const std::string& name) {
  for (const auto& m : model_shapes())
    if (m.name == name) return m;
  std::string names;
  for (const auto& m : model_shapes()) names += (names.empty() ? "" : ", ") + m.name;
  throw usage_error("unknown model '" + name + "' (known: " + names + ")");
}

std::string shape_line(const ModelShape& m) {
  char line[256];
  std::snprintf(line, sizeof line, "%-14s %s hidden=%ld layers=%ld vocab=%ld%s", m.name.c_str(), m.architecture.c_str(),
                static_cast<long>(m.hidden), static_cast<long>(m.layers), static_cast<long>(m.vocab), m.tied ? " tied" : "");
  std::string out = line;
  if (m.experts > 0)
    out += " experts=" + std::to_string(m.experts) + "x" + std::to_string(m.moe_intermediate) + " (top-" +
           std::to_string(m.experts_per_token) + ")";
  return out;
}

float synthetic_value(uint64_t tensor, uint64_t index) {
  // splitmix64 of (tensor, index): cheap, and any element can be recomputed on its own.
  uint64_t z = tensor * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)) / static_cast<float>(1 << 23);  // [-1, 1)
}

namespace {

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t id;         // value stream
  int64_t shares = -1;  // index of the param whose storage this one aliases (tied lm_head)
  bool adapter = false;  // a LoRA A or B matrix
};

std::vector<Param> model_params(const ModelShape& m, int64_t lora_rank) {
  std::vector<Param> out;
  const int64_t hd = m.head_dim > 0 ? m.head_dim : m.hidden / m.heads, q = m.heads * hd, kv = m.kv_heads * hd;
  const std::string prefix = lora_rank > 0 ? "base_model.model." : "";
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool adapter = false) {
    out.push_back({prefix + name, std::move(shape), out.size(), -1, adapter});
  };
  // PEFT wraps targeted Linear layers: weight/bias move under base_layer, A and B follow.
  auto linear = [&](const std::string& name, int64_t rows, int64_t cols, bool bias) {
    const std::string base = lora_rank > 0 ? name + ".base_layer" : name;
    add(base + ".weight", {rows, cols});
    if (bias) add(base + ".bias", {rows});
    if (lora_rank > 0) {
      add(name + ".lora_A.default.weight", {lora_rank, cols}, true);
      add(name + ".lora_B.default.weight", {rows, lora_rank}, true);
    }
  };
  add("model.embed_tokens.weight", {m.vocab, m.hidden});
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    linear(p + "self_attn.q_proj", q, m.hidden, m.qkv_bias);
    linear(p + "self_attn.k_proj", kv, m.hidden, m.qkv_bias);
    linear(p + "self_attn.v_proj", kv, m.hidden, m.qkv_bias);
    linear(p + "self_attn.o_proj", m.hidden, q, false);
    if (m.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd});
      add(p + "self_attn.k_norm.weight", {hd});
    }
    auto mlp = [&](const std::string& at, int64_t width) {
      linear(at + "gate_proj", width, m.hidden, false);
      linear(at + "up_proj", width, m.hidden, false);
      linear(at + "down_proj", m.hidden, width, false);
    };
    if (m.experts > 0) {
      add(p + "mlp.gate.weight", {m.experts, m.hidden});  // the router: a Linear PEFT does not target here
      for (int64_t e = 0; e < m.experts; ++e) mlp(p + "mlp.experts." + std::to_string(e) + ".", m.moe_intermediate);
    } else {
      mlp(p + "mlp.", m.intermediate);
    }
    add(p + "input_layernorm.weight", {m.hidden});
    add(p + "post_attention_layernorm.weight", {m.hidden});
  }
  add("model.norm.weight", {m.hidden});
  add("lm_head.weight", {m.vocab, m.hidden});
  if (m.tied) out.back().shares = 0;
  return out;
}

int64_t row_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

// One rank's torch.save(model.state_dict()) of an FSDP2 model on a 1-D ("fsdp",) mesh.
class RankFileWriter {
 public:
  RankFileWriter(const std::vector<Param>& params, int64_t world, int64_t rank, bool bf16)
      : params_(params), world_(world), rank_(rank), bf16_(bf16) {}

  uint64_t write(const std::string& path) {
    const std::string archive = fs::path(path).stem().string();
    pickle::Writer w;
    w.global("collections", "OrderedDict");
    ordered_dict_ = w.put();
    w.empty_tuple().reduce();
    w.put();
    w.mark();
    std::vector<std::string> keys(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      w.str(params_[i].name);
      w.put();
      dtensor(w, i, keys);
    }
    w.setitems();
    const std::string pkl = w.finish();

    TorchArchiveWriter zip(path, archive);
    zip.add_record("data.pkl", pkl);
    zip.add_record(".format_version", "1");
    zip.add_record(".storage_alignment", "64");
    zip.add_record("byteorder", "little");
    for (size_t k = 0; k < storages_.size(); ++k) zip.add_record("data/" + std::to_string(k), storages_[k].bytes, storages_[k].fill);
    zip.add_record(".data/serialization_id", std::string(40, '0'));
    zip.finish();
    return File::open_read(path).size();
  }

 private:
  struct Storage {
    uint64_t bytes;
    std::function<void(char*, size_t)> fill;
  };

  uint32_t memo_global(pickle::Writer& w, const std::string& module, const std::string& name) {
    auto [it, fresh] = globals_.try_emplace(module + " " + name, 0);
    if (!fresh) {
      w.get(it->second);
    } else {
      w.global(module, name);
      it->second = w.put();
    }
    return it->second;
  }

  // ('storage', <class>, key, 'cpu', numel) BINPERSID, as torch's persistent_id writes it.
  void storage_ref(pickle::Writer& w, const std::string& cls, const std::string& key, int64_t numel) {
    w.mark().str("storage");
    memo_global(w, "torch", cls);
    w.str(key).str("cpu").integer(numel).tuple().binpersid();
  }

  void rebuild_tensor(pickle::Writer& w, const std::string& cls, const std::string& key, int64_t numel,
                      const std::vector<int64_t>& size) {
    memo_global(w, "torch._utils", "_rebuild_tensor_v2");
    w.mark();
    storage_ref(w, cls, key, numel);
    w.integer(0).int_tuple(size).int_tuple(contiguous_strides(size)).boolean(false);
    w.get(ordered_dict_).empty_tuple().reduce();
    w.tuple().reduce();
  }

  void mesh(pickle::Writer& w) {
    if (mesh_memo_) {
      w.get(*mesh_memo_);
      return;
    }
    memo_global(w, "torch.distributed.device_mesh", "DeviceMesh");
    w.empty_tuple().newobj();
    mesh_memo_ = w.put();
    w.empty_dict().mark();
    w.str("_device_type").str("cpu");
    w.str("_layout");
    memo_global(w, "torch.distributed._mesh_layout", "_MeshLayout");
    w.empty_tuple().newobj().empty_dict().str("axes");
    memo_global(w, "torch.distributed._mesh_layout", "_FlatLayout");
    w.empty_tuple().newobj().empty_dict().mark();
    w.str("shape").int_tuple({world_}).str("stride").int_tuple({1});
    w.setitems().build().tuple(1).setitem().build();
    // The rank map is a small int32 tensor with its own storage record.
    const std::string key = std::to_string(storages_.size());
    const int64_t world = world_;
    storages_.push_back({static_cast<uint64_t>(world_) * 4, [world, next = int32_t{0}](char* buf, size_t n) mutable {
                           for (size_t i = 0; i + 4 <= n && next < world; i += 4, ++next) std::memcpy(buf + i, &next, 4);
                         }});
    w.str("_rank_map");
    rebuild_tensor(w, "IntStorage", key, world_, {world_});
    w.str("_mesh_dim_names").str("fsdp").tuple(1);
    w.str("_root_mesh").none();
    w.str("_preserve_rank_order").boolean(false);
    w.str("_flatten_rank_map").mark();
    for (int64_t r = 0; r < world_; ++r) w.integer(r);
    w.tuple();
    w.str("_thread_id").none();
    w.str("_flatten_mapping").empty_dict();
    w.str("_dim_group_names").empty_list().str("0").append();
    w.str("_rank").integer(rank_);
    w.str("_coordinate_on_dim").int_tuple({rank_});
    w.str("_hash").none();
    w.setitems().build();
  }

  // _rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (...), (None, {_local_tensor, _spec}))
  void dtensor(pickle::Writer& w, size_t index, std::vector<std::string>& keys) {
    const Param& p = params_[index];
    const int64_t rows = p.shape[0], chunk = (rows + world_ - 1) / world_;
    const int64_t begin = std::min(rows, rank_ * chunk), local_rows = std::min(rows, begin + chunk) - begin;
    const int64_t row = row_elems(p.shape);
    std::vector<int64_t> local = p.shape;
    local[0] = local_rows;
    const std::string cls = bf16_ ? "BFloat16Storage" : "FloatStorage";
    const std::string dtype = bf16_ ? "bfloat16" : "float32";
    if (p.shares >= 0) {
      keys[index] = keys[static_cast<size_t>(p.shares)];
    } else {
      // FSDP2 pads every rank's storage to the chunk size; padding rows are zeros.
      keys[index] = std::to_string(storages_.size());
      const uint64_t elem = bf16_ ? 2 : 4, valid = static_cast<uint64_t>(local_rows * row);
      const uint64_t first = static_cast<uint64_t>(begin * row);
      const bool bf16 = bf16_;
      storages_.push_back({static_cast<uint64_t>(chunk * row) * elem, [=, pos = uint64_t{0}](char* buf, size_t n) mutable {
                             for (size_t i = 0; i < n; i += elem, ++pos) {
                               const float v = pos < valid ? synthetic_value(p.id, first + pos) : 0.0f;
                               if (bf16) {
                                 const uint16_t h = convert::f32_to_bf16(v);
                                 std::memcpy(buf + i, &h, 2);
                               } else {
                                 std::memcpy(buf + i, &v, 4);
                               }
                             }
                           }});
    }
    memo_global(w, "torch._tensor", "_rebuild_from_type_v2");
    w.mark();
    memo_global(w, "torch._utils", "_rebuild_wrapper_subclass");
    const uint32_t dt = memo_global(w, "torch.distributed.tensor", "DTensor");
    w.mark().get(dt);
    memo_global(w, "torch", dtype);
    w.int_tuple(p.shape).int_tuple(contiguous_strides(p.shape)).integer(0);
    if (layout_memo_) {
      w.get(*layout_memo_);
    } else {
      memo_global(w, "torch.serialization", "_get_layout");
      w.str("torch.strided").tuple(1).reduce();
      layout_memo_ = w.put();
    }
    if (device_memo_) {
      w.get(*device_memo_);
    } else {
      memo_global(w, "torch", "device");
      w.str("cpu").tuple(1).reduce();
      device_memo_ = w.put();
    }
    w.boolean(false).tuple();
    w.none().empty_dict().mark();
    w.str("_local_tensor");
    rebuild_tensor(w, cls, keys[index], chunk * row, local);
    w.str("_spec");
    memo_global(w, "torch.distributed.tensor._dtensor_spec", "DTensorSpec");
    w.empty_tuple().newobj().empty_dict().mark();
    w.str("mesh");
    mesh(w);
    w.str("placements");
    memo_global(w, "torch.distributed.tensor.placement_types", "Shard");
    w.empty_tuple().newobj().empty_dict().str("dim").integer(0).setitem().build().tuple(1);
    w.str("tensor_meta");
    memo_global(w, "torch.distributed.tensor._dtensor_spec", "TensorMeta");
    memo_global(w, "torch", "Size");
    w.int_tuple(p.shape).tuple(1).reduce();
    w.int_tuple(contiguous_strides(p.shape));
    memo_global(w, "torch", dtype);
    w.tuple(3).newobj();
    w.str("shard_order");
    memo_global(w, "torch.distributed.tensor._dtensor_spec", "ShardOrderEntry");
    w.integer(0).int_tuple({0}).tuple(2).newobj().tuple(1);
    w.str("use_strided_shard_as_shard_order").boolean(false);
    w.str("_hash").none();
    w.setitems().build();
    w.setitems().tuple(2);
    w.tuple().reduce();
  }

  const std::vector<Param>& params_;
  int64_t world_, rank_;
  bool bf16_;
  uint32_t ordered_dict_ = 0;
  std::map<std::string, uint32_t> globals_;
  std::optional<uint32_t> mesh_memo_, layout_memo_, device_memo_;
  std::vector<Storage> storages_;
};

void write_json(const fs::path& path, const nlohmann::ordered_json& j, int indent = 2) {
  write_small_file(path.string(), j.dump(indent) + "\n");
}

}  // namespace

SyntheticSize estimate_synthetic(const SyntheticOptions& o) {
  const ModelShape& m = find_model(o.model);
  if (o.world_size < 1) throw usage_error("world size must be positive");
  const uint64_t elem = o.dtype == "bfloat16" ? 2 : 4, world = static_cast<uint64_t>(o.world_size);
  // Per rank: the pickle and zip records (a few KiB per tensor at most) beside the storages.
  constexpr uint64_t kPerTensorOverhead = 4096, kPerFileOverhead = 1 << 20;
  SyntheticSize size;
  for (const Param& p : model_params(m, o.lora_rank)) {
    const uint64_t rows = static_cast<uint64_t>(p.shape[0]), row = static_cast<uint64_t>(row_elems(p.shape));
    if (p.shares < 0) size.rank_file_bytes += world * ((rows + world - 1) / world) * row * elem;
    size.rank_file_bytes += world * kPerTensorOverhead;
    if (p.shares < 0 && !p.adapter) size.merged_bytes += rows * row * 2 + kPerTensorOverhead;
  }
  size.rank_file_bytes += world * kPerFileOverhead;
  return size;
}

SyntheticSummary write_synthetic_fsdp(const SyntheticOptions& o) {
  const ModelShape& m = find_model(o.model);
  if (o.world_size < 1) throw usage_error("world size must be positive");
  if (o.dtype != "float32" && o.dtype != "bfloat16") throw usage_error("--dtype must be float32 or bfloat16");
  const fs::path run(o.out_dir);
  const fs::path role = run / ("global_step_" + std::to_string(o.step)) / "actor";
  fs::create_directories(role / "huggingface");
  write_small_file((run / "latest_checkpointed_iteration.txt").string(), std::to_string(o.step));
  write_json(role / "fsdp_config.json", {{"FSDP_version", 2}, {"world_size", o.world_size}}, 4);

  nlohmann::ordered_json cfg;
  cfg["architectures"] = {m.architecture};
  cfg["model_type"] = m.model_type;
  cfg["hidden_size"] = m.hidden;
  cfg["intermediate_size"] = m.intermediate;
  cfg["num_hidden_layers"] = m.layers;
  cfg["num_attention_heads"] = m.heads;
  cfg["num_key_value_heads"] = m.kv_heads;
  cfg["vocab_size"] = m.vocab;
  cfg["tie_word_embeddings"] = m.tied;
  cfg["hidden_act"] = "silu";
  cfg["rms_norm_eps"] = 1e-6;
  cfg["max_position_embeddings"] = 4096;
  cfg["dtype"] = o.dtype;
  if (m.head_dim > 0) cfg["head_dim"] = m.head_dim;
  if (m.experts > 0) {
    cfg["num_experts"] = m.experts;
    cfg["num_experts_per_tok"] = m.experts_per_token;
    cfg["moe_intermediate_size"] = m.moe_intermediate;
    cfg["decoder_sparse_step"] = 1;
    cfg["mlp_only_layers"] = nlohmann::ordered_json::array();
    cfg["norm_topk_prob"] = true;
  }
  write_json(role / "huggingface" / "config.json", cfg);
  if (!o.tokenizer_from.empty())
    for (const auto& e : fs::directory_iterator(o.tokenizer_from)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("tokenizer", 0) == 0 || name == "special_tokens_map.json" || name == "chat_template.jinja")
        fs::copy_file(e.path(), role / "huggingface" / name, fs::copy_options::overwrite_existing);
    }
  if (o.lora_rank > 0)
    write_json(role / "lora_train_meta.json", {{"r", o.lora_rank}, {"lora_alpha", o.lora_alpha}, {"task_type", "CAUSAL_LM"}});

  const std::vector<Param> params = model_params(m, o.lora_rank);
  SyntheticSummary summary;
  summary.role_dir = role.string();
  for (const auto& p : params)
    if (p.shares < 0) summary.parameters += static_cast<uint64_t>(p.shape[0] * row_elems(p.shape));
  for (int64_t r = 0; r < o.world_size; ++r) {
    RankFileWriter writer(params, o.world_size, r, o.dtype == "bfloat16");
    summary.rank_file_bytes += writer.write((role / layouts::rank_file_name("model", o.world_size, r)).string());
  }
  return summary;
}

}  // namespace shardmerge::synth
