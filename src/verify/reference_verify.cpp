#include "verify/reference_verify.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "formats/hf_index.hpp"
#include "layouts/layout.hpp"
#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"
#include "util/shape.hpp"
#include "verify/reference_model.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

// ---- per-element values and casts --------------------------------------------------------
// The casts are the shared per-element functions of shardmerge/convert.hpp: they are the
// definition of torch's rounding here, and have their own tests (test_convert.cpp).

bool decodes_to_float(DType t) {
  switch (t) {
    case DType::F16:
    case DType::BF16:
    case DType::F32:
    case DType::F64:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
    case DType::F8_E8M0:
    case DType::F8_E4M3FNUZ:
    case DType::F8_E5M2FNUZ:
      return true;
    default:
      return false;
  }
}

// Wider types go through float, as torch (and convert.hpp) do.
float to_f32(const uint8_t* p, DType t) {
  uint16_t h;
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::F64: {
      double d;
      std::memcpy(&d, p, 8);
      return static_cast<float>(d);
    }
    case DType::BF16:
      std::memcpy(&h, p, 2);
      return convert::bf16_to_f32(h);
    case DType::F16:
      std::memcpy(&h, p, 2);
      return convert::f16_to_f32(h);
    case DType::F8_E4M3:
      return convert::f8e4m3fn_to_f32(*p);
    case DType::F8_E5M2:
      return convert::f8e5m2_to_f32(*p);
    case DType::F8_E8M0:
      return convert::f8e8m0_to_f32(*p);
    case DType::F8_E4M3FNUZ:
      return convert::f8e4m3fnuz_to_f32(*p);
    case DType::F8_E5M2FNUZ:
      return convert::f8e5m2fnuz_to_f32(*p);
    default:
      throw Error("verify: " + std::string(dtype_name(t)) + " is not a floating-point type");
  }
}

double to_f64(const uint8_t* p, DType t) {
  if (t != DType::F64) return to_f32(p, t);
  double d;
  std::memcpy(&d, p, 8);
  return d;
}

void from_f32(float f, uint8_t* out, DType t) {
  uint16_t h;
  switch (t) {
    case DType::F32:
      std::memcpy(out, &f, 4);
      return;
    case DType::F64: {
      const double d = f;
      std::memcpy(out, &d, 8);
      return;
    }
    case DType::BF16:
      h = convert::f32_to_bf16(f);
      std::memcpy(out, &h, 2);
      return;
    case DType::F16:
      h = convert::f32_to_f16(f);
      std::memcpy(out, &h, 2);
      return;
    default:
      throw Error("verify: cannot write " + std::string(dtype_name(t)));
  }
}

void cast_element(const uint8_t* in, DType from, uint8_t* out, DType to) {
  if (from == to) {
    std::memcpy(out, in, dtype_size(to));
    return;
  }
  if (!decodes_to_float(from))
    throw Error("verify: no cast from " + std::string(dtype_name(from)) + " to " + std::string(dtype_name(to)));
  from_f32(to_f32(in, from), out, to);
}

// The distance from `x` to the next value of `t` away from zero: one ulp of the output.
double ulp_at(double x, DType t) {
  const double m = std::fabs(x);
  if (t == DType::F64) return std::nextafter(m, INFINITY) - m;
  const auto f = static_cast<float>(m);
  if (t == DType::F32) return static_cast<double>(std::nextafter(f, INFINITY)) - f;
  uint8_t a[8], b[8];
  from_f32(f, a, t);
  uint16_t h;
  std::memcpy(&h, a, 2);
  ++h;
  std::memcpy(b, &h, 2);
  return std::fabs(to_f64(b, t) - to_f64(a, t));
}

// ---- output element -> source element ---------------------------------------------------

