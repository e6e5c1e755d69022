#include "plan/saved_names.hpp"

#include <algorithm>
#include <cctype>

#include "plan/regions.hpp"
#include "shardmerge/error.hpp"
#include "util/shape.hpp"

namespace shardmerge {
namespace {

// The families, as transformers 5.24's conversion mapping defines their load-time conversion
// (reversed here: what its save writes).
const SavedNameRules kQwen2MoeExperts{
    "per-expert MoE weights (mlp.experts.N.{gate,up,down}_proj)",
    {{"mlp.experts.gate_up_proj", {"mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"}},
     {"mlp.experts.down_proj", {"mlp.experts.*.down_proj.weight"}}},
    {}};
const SavedNameRules kMixtralExperts{
    "per-expert MoE weights (block_sparse_moe.experts.N.w1/w3/w2, block_sparse_moe.gate)",
    {{"mlp.experts.gate_up_proj", {"block_sparse_moe.experts.*.w1.weight", "block_sparse_moe.experts.*.w3.weight"}},
     {"mlp.experts.down_proj", {"block_sparse_moe.experts.*.w2.weight"}}},
    {{"mlp.gate", "block_sparse_moe.gate"}}};
const SavedNameRules kJambaExperts{
    "per-expert MoE weights (feed_forward.experts.N.{gate,up,down}_proj)",
    {{"feed_forward.experts.gate_up_proj",
      {"feed_forward.experts.*.gate_proj.weight", "feed_forward.experts.*.up_proj.weight"}},
     {"feed_forward.experts.down_proj", {"feed_forward.experts.*.down_proj.weight"}}},
    {}};
const SavedNameRules kQwen2VlPrefixes{
    "VLM prefixes (model.language_model. -> model., model.visual. -> visual.)",
    {},
    {{"model.language_model", "model", true}, {"model.visual", "visual", true}}};
const SavedNameRules kLlavaPrefixes{
    "VLM prefixes (model.language_model. -> language_model.model., lm_head -> language_model.lm_head, "
    "model.vision_tower. -> vision_tower., model.multi_modal_projector. -> multi_modal_projector.)",
    {},
    {{"model.language_model", "language_model.model", true},
     {"lm_head", "language_model.lm_head", true},
     {"model.vision_tower", "vision_tower", true},
     {"model.multi_modal_projector", "multi_modal_projector", true}}};
const SavedNameRules kNotReproduced{"a conversion shardmerge does not reproduce", {}, {}, true};

// Where `path` occurs in `name` bounded by dots (or the name's ends); npos if nowhere.
size_t find_segments(const std::string& name, std::string_view path, bool at_start) {
  auto bounded = [&](size_t at) {
    return (at == 0 || name[at - 1] == '.') && (at + path.size() == name.size() || name[at + path.size()] == '.');
  };
  if (at_start) return name.compare(0, path.size(), path) == 0 && bounded(0) ? 0 : std::string::npos;
  for (size_t at = name.find(path); at != std::string::npos; at = name.find(path, at + 1))
    if (bounded(at)) return at;
  return std::string::npos;
}

bool ends_with_segments(const std::string& name, std::string_view path) {
  return name.size() >= path.size() && name.compare(name.size() - path.size(), path.size(), path) == 0 &&
         (name.size() == path.size() || name[name.size() - path.size() - 1] == '.');
}

std::string renamed(std::string name, const std::vector<NameRename>& renames) {
  for (const NameRename& r : renames)
    if (const size_t at = find_segments(name, r.runtime, r.at_start); at != std::string::npos)
      name.replace(at, r.runtime.size(), r.saved);
  return name;
}

}  // namespace

static const std::vector<SavedNameClass>& saved_name_classes() {
  // One row per model class transformers 5.24 can build whose save converts names, or whose
  // run-time names look converted but are saved as they are (nullptr). Checked row by row
  // against transformers by SavedNames.AgreesWithTransformers.
  static const std::vector<SavedNameClass> table = {
      // Converted on save, reproduced here.
      {"AfmoeForCausalLM", "afmoe", &kQwen2MoeExperts},
      {"Cohere2MoeForCausalLM", "cohere2_moe", &kQwen2MoeExperts},
      {"DeepseekV2ForCausalLM", "deepseek_v2", &kQwen2MoeExperts},
      {"DeepseekV3ForCausalLM", "deepseek_v3", &kQwen2MoeExperts},
      {"Dots3NoteForCausalLM", "dots3_note_text", &kQwen2MoeExperts},
      {"FlexOlmoForCausalLM", "flex_olmo", &kQwen2MoeExperts},
      {"Gemma3ForConditionalGeneration", "gemma3", &kLlavaPrefixes},
      {"Glm4MoeForCausalLM", "glm4_moe", &kQwen2MoeExperts},
      {"Glm4MoeLiteForCausalLM", "glm4_moe_lite", &kQwen2MoeExperts},
      {"Glm4vMoeForConditionalGeneration", "glm4v_moe", &kQwen2MoeExperts},
      {"GotOcr2ForConditionalGeneration", "got_ocr2", &kLlavaPrefixes},
      {"InternVLForConditionalGeneration", "internvl", &kLlavaPrefixes},
      {"JambaForCausalLM", "jamba", &kJambaExperts},
      {"LlavaForConditionalGeneration", "llava", &kLlavaPrefixes},
      {"LongcatFlashForCausalLM", "longcat_flash", &kQwen2MoeExperts},
      {"MellumForCausalLM", "mellum", &kQwen2MoeExperts},
      {"MiniMaxForCausalLM", "minimax", &kMixtralExperts},
      {"Mistral3ForConditionalGeneration", "mistral3", &kLlavaPrefixes},
      {"MixtralForCausalLM", "mixtral", &kMixtralExperts},
      {"OlmoeForCausalLM", "olmoe", &kQwen2MoeExperts},
      {"PaliGemmaForConditionalGeneration", "paligemma", &kLlavaPrefixes},
      {"Qwen2MoeForCausalLM", "qwen2_moe", &kQwen2MoeExperts},
      {"Qwen2VLForConditionalGeneration", "qwen2_vl", &kQwen2VlPrefixes},
      {"Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", &kQwen2VlPrefixes},
      {"Qwen3MoeForCausalLM", "qwen3_moe", &kQwen2MoeExperts},
      {"Qwen3NextForCausalLM", "qwen3_next", &kQwen2MoeExperts},
      {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", &kQwen2MoeExperts},
      {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", &kQwen2MoeExperts},
      {"Qwen4ExpForCausalLM", "qwen4_exp_text", &kQwen2MoeExperts},
      {"Qwen4ExpForConditionalGeneration", "qwen4_exp", &kQwen2MoeExperts},
      {"SolarOpenForCausalLM", "solar_open", &kQwen2MoeExperts},
      {"VipLlavaForConditionalGeneration", "vipllava", &kLlavaPrefixes},
      // Saved with the run-time names (no conversion, or one that changes nothing).
      {"Apertus1p5ForConditionalGeneration", "apertus1p5", nullptr},
      {"Apertus1p5TextForCausalLM", "apertus1p5_text", nullptr},
      {"BeamForCausalLM", "beam", nullptr},
      {"Cohere2VisionForConditionalGeneration", "cohere2_vision", nullptr},
      {"DeepseekV32ForCausalLM", "deepseek_v32", nullptr},
      {"DeepseekVLForConditionalGeneration", "deepseek_vl", nullptr},
      {"DeepseekVLHybridForConditionalGeneration", "deepseek_vl_hybrid", nullptr},
      {"Exaone4_5_ForConditionalGeneration", "exaone4_5", nullptr},
      {"Florence2ForConditionalGeneration", "florence2", nullptr},
      {"Glm46VForConditionalGeneration", "glm46v", nullptr},
      {"Glm4vForConditionalGeneration", "glm4v", nullptr},
      {"GlmMoeDsaForCausalLM", "glm_moe_dsa", nullptr},
      {"GlmOcrForConditionalGeneration", "glm_ocr", nullptr},
      {"GptOssForCausalLM", "gpt_oss", nullptr},
      {"GraniteMoeSWAForCausalLM", "granitemoe_swa", nullptr},
      {"InklingForCausalLM", "inkling_text", nullptr},
      {"JanusForConditionalGeneration", "janus", nullptr},
      {"Lfm2VlForConditionalGeneration", "lfm2_vl", nullptr},
      {"Lfm3ForCausalLM", "lfm3", nullptr},
      {"LightOnOcrForConditionalGeneration", "lighton_ocr", nullptr},
      {"Llama4ForCausalLM", "llama4_text", nullptr},
      {"Llama4ForConditionalGeneration", "llama4", nullptr},
      {"MiniCPMOcrForConditionalGeneration", "minicpm_ocr", nullptr},
      {"MiniCPMV4_6ForConditionalGeneration", "minicpmv4_6", nullptr},
      {"MiniCPMV4_7ForConditionalGeneration", "minicpmv4_7", nullptr},
      {"MiniMaxM3VLForCausalLM", "minimax_m3_vl_text", nullptr},
      {"Mistral4ForCausalLM", "mistral4", nullptr},
      {"MossTranscribeDiarizeForConditionalGeneration", "moss_transcribe_diarize", nullptr},
      {"MuseGlimmerForConditionalGeneration", "muse_glimmer", nullptr},
      {"MuseSparkForConditionalGeneration", "muse_spark", nullptr},
      {"Ovis2ForConditionalGeneration", "ovis2", nullptr},
      {"Qwen3VLForConditionalGeneration", "qwen3_vl", nullptr},
      {"Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", nullptr},
      {"Qwen3_5ForCausalLM", "qwen3_5_text", nullptr},
      {"Qwen3_5ForConditionalGeneration", "qwen3_5", nullptr},
      {"VideoLlama3ForConditionalGeneration", "video_llama_3", nullptr},
      {"ZayaForCausalLM", "zaya", nullptr},
      // Converted on save with operations (transposes, interleaves, Megatron-style renames, ...) that
      // shardmerge does not reproduce: refused unless the run-time names are asked for.
      {"AXK1ForCausalLM", "axk1", &kNotReproduced},
      {"AXK2ForCausalLM", "axk2", &kNotReproduced},
      {"AriaForConditionalGeneration", "aria", &kNotReproduced},
      {"AriaTextForCausalLM", "aria_text", &kNotReproduced},
      {"BailingHybridForCausalLM", "bailing_hybrid", &kNotReproduced},
      {"Cosmos3EdgeForConditionalGeneration", "cosmos3_edge", &kNotReproduced},
      {"Cosmos3OmniForConditionalGeneration", "cosmos3_omni", &kNotReproduced},
      {"DeepseekV4ForCausalLM", "deepseek_v4", &kNotReproduced},
      {"DoryForCausalLM", "dory", &kNotReproduced},
      {"Dots3NoteForConditionalGeneration", "dots3_note", &kNotReproduced},
      {"Ernie4_5_MoeForCausalLM", "ernie4_5_moe", &kNotReproduced},
      {"Ernie4_5_VLMoeForConditionalGeneration", "ernie4_5_vl_moe", &kNotReproduced},
      {"ExaoneMoeForCausalLM", "exaone_moe", &kNotReproduced},
      {"FlintForCausalLM", "flint", &kNotReproduced},
      {"FuyuForCausalLM", "fuyu", &kNotReproduced},
      {"GPTNeoXForCausalLM", "gpt_neox", &kNotReproduced},
      {"Glm5NextForConditionalGeneration", "glm5_next", &kNotReproduced},
      {"GraniteMoeForCausalLM", "granitemoe", &kNotReproduced},
      {"GraniteMoeHybridForCausalLM", "granitemoehybrid", &kNotReproduced},
      {"GraniteMoeSharedForCausalLM", "granitemoeshared", &kNotReproduced},
      {"HYV3ForCausalLM", "hy_v3", &kNotReproduced},
      {"HYV4ForCausalLM", "hy_v4", &kNotReproduced},
      {"HYV4VLForConditionalGeneration", "hy_v4_vl", &kNotReproduced},
      {"HrmTextForCausalLM", "hrm_text", &kNotReproduced},
      {"HyperCLOVAXVisionV2ForConditionalGeneration", "hyperclovax_vision_v2", &kNotReproduced},
      {"Inkling2ForCausalLM", "inkling2_text", &kNotReproduced},
      {"Inkling2ForConditionalGeneration", "inkling2", &kNotReproduced},
      {"Inkling2LoopForCausalLM", "inkling2_loop_text", &kNotReproduced},
      {"Inkling2LoopForConditionalGeneration", "inkling2_loop", &kNotReproduced},
      {"KimiLinearForCausalLM", "kimi_linear", &kNotReproduced},
      {"Kimi_K25ForConditionalGeneration", "kimi_k25", &kNotReproduced},
      {"Kolibri1ForCausalLM", "kolibri1", &kNotReproduced},
      {"LagunaForCausalLM", "laguna", &kNotReproduced},
      {"LaraMiniForCausalLM", "lara_mini", &kNotReproduced},
      {"Lfm3VlForConditionalGeneration", "lfm3_vl", &kNotReproduced},
      {"LlavaNextForConditionalGeneration", "llava_next", &kNotReproduced},
      {"LlavaNextVideoForConditionalGeneration", "llava_next_video", &kNotReproduced},
      {"LlavaOnevisionForConditionalGeneration", "llava_onevision", &kNotReproduced},
      {"MiMoV2FlashForCausalLM", "mimo_v2_flash", &kNotReproduced},
      {"MiniMaxM2ForCausalLM", "minimax_m2", &kNotReproduced},
      {"MiniMaxM3SparseForConditionalGeneration", "minimax_m3_vl", &kNotReproduced},
      {"MistralLarge4ForConditionalGeneration", "mistral_large4", &kNotReproduced},
      {"MllamaForConditionalGeneration", "mllama", &kNotReproduced},
      {"Molmo2ForConditionalGeneration", "molmo2", &kNotReproduced},
      {"NemotronHForCausalLM", "nemotron_h", &kNotReproduced},
      {"NemotronH_Omni_Reasoning_V3", "nemotron_h_omni", &kNotReproduced},
      {"OlmoHybridForCausalLM", "olmo_hybrid", &kNotReproduced},
      {"PI0ForConditionalGeneration", "pi0", &kNotReproduced},
      {"PaddleOCRVLForConditionalGeneration", "paddleocr_vl", &kNotReproduced},
      {"PhimoeForCausalLM", "phimoe", &kNotReproduced},
      {"QianfanOCRForConditionalGeneration", "qianfan_ocr", &kNotReproduced},
      {"Qwen2_5OmniThinkerForConditionalGeneration", "qwen2_5_omni_thinker", &kNotReproduced},
      {"Qwen3OmniMoeThinkerForConditionalGeneration", "qwen3_omni_moe_thinker", &kNotReproduced},
      {"Step3p7ForConditionalGeneration", "step3p7", &kNotReproduced},
      {"T5Gemma2ForConditionalGeneration", "t5gemma2", &kNotReproduced},
      {"UnlimitedOcrForConditionalGeneration", "unlimited_ocr", &kNotReproduced},
      {"VideoLlavaForConditionalGeneration", "video_llava", &kNotReproduced},
      {"VisionEncoderDecoderModel", "vision-encoder-decoder", &kNotReproduced},
  };
  return table;
}

const SavedNameClass* saved_name_class(const nlohmann::ordered_json& config) {
  if (!config.is_object()) return nullptr;
  const auto& table = saved_name_classes();
  if (config.contains("architectures") && config["architectures"].is_array() && !config["architectures"].empty() &&
      config["architectures"][0].is_string()) {
    const std::string arch = config["architectures"][0].get<std::string>();
    for (const SavedNameClass& row : table)
      if (row.architecture == arch) return &row;
    return nullptr;
  }
  if (config.contains("model_type") && config["model_type"].is_string()) {
    const std::string type = config["model_type"].get<std::string>();
    for (const SavedNameClass& row : table)
      if (row.model_type == type) return &row;
  }
  return nullptr;
}

namespace {

struct Fp32Modules {
  std::string_view architecture;
  std::vector<std::string_view> patterns;
};

// transformers 5.24's `_keep_in_fp32_modules_strict`, per model class, as its model instance
// holds it (merged over sub-models).
const std::vector<Fp32Modules>& fp32_modules() {
  static const std::vector<Fp32Modules> table = {
      {"AXK1ForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"AXK2ForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"AfmoeForCausalLM", {"expert_bias"}},
      {"Apertus1p5ForConditionalGeneration", {"audio_tokenizer", "vision_tokenizer"}},
      {"BailingHybridForCausalLM", {"A_log", "conv1d", "dt_bias", "e_score_correction_bias", "gate.weight"}},
      {"BeamForCausalLM", {"e_score_correction_bias", "mlp.gate.weight"}},
      {"DeepseekV2ForCausalLM", {"gate.weight"}},
      {"DeepseekV32ForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"DeepseekV3ForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"DeepseekV4ForCausalLM", {"attn_hc", "e_score_correction_bias", "ffn_hc", "hc_head", "input_layernorm", "kv_norm", "norm", "position_bias", "post_attention_layernorm", "q_a_norm", "sinks"}},
      {"Dots3NoteForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"Dots3NoteForConditionalGeneration", {"e_score_correction_bias", "gate.weight"}},
      {"Ernie4_5_MoeForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"Ernie4_5_VLMoeForConditionalGeneration", {"e_score_correction_bias", "gate.weight"}},
      {"ExaoneMoeForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"FlintForCausalLM", {"gate.weight", "sinks"}},
      {"Glm4MoeForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"Glm4MoeLiteForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"Glm4vMoeForConditionalGeneration", {"e_score_correction_bias", "gate.weight"}},
      {"Glm5NextForConditionalGeneration", {"A_log", "attn_hc.base", "attn_hc.scale", "conv1d", "dt_bias", "e_score_correction_bias", "ffn_hc.base", "ffn_hc.scale", "gate.weight"}},
      {"GlmMoeDsaForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"HYV3ForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"HYV4ForCausalLM", {"base", "e_score_correction_bias", "fn", "gate.weight", "hc_base", "hc_fn", "hc_scale", "k_norm", "lm_head", "scale", "sinks", "weights_proj"}},
      {"HYV4VLForConditionalGeneration", {"base", "e_score_correction_bias", "fn", "gate.weight", "hc_base", "hc_fn", "hc_scale", "k_norm", "lm_head", "scale", "sinks", "weights_proj"}},
      {"Inkling2ForCausalLM", {"attention_input", "e_score_correction_bias", "final_input", "mlp.gate.weight", "mlp_input", "post_attention_convolution", "post_mlp_convolution", "sconv.conv1d"}},
      {"Inkling2ForConditionalGeneration", {"attention_input", "e_score_correction_bias", "final_input", "mlp.gate.weight", "mlp_input", "post_attention_convolution", "post_mlp_convolution", "sconv.conv1d"}},
      {"Inkling2LoopForCausalLM", {"attention_input", "e_score_correction_bias", "final_input", "forget_gate_proj", "message_gate_proj", "message_input", "mlp.gate.weight", "mlp_input", "post_attention_convolution", "post_mlp_convolution", "sconv.conv1d"}},
      {"Inkling2LoopForConditionalGeneration", {"attention_input", "e_score_correction_bias", "final_input", "forget_gate_proj", "message_gate_proj", "message_input", "mlp.gate.weight", "mlp_input", "post_attention_convolution", "post_mlp_convolution", "sconv.conv1d"}},
      {"InklingForCausalLM", {"attn_sconv", "e_score_correction_bias", "gate.global_scale", "k_sconv", "mlp_sconv", "v_sconv"}},
      {"KimiLinearForCausalLM", {"dt_bias", "e_score_correction_bias", "gate.weight"}},
      {"Kimi_K25ForConditionalGeneration", {"e_score_correction_bias", "gate.weight"}},
      {"Kolibri1ForCausalLM", {"e_score_correction_bias"}},
      {"MiMoV2FlashForCausalLM", {"e_score_correction_bias", "mlp.gate.weight"}},
      {"MistralLarge4ForConditionalGeneration", {"mlp.gate.weight", "rotary_emb"}},
      {"MuseSparkForConditionalGeneration", {"e_score_correction_bias", "mlp.gate.weight", "post_attention_residual_gate", "post_feedforward_residual_gate"}},
      {"NemotronHForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"NemotronH_Omni_Reasoning_V3", {"e_score_correction_bias", "gate.weight"}},
      {"SolarOpenForCausalLM", {"e_score_correction_bias", "gate.weight"}},
      {"UnlimitedOcrForConditionalGeneration", {"gate.weight"}},
  };
  return table;
}

// A regular-expression search where the pattern's only special characters are '.' (any one
// character) and '*' (taken as ".*"), which is what transformers' glob alternation makes of them.
bool glob_matches_at(std::string_view name, size_t at, std::string_view pattern) {
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '*') {
      for (size_t k = at; k <= name.size(); ++k)
        if (glob_matches_at(name, k, pattern.substr(i + 1))) return true;
      return false;
    }
    if (at >= name.size() || (pattern[i] != '.' && pattern[i] != name[at])) return false;
    ++at;
  }
  return true;
}

}  // namespace

std::vector<std::string_view> fp32_module_patterns(std::string_view architecture) {
  for (const Fp32Modules& row : fp32_modules())
    if (row.architecture == architecture) return row.patterns;
  return {};
}

bool kept_in_fp32(const std::vector<std::string_view>& patterns, std::string_view name) {
  for (std::string_view pattern : patterns)
    for (size_t at = 0; at <= name.size(); ++at)
      if (glob_matches_at(name, at, pattern)) return true;
  return false;
}

std::vector<SavedPart> saved_parts(const SavedNameRules& rules, const std::string& runtime_name,
                                   const std::vector<int64_t>& shape) {
  for (const ExpertSplit& split : rules.splits) {
    if (!ends_with_segments(runtime_name, split.fused)) continue;
    const auto parts = static_cast<int64_t>(split.saved.size());
    if (shape.size() != 3 || shape[1] % parts != 0)
      throw Error("a fused expert tensor " + shape_string(shape) + " does not split into " + std::to_string(parts) +
                  " per-expert part(s) of [rows, cols]")
          .tensor(runtime_name);
    const std::string prefix = runtime_name.substr(0, runtime_name.size() - split.fused.size());
    const int64_t rows = shape[1] / parts;
    std::vector<SavedPart> out;
    for (int64_t j = 0; j < parts; ++j) {
      const std::string_view pattern = split.saved[static_cast<size_t>(j)];
      const size_t star = pattern.find('*');
      for (int64_t e = 0; e < shape[0]; ++e) {
        std::string name = prefix + std::string(pattern.substr(0, star)) + std::to_string(e) +
                           std::string(pattern.substr(star + 1));
        out.push_back({renamed(std::move(name), rules.renames), {e, j * rows, 0}, {1, rows, shape[2]}, 1});
      }
    }
    return out;
  }
  return {{renamed(runtime_name, rules.renames), std::vector<int64_t>(shape.size(), 0), shape, 0}};
}

void apply_saved_names(OutputGroup& group, const SavedNameRules& rules, std::deque<SourceTensor>& parts) {
  std::stable_sort(group.tensors.begin(), group.tensors.end(),
                   [](const PlannedTensor& a, const PlannedTensor& b) { return dot_natural_less(a.name, b.name); });
  std::vector<PlannedTensor> out;
  out.reserve(group.tensors.size());
  for (PlannedTensor& p : group.tensors) {
    const SourceTensor& src = *p.source;
    std::vector<SavedPart> saved = saved_parts(rules, p.name, src.shape);
    if (saved.size() == 1 && saved.front().drop == 0) {
      p.name = std::move(saved.front().name);
      out.push_back(std::move(p));
      continue;
    }
    if (p.fold)
      throw Error("LoRA adapts this fused expert tensor, which is saved per expert; folding into it is not supported "
                  "(--keep-runtime-names keeps it fused)")
          .tensor(p.name);
    for (SavedPart& part : saved) {
      const std::vector<int64_t> shape(part.extent.begin() + static_cast<std::ptrdiff_t>(part.drop), part.extent.end());
      parts.push_back(assemble(part.name, src.dtype, shape,
                               {Region{&src, part.start, part.extent, std::vector<int64_t>(shape.size(), 0), part.drop}},
                               src.origin + ", expert " + std::to_string(part.start[0]) + " of " + p.name));
      PlannedTensor t = p;
      t.name = std::move(part.name);
      t.source = &parts.back();
      t.storage = {&src, part.start[1]};
      out.push_back(std::move(t));
    }
  }
  group.tensors = std::move(out);
}

bool looks_like_runtime_name(const std::string& name, const std::vector<int64_t>& shape) {
  if (find_segments(name, "model.language_model", true) != std::string::npos) return true;
  return shape.size() == 3 && (ends_with_segments(name, "experts.gate_up_proj") || ends_with_segments(name, "experts.down_proj"));
}

bool dot_natural_less(const std::string& a, const std::string& b) {
  // One dotted part as transformers' key: (0, number) for digits; (1, text, trailing number?).
  struct Part {
    int kind = 1;
    std::string text;
    bool has_number = false;
    uint64_t number = 0;
    bool operator<(const Part& o) const {
      if (kind != o.kind) return kind < o.kind;
      if (text != o.text) return text < o.text;
      if (has_number != o.has_number) return !has_number;  // a shorter tuple sorts first
      return number < o.number;
    }
  };
  // Digit runs beyond 19 digits saturate (no model names a layer that large).
  auto number = [](const std::string& digits) {
    return digits.size() > 19 ? UINT64_MAX : static_cast<uint64_t>(std::stoull(digits));
  };
  auto parts = [&](const std::string& s) {
    std::vector<Part> out;
    size_t pos = 0;
    while (true) {
      const size_t dot = s.find('.', pos);
      const std::string p = s.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
      size_t digits = p.size();
      while (digits > 0 && std::isdigit(static_cast<unsigned char>(p[digits - 1]))) --digits;
      Part part;
      if (digits == 0 && !p.empty()) {
        part.kind = 0;
        part.has_number = true;
        part.number = number(p);
      } else {
        part.text = p.substr(0, digits);
        part.has_number = digits < p.size();
        if (part.has_number) part.number = number(p.substr(digits));
      }
      out.push_back(std::move(part));
      if (dot == std::string::npos) return out;
      pos = dot + 1;
    }
  };
  const auto pa = parts(a), pb = parts(b);
  return std::lexicographical_compare(pa.begin(), pa.end(), pb.begin(), pb.end());
}

}  // namespace shardmerge
