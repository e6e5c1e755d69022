#include "synth/synthetic_fsdp.hpp"

#include <filesystem>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "formats/torch_save_writer.hpp"
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
      // Planning at scale: 66 layers of 512 narrow experts, 101k per-expert tensors saved (0.2B parameters).
      {"moe-101k-tensors", "Qwen3MoeForCausalLM", "qwen3_moe", 64, 96, 66, 4, 2, 1024, false, false, 16, 512, 32, 8, true},
      {"qwen3-30b-a3b", "Qwen3MoeForCausalLM", "qwen3_moe", 2048, 6144, 48, 32, 4, 151936, false, false, 128, 128, 768, 8, true},
      // DeepSeek-V3's layout at the width of tiny-moe: MLA, a dense first layer, shared experts.
      {"tiny-deepseek-v3", "DeepseekV3ForCausalLM", "deepseek_v3", 64, 96, 3, 4, 4, 251, false, false, 0, 8, 16, 2,
       false, 32, 16, 8, 8, 8, 1, 1},
      {"deepseek-v3", "DeepseekV3ForCausalLM", "deepseek_v3", 7168, 18432, 61, 128, 128, 129280, false, false, 0, 256,
       2048, 8, false, 1536, 512, 128, 64, 128, 3, 1},
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

std::vector<Param> model_params(const ModelShape& m, int64_t lora_rank, bool fused_experts) {
  if (fused_experts && m.experts == 0) throw usage_error("--fused-experts: " + m.name + " has no experts");
  if (fused_experts && lora_rank > 0) throw usage_error("--fused-experts with LoRA is not supported");
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
    if (m.kv_lora_rank > 0) {
      const int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
      linear(p + "self_attn.q_a_proj", m.q_lora_rank, m.hidden, false);
      add(p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank});
      linear(p + "self_attn.q_b_proj", m.heads * qk, m.q_lora_rank, false);
      linear(p + "self_attn.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, m.hidden, false);
      add(p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank});
      linear(p + "self_attn.kv_b_proj", m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, false);
      linear(p + "self_attn.o_proj", m.hidden, m.heads * m.v_head_dim, false);
    } else {
      linear(p + "self_attn.q_proj", q, m.hidden, m.qkv_bias);
      linear(p + "self_attn.k_proj", kv, m.hidden, m.qkv_bias);
      linear(p + "self_attn.v_proj", kv, m.hidden, m.qkv_bias);
      linear(p + "self_attn.o_proj", m.hidden, q, false);
    }
    if (m.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd});
      add(p + "self_attn.k_norm.weight", {hd});
    }
    auto mlp = [&](const std::string& at, int64_t width) {
      linear(at + "gate_proj", width, m.hidden, false);
      linear(at + "up_proj", width, m.hidden, false);
      linear(at + "down_proj", m.hidden, width, false);
    };
    if (m.experts > 0 && l >= m.first_k_dense) {
      add(p + "mlp.gate.weight", {m.experts, m.hidden});  // the router: a Linear PEFT does not target here
      if (m.model_type == "deepseek_v3") add(p + "mlp.gate.e_score_correction_bias", {m.experts});
      if (m.shared_experts > 0) mlp(p + "mlp.shared_experts.", m.shared_experts * m.moe_intermediate);
      if (fused_experts) {
        add(p + "mlp.experts.gate_up_proj", {m.experts, 2 * m.moe_intermediate, m.hidden});
        add(p + "mlp.experts.down_proj", {m.experts, m.hidden, m.moe_intermediate});
      } else {
        for (int64_t e = 0; e < m.experts; ++e) mlp(p + "mlp.experts." + std::to_string(e) + ".", m.moe_intermediate);
      }
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

// A storage of `total` elements: synthetic values of stream `id` from global element `first`
// for the first `valid`, zeros after (FSDP2's padding rows).
std::string value_storage(TorchSaveWriter& out, uint64_t id, uint64_t first, uint64_t valid, uint64_t total, bool bf16) {
  const uint64_t elem = bf16 ? 2 : 4;
  return out.add_storage(total * elem, [=, pos = uint64_t{0}](char* buf, size_t n) mutable {
    for (size_t k = 0; k < n; k += elem, ++pos) {
      const float v = pos < valid ? synthetic_value(id, first + pos) : 0.0f;
      if (bf16) {
        const uint16_t h = convert::f32_to_bf16(v);
        std::memcpy(buf + k, &h, 2);
      } else {
        std::memcpy(buf + k, &v, 4);
      }
    }
  });
}

// Rank `rank`'s torch.chunk piece of dim 0: first row and row count.
std::pair<int64_t, int64_t> local_rows(int64_t rows, int64_t world, int64_t rank) {
  const int64_t chunk = (rows + world - 1) / world;
  const int64_t begin = std::min(rows, rank * chunk);
  return {begin, std::min(rows, begin + chunk) - begin};
}

Placement shard0() {
  Placement p;
  p.kind = PlacementKind::Shard;
  return p;
}

// A dict's items as Python's pickler writes them: batches of 1000, each MARK ... SETITEMS, a
// batch of one as SETITEM (pickle.py _batch_setitems; the C pickler does the same). `item(i)`
// writes the key and value of item i.
template <typename F>
void batched_setitems(pickle::Writer& w, size_t count, F&& item) {
  constexpr size_t kBatch = 1000;
  for (size_t begin = 0; begin < count; begin += kBatch) {
    const size_t end = std::min(count, begin + kBatch);
    if (end - begin > 1) w.mark();
    for (size_t i = begin; i < end; ++i) item(i);
    if (end - begin > 1) w.setitems();
    else w.setitem();
  }
}

// One rank's torch.save(model.state_dict()) of an FSDP2 model on a 1-D ("fsdp",) mesh.
uint64_t write_rank_file(const std::vector<Param>& params, int64_t world, int64_t rank, bool bf16, const std::string& path) {
  TorchSaveWriter out;
  pickle::Writer& w = out.pickle();
  out.global("collections", "OrderedDict");
  w.empty_tuple().reduce();
  w.put();
  const MeshOut mesh{{world}, {"fsdp"}, {"0"}, rank};
  std::vector<std::string> keys(params.size());
  batched_setitems(w, params.size(), [&](size_t i) {
    const Param& p = params[i];
    w.str(p.name);
    w.put();
    const int64_t chunk = (p.shape[0] + world - 1) / world, row = row_elems(p.shape);
    const auto [begin, rows] = local_rows(p.shape[0], world, rank);
    // FSDP2 pads every rank's storage to the chunk size.
    keys[i] = p.shares >= 0 ? keys[static_cast<size_t>(p.shares)]
                            : value_storage(out, p.id, static_cast<uint64_t>(begin * row), static_cast<uint64_t>(rows * row),
                                            static_cast<uint64_t>(chunk * row), bf16);
    std::vector<int64_t> local = p.shape;
    local[0] = rows;
    out.dtensor({bf16 ? DType::BF16 : DType::F32, p.shape, {shard0()}, local, keys[i], chunk * row}, mesh);
  });
  return out.write(path);
}

// One rank's torch.save(optimizer.state_dict()) of AdamW over the trainable parameters (the
// adapters of a LoRA model), one step taken: per parameter a 0-dim fp32 `step` and exp_avg,
// exp_avg_sq DTensors of the parameter's dtype whose storages are not padded (AdamW makes them
// with zeros_like of the unpadded local view).
uint64_t write_optim_file(const std::vector<Param>& params, bool lora, int64_t world, int64_t rank, bool bf16,
                          const std::string& path) {
  TorchSaveWriter out;
  pickle::Writer& w = out.pickle();
  const MeshOut mesh{{world}, {"fsdp"}, {"0"}, rank};
  const uint64_t streams = params.size();
  w.empty_dict();
  w.put();
  w.mark().str("state");
  w.put();
  w.empty_dict();
  w.put();
  std::vector<const Param*> trained;
  for (const Param& p : params)
    if (p.shares < 0 && (!lora || p.adapter)) trained.push_back(&p);
  const auto index = static_cast<int64_t>(trained.size());
  batched_setitems(w, trained.size(), [&](size_t i) {
    const Param& p = *trained[i];
    w.integer(static_cast<int64_t>(i)).empty_dict();
    w.put();
    w.mark().str("step");
    // A storage of its own per step, as torch saves them: AdamW increments each in place.
    const std::string step_key = out.add_storage(4, [](char* buf, size_t) {
      const float one = 1.0f;
      std::memcpy(buf, &one, 4);
    });
    out.tensor(DType::F32, step_key, 1, 0, {}, {});
    const int64_t row = row_elems(p.shape);
    const auto [begin, rows] = local_rows(p.shape[0], world, rank);
    std::vector<int64_t> local = p.shape;
    local[0] = rows;
    for (uint64_t k = 1; k <= 2; ++k) {
      w.str(k == 1 ? "exp_avg" : "exp_avg_sq");
      const std::string key = value_storage(out, p.id + k * streams, static_cast<uint64_t>(begin * row),
                                            static_cast<uint64_t>(rows * row), static_cast<uint64_t>(rows * row), bf16);
      out.dtensor({bf16 ? DType::BF16 : DType::F32, p.shape, {shard0()}, local, key, rows * row}, mesh);
    }
    w.setitems();
  });
  w.str("param_groups").empty_list().empty_dict().mark();
  w.str("lr").real(1e-6).str("betas").real(0.9).real(0.999).tuple(2).str("eps").real(1e-8);
  w.str("weight_decay").real(0.01).str("amsgrad").boolean(false).str("maximize").boolean(false);
  w.str("foreach").none().str("capturable").boolean(false).str("differentiable").boolean(false);
  w.str("fused").none().str("decoupled_weight_decay").boolean(true).str("initial_lr").real(1e-6);
  w.str("params").empty_list();
  for (int64_t begin = 0; begin < index; begin += 1000) {  // pickle.py _batch_appends
    const int64_t end = std::min(index, begin + 1000);
    if (end - begin > 1) w.mark();
    for (int64_t i = begin; i < end; ++i) w.integer(i);
    if (end - begin > 1) w.appends();
    else w.append();
  }
  w.setitems().append();
  w.setitems();
  return out.write(path);
}

void write_json(const fs::path& path, const nlohmann::ordered_json& j, int indent = 2) {
  write_small_file(path.string(), j.dump(indent) + "\n");
}

// The named shape, with --layers applied.
ModelShape chosen_shape(const SyntheticOptions& o) {
  ModelShape m = find_model(o.model);
  if (o.layers < 0) throw usage_error("--layers must be positive");
  if (o.layers > 0) m.layers = o.layers;
  return m;
}

}  // namespace