// Walks a tensor of `map.shape` in row-major order, fetching the source element of each.
class SourceWalk {
 public:
  SourceWalk(const ReferenceSources& sources, const SourceMap& map)
      : map_(map), fetch_(sources, *map.source), out_(map.shape.size(), 0), src_(map.lead) {
    src_.resize(map.lead.size() + map.shape.size());
    if (src_.size() != map.source->shape.size())
      throw Error("verify: an output of " + std::to_string(map.shape.size()) + " dims cannot come from this " +
                  std::to_string(map.source->shape.size()) + "-d source")
          .tensor(map.source->name);
  }
  // Fetches up to `max` elements from the current index on, within one innermost row (a
  // row-mapped 1-d tensor: one element), into `out`, and moves past them. Returns how many;
  // `not_once` counts those not held by exactly one source piece.
  size_t fetch(size_t max, uint8_t* out, uint64_t& not_once) {
    const size_t k = map_.lead.size(), n = out_.size();
    for (size_t d = 0; d < n; ++d) src_[k + d] = d == 0 && map_.row ? map_.row(out_[0]) : out_[d];
    int64_t run = 1;
    if (n > 1 || (n == 1 && !map_.row))
      run = std::min<int64_t>(static_cast<int64_t>(max), map_.shape[n - 1] - out_[n - 1]);
    not_once += fetch_.fetch_run(src_.data(), run, out);
    advance(run);
    return static_cast<size_t>(run);
  }

 private:
  void advance(int64_t by) {
    if (out_.empty()) return;
    out_.back() += by;
    for (size_t d = out_.size(); d-- > 1 && out_[d] >= map_.shape[d];) {
      out_[d] = 0;
      ++out_[d - 1];
    }
  }

  const SourceMap& map_;
  ElementFetcher fetch_;
  std::vector<int64_t> out_;
  std::vector<int64_t> src_;
};

// A whole small tensor (LoRA A or B) as fp32, row-major.
std::vector<float> materialise(const ReferenceSources& sources, const SourceMap& map, uint64_t& not_once) {
  SourceWalk walk(sources, map);
  const size_t es = dtype_size(map.source->dtype);
  const uint64_t n = element_count(map.shape);
  std::vector<uint8_t> raw(static_cast<size_t>(n) * es);
  for (uint64_t pos = 0; pos < n;) pos += walk.fetch(static_cast<size_t>(n - pos), raw.data() + pos * es, not_once);
  std::vector<float> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) out[i] = to_f32(raw.data() + i * es, map.source->dtype);
  return out;
}

constexpr uint64_t kBlockElements = 1u << 18;

struct OutputTensorRef {
  std::string path;
  SafetensorsTensor tensor;
};

// One output tensor to compare: `label` as reported (with its directory), `planned` the plan's.
struct Job {
  std::string label;
  const OutputTensorRef* out;
  const SourceMap* map;
  const OutputTensor* planned;
};

struct Outcome {
  TensorDiff diff;
  uint64_t not_once = 0;
  bool folded = false;
};

class Checker {
 public:
  Checker(const ReferenceModel& model, double atol) : model_(model), atol_(atol) {}

  Outcome compare(const Job& job) const {
    Outcome o;
    const File file = File::open_read(job.out->path);
    if (job.planned->lora) {
      o.diff = compare_fold(job.planned->name, file, job.out->tensor, *job.map, *job.planned->lora, o.not_once);
      o.folded = true;
    } else {
      o.diff = compare_copy(file, job.out->tensor, *job.map, o.not_once);
    }
    return o;
  }