SyntheticSize estimate_synthetic(const SyntheticOptions& o) {
  const ModelShape m = chosen_shape(o);
  if (o.world_size < 1) throw usage_error("world size must be positive");
  const uint64_t elem = o.dtype == "bfloat16" ? 2 : 4, world = static_cast<uint64_t>(o.world_size);
  // Per rank: the pickle and zip records (a few KiB per tensor at most) beside the storages.
  constexpr uint64_t kPerTensorOverhead = 4096, kPerFileOverhead = 1 << 20;
  SyntheticSize size;
  for (const Param& p : model_params(m, o.lora_rank, o.fused_experts)) {
    const uint64_t rows = static_cast<uint64_t>(p.shape[0]), row = static_cast<uint64_t>(row_elems(p.shape));
    if (p.shares < 0) size.rank_file_bytes += world * ((rows + world - 1) / world) * row * elem;
    size.rank_file_bytes += world * kPerTensorOverhead;
    if (p.shares < 0 && !p.adapter) size.merged_bytes += rows * row * 2 + kPerTensorOverhead;
    if (o.optimizer && p.shares < 0 && (o.lora_rank == 0 || p.adapter))
      size.rank_file_bytes += 2 * rows * row * elem + world * 3 * kPerTensorOverhead;  // exp_avg, exp_avg_sq, step
  }
  size.rank_file_bytes += world * kPerFileOverhead;
  return size;
}

SyntheticSummary write_synthetic_fsdp(const SyntheticOptions& o) {
  const ModelShape m = chosen_shape(o);
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
  if (m.model_type == "deepseek_v3") {  // DeepSeek-V3's own config keys
    cfg["n_routed_experts"] = m.experts;
    cfg["n_shared_experts"] = m.shared_experts;
    cfg["num_experts_per_tok"] = m.experts_per_token;
    cfg["moe_intermediate_size"] = m.moe_intermediate;
    cfg["first_k_dense_replace"] = m.first_k_dense;
    cfg["n_group"] = 8;
    cfg["topk_group"] = 4;
    cfg["routed_scaling_factor"] = 2.5;
    cfg["norm_topk_prob"] = true;
    cfg["q_lora_rank"] = m.q_lora_rank;
    cfg["kv_lora_rank"] = m.kv_lora_rank;
    cfg["qk_nope_head_dim"] = m.qk_nope_head_dim;
    cfg["qk_rope_head_dim"] = m.qk_rope_head_dim;
    cfg["v_head_dim"] = m.v_head_dim;
    cfg["head_dim"] = m.qk_rope_head_dim;
  } else if (m.experts > 0) {
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

  const std::vector<Param> params = model_params(m, o.lora_rank, o.fused_experts);
  SyntheticSummary summary;
  summary.role_dir = role.string();
  for (const auto& p : params)
    if (p.shares < 0) summary.parameters += static_cast<uint64_t>(p.shape[0] * row_elems(p.shape));
  for (int64_t r = 0; r < o.world_size; ++r) {
    summary.rank_file_bytes += write_rank_file(params, o.world_size, r, o.dtype == "bfloat16",
                                               (role / layouts::rank_file_name("model", o.world_size, r)).string());
    if (o.optimizer)
      summary.rank_file_bytes += write_optim_file(params, o.lora_rank > 0, o.world_size, r, o.dtype == "bfloat16",
                                                  (role / layouts::rank_file_name("optim", o.world_size, r)).string());
  }
  return summary;
}

}  // namespace shardmerge::synth