 private:
  // Each element is the source element cast to the output dtype, bit for bit (NaN equals NaN).
  TensorDiff compare_copy(const File& file, const SafetensorsTensor& out, const SourceMap& map,
                          uint64_t& not_once) const {
    SourceWalk walk(model_.sources, map);
    const size_t es = dtype_size(out.dtype), src_es = dtype_size(map.source->dtype);
    const DType from = map.source->dtype;
    const uint64_t n = element_count(out.shape);
    std::vector<uint8_t> got, want, raw;
    TensorDiff total;
    for (uint64_t pos = 0; pos < n; pos += kBlockElements) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kBlockElements, n - pos));
      got.resize(len * es);
      want.resize(len * es);
      raw.resize(len * src_es);
      file.read_exact(out.file_offset + pos * es, got.data(), got.size());
      for (size_t i = 0; i < len;) i += walk.fetch(len - i, raw.data() + i * src_es, not_once);
      if (from != out.dtype)
        for (size_t i = 0; i < len; ++i) cast_element(raw.data() + i * src_es, from, want.data() + i * es, out.dtype);
      total.merge(compare_elements(got.data(), from == out.dtype ? raw.data() : want.data(), out.dtype, len, atol_));
    }
    return total;
  }

  // W' = W + scale * B @ A, recomputed by a plain loop in double from fp32 inputs. The merge
  // rounds an fp32 sgemm result once to the output dtype: allowed is one ulp of the output
  // dtype plus the fp32 rounding of an r-term sum.
  TensorDiff compare_fold(const std::string& name, const File& file, const SafetensorsTensor& out, const SourceMap& map,
                          const LoraFold& fold, uint64_t& not_once) const {
    const std::string module = name.substr(0, name.rfind('.'));
    auto it = model_.lora.find(module);
    if (it == model_.lora.end() || !it->second.a.source || !it->second.b.source)
      throw Error("verify: the plan folds LoRA into it, but the sources hold no adapter for module '" + module + "'");
    const LoraPair& lora = it->second;
    if (out.shape.size() != 2 || lora.a.shape.size() != 2 || lora.b.shape.size() != 2 ||
        lora.a.shape[0] != lora.b.shape[1])
      throw Error("verify: LoRA A " + shape_string(lora.a.shape) + " and B " + shape_string(lora.b.shape) +
                  " do not form a rank-r update of this weight");
    const bool transposed = fold.fan_in_fan_out || lora.embedding;  // W is [in, out] ([num, dim])
    const int64_t r = lora.a.shape[0], in = lora.a.shape[1];
    if (lora.b.shape[0] != out.shape[transposed ? 1 : 0] || in != out.shape[transposed ? 0 : 1])
      throw Error("verify: LoRA A " + shape_string(lora.a.shape) + " and B " + shape_string(lora.b.shape) +
                  " do not match the weight's shape " + shape_string(out.shape));
    const std::vector<float> a = materialise(model_.sources, lora.a, not_once);  // [r, in]
    const std::vector<float> b = materialise(model_.sources, lora.b, not_once);  // [out, r]
    std::vector<float> at(a.size());                                             // A transposed: [in, r]
    for (int64_t k = 0; k < r; ++k)
      for (int64_t x = 0; x < in; ++x) at[static_cast<size_t>(x * r + k)] = a[static_cast<size_t>(k * in + x)];
    SourceWalk walk(model_.sources, map);
    const size_t es = dtype_size(out.dtype), src_es = dtype_size(map.source->dtype);
    const uint64_t n = element_count(out.shape);
    const int64_t cols = out.shape[1];
    std::vector<uint8_t> got, raw;
    TensorDiff total;
    for (uint64_t pos = 0; pos < n; pos += kBlockElements) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kBlockElements, n - pos));
      got.resize(len * es);
      raw.resize(len * src_es);
      file.read_exact(out.file_offset + pos * es, got.data(), got.size());
      for (size_t i = 0; i < len;) i += walk.fetch(len - i, raw.data() + i * src_es, not_once);
      TensorDiff d;
      d.elements = len;
      for (size_t i = 0; i < len; ++i) {
        const auto row = static_cast<int64_t>((pos + i) / static_cast<uint64_t>(cols));
        const auto col = static_cast<int64_t>((pos + i) % static_cast<uint64_t>(cols));
        const float* b_row = &b[static_cast<size_t>((transposed ? col : row) * r)];
        const float* a_col = &at[static_cast<size_t>((transposed ? row : col) * r)];
        double delta = 0, magnitude = 0;
        for (int64_t k = 0; k < r; ++k) {
          const double term = static_cast<double>(b_row[k]) * a_col[k];
          delta += term;
          magnitude += std::fabs(term);
        }
        const double w = to_f32(raw.data() + i * src_es, map.source->dtype);
        const double want = w + fold.scale * delta;
        const double have = to_f64(got.data() + i * es, out.dtype);
        if (std::isnan(want) && std::isnan(have)) continue;
        const double err = std::fabs(have - want);
        const double allowed =
            atol_ + ulp_at(want, out.dtype) +
            static_cast<double>(r + 2) * std::ldexp(std::fabs(w) + std::fabs(fold.scale) * magnitude, -23);
        if (!(err <= allowed)) {
          ++d.mismatched;
          d.max_abs_error = std::max(d.max_abs_error, std::isnan(err) ? INFINITY : err);
        }
      }
      total.merge(d);
    }
    return total;
  }

  const ReferenceModel& model_;
  double atol_;
};

// Runs the jobs on a few threads (each reads its own windows: memory stays bounded per thread).
std::vector<Outcome> run_jobs(const Checker& checker, const std::vector<Job>& jobs) {
  std::vector<Outcome> outcomes(jobs.size());
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    for (size_t i; (i = next++) < jobs.size();) {
      try {
        outcomes[i] = checker.compare(jobs[i]);
      } catch (Error& e) {
        e.tensor(jobs[i].label);
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = jobs.size();
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = jobs.size();
      }
    }
  };
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(threads, jobs.size()); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return outcomes;
}

// The adapter tensors PEFT names `base_model.model.<module>.lora_A.weight` (lora_embedding_A).
const SourceMap* adapter_source(const ReferenceModel& model, const std::string& name) {
  std::string n = name;
  const std::string prefix = "base_model.model.";
  if (n.rfind(prefix, 0) == 0) n = n.substr(prefix.size());
  for (const auto& [suffix, is_a] : {std::pair<std::string, bool>{".lora_A.weight", true},
                                     {".lora_B.weight", false},
                                     {".lora_embedding_A", true},
                                     {".lora_embedding_B", false}}) {
    if (n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    auto it = model.lora.find(n.substr(0, n.size() - suffix.size()));
    if (it == model.lora.end()) return nullptr;
    const SourceMap& m = is_a ? it->second.a : it->second.b;
    return m.source ? &m : nullptr;
  }
  return nullptr;
}

nlohmann::ordered_json planned_config(const MergePlan& plan) {
  for (const Sidecar& s : plan.sidecars) {
    if (s.name != "config.json") continue;
    const auto j = nlohmann::ordered_json::parse(s.content ? *s.content : read_small_file(s.source), nullptr, false);
    if (j.is_object()) return j;
  }
  throw Error("verify: the merge writes no config.json, which the Megatron name mapping needs");
}

std::vector<std::string> hf_weight_paths(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& f : open_hf_weights(dir).files) out.push_back(f.path());
  return out;
}

// HF weights and, when `adapter_dir` holds one, a PEFT adapter's saved tensors.
void reference_from_hf(ReferenceModel& model, const std::string& weights_dir, const std::string& adapter_dir) {
  add_safetensors_reference(model.sources, hf_weight_paths(weights_dir), "the HF safetensors of " + weights_dir);
  const size_t base = model.sources.tensors.size();
  const fs::path adapter = fs::path(adapter_dir) / "adapter_model.safetensors";
  if (!adapter_dir.empty() && fs::is_regular_file(adapter))
    add_safetensors_reference(model.sources, {adapter.string()}, "the PEFT adapter's safetensors");
  map_peft_names(model, base);
}

// Where verify decodes a dist_ckpt's compressed items (planning never decodes them); removed
// when verify is done.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = (fs::temp_directory_path() /
             ("shardmerge-scratch-" + std::to_string(::getpid()) + "-" + std::to_string(counter++)))
                .string();
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The checkpoint the plan was made from, read its own way.
ReferenceModel open_reference(const PlannedMerge& pm, std::shared_ptr<ScratchDir>& scratch) {
  ReferenceModel model;
  const layouts::Layout layout = layouts::detect(pm.role_dir);
  if (const auto* fsdp = std::get_if<layouts::FsdpRole>(&layout.info)) {
    model.sources = reference_from_fsdp(*fsdp);
    // save_lora_only rank files folded into (or dropped onto) an HF base model.
    for (const std::string& base : pm.other_source_dirs)
      add_safetensors_reference(model.sources, hf_weight_paths(base), "the HF safetensors of " + base);
    map_peft_names(model, model.sources.tensors.size());
    if (pm.saved_names) map_saved_names(model, *pm.saved_names);
  } else if (const auto* adapter = std::get_if<layouts::PeftAdapter>(&layout.info)) {
    if (pm.other_source_dirs.empty()) throw Error("verify: a PEFT adapter without the base model it was folded into");
    reference_from_hf(model, pm.other_source_dirs.front(), adapter->path);
  } else if (const auto* megatron = std::get_if<layouts::MegatronRole>(&layout.info)) {
    const auto& hf = megatron->huggingface;
    if (megatron->model_format == "huggingface" && hf && hf->weights_complete) {
      reference_from_hf(model, hf->path, megatron->peft_adapter);
    } else if (megatron->adapter_only() && !pm.other_source_dirs.empty()) {
      // a PEFT save (the adapter alone) folded onto the base given as --hf_model_path
      reference_from_hf(model, pm.other_source_dirs.front(), megatron->peft_adapter);
    } else if (!megatron->dist_ckpt.empty()) {
      scratch = std::make_shared<ScratchDir>();
      model.sources = reference_from_dcp(megatron->dist_ckpt, scratch->path());
      map_megatron_names(model, planned_config(pm.plan));
    } else {
      model.sources = reference_from_megatron_legacy(*megatron, planned_config(pm.plan));
      map_megatron_names(model, planned_config(pm.plan));
    }
  } else if (const auto* titan = std::get_if<layouts::TorchTitanCheckpoint>(&layout.info)) {
    scratch = std::make_shared<ScratchDir>();
    model.sources = reference_from_dcp(titan->path, scratch->path());
    map_torchtitan_names(model, planned_config(pm.plan), pm.saved_names);
    if (pm.saved_names) map_saved_names(model, *pm.saved_names);
  } else if (const auto* automodel = std::get_if<layouts::AutomodelRole>(&layout.info);
             automodel && automodel->consolidated && automodel->consolidated->weights_complete) {
    reference_from_hf(model, automodel->consolidated->path, "");
  } else {
    throw Error(std::string("verify: cannot read a ") + layouts::kind_name(layout.kind) + " independently")
        .file(pm.role_dir);
  }
  return model;
}

// The tensors of the tree under test in `dir`: by the model index there is one (its file
// names may differ from the plan's), else the files the plan writes there.
std::map<std::string, OutputTensorRef> tree_tensors(const fs::path& dir,
                                                    const std::vector<std::string>& planned_files) {
  std::map<std::string, OutputTensorRef> out;
  if (fs::is_regular_file(dir / "model.safetensors") || fs::is_regular_file(dir / "model.safetensors.index.json")) {
    const HfWeights w = open_hf_weights(dir.string());
    for (const auto& [name, ref] : w.tensors) out[name] = {w.path_of(ref), *ref.tensor};
    return out;
  }
  for (const std::string& f : planned_files) {
    const fs::path p = dir / fs::path(f).filename();
    if (!fs::is_regular_file(p)) continue;
    const SafetensorsFile st = SafetensorsFile::open(p.string());
    for (const SafetensorsTensor& t : st.tensors()) out[t.name] = {p.string(), t};
  }
  return out;
}

}  // namespace

std::string ReferenceCheck::summary() const {
  char count[32];
  if (elements < 100'000)
    std::snprintf(count, sizeof count, "%llu", static_cast<unsigned long long>(elements));
  else
    std::snprintf(count, sizeof count, "%.1f M", static_cast<double>(elements) / 1e6);
  std::string s = (diff.equal() ? "verified " : "compared ") + std::to_string(tensors) + " tensors (" + count +
                  " elements) against " + route + ", independently of the merge plan; " +
                  (diff.not_covered.empty() ? std::string("every element held by exactly one source piece")
                                            : std::to_string(diff.not_covered.size()) +
                                                  " tensor(s) with elements not held by exactly one source piece");
  if (folds)
    s += "; " + std::to_string(folds) +
         " LoRA fold(s) recomputed as fp32 W + scale*B*A (plain loop, the planned scale) within 1 "
         "ulp of the output dtype";
  if (records) s += "; zip CRC-32 of the " + std::to_string(records) + " records read checked";
  return s;
}

ReferenceCheck verify_against_sources(const PlannedMerge& pm, const std::string& hf_dir, double atol) {
  ReferenceCheck result;
  std::shared_ptr<ScratchDir> scratch;
  const ReferenceModel model = open_reference(pm, scratch);
  result.route = model.sources.route();
  result.records = check_record_crcs(model.sources);

  // Output directories as the plan writes them ("" for the model, "lora_adapter", ...).
  std::map<std::string, std::vector<std::string>> files_by_dir;
  for (const OutputFile& f : pm.plan.files) files_by_dir[fs::path(f.name).parent_path().string()].push_back(f.name);
  std::vector<std::map<std::string, OutputTensorRef>> trees;  // per directory; the jobs point into them
  trees.reserve(files_by_dir.size());
  std::vector<Job> jobs;
  for (const auto& [dir, files] : files_by_dir) {
    const std::string shown = dir.empty() ? "" : dir + "/";
    const std::map<std::string, OutputTensorRef>& tree =
        trees.emplace_back(tree_tensors(fs::path(hf_dir) / dir, files));
    std::set<std::string> planned;
    for (const OutputTensor& t : pm.plan.tensors) {
      if (fs::path(pm.plan.files[t.file].name).parent_path().string() != dir) continue;
      const std::string label = shown + t.name;
      planned.insert(t.name);
      auto it = tree.find(t.name);
      if (it == tree.end()) {
        result.diff.missing.push_back(label);
        continue;
      }
      const SafetensorsTensor& have = it->second.tensor;
      auto w = model.weights.find(t.name);
      const SourceMap* map = w != model.weights.end() ? &w->second : adapter_source(model, t.name);
      if (have.dtype != t.dtype)
        result.diff.mismatched_meta.push_back(label + ": the tree has " + std::string(dtype_name(have.dtype)) +
                                              ", the merge writes " + std::string(dtype_name(t.dtype)));
      else if (!map)
        result.diff.mismatched_meta.push_back(label + ": no tensor of the checkpoint is named so");
      else if (have.shape != map->shape)
        result.diff.mismatched_meta.push_back(label + ": the tree has " + shape_string(have.shape) +
                                              ", the sources give " + shape_string(map->shape));
      else
        jobs.push_back({label, &it->second, map, &t});
    }
    for (const auto& [name, _] : tree)
      if (!planned.count(name)) result.diff.unexpected.push_back(shown + name);
  }

  const std::vector<Outcome> outcomes = run_jobs(Checker(model, atol), jobs);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Outcome& o = outcomes[i];
    if (o.not_once)
      result.diff.not_covered.push_back(jobs[i].label + ": " + std::to_string(o.not_once) +
                                        " element(s) are held by no source piece or by more than one");
    result.diff.values[jobs[i].label] = o.diff;
    result.elements += o.diff.elements;
    result.folds += o.folded ? 1 : 0;
  }
  result.tensors = jobs.size();
  return result;
}

}  // namespace shardmerge
