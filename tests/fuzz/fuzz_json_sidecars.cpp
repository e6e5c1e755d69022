// libFuzzer target: the JSON files verl writes beside a checkpoint, read the way a merge reads
// them. The first byte chooses the file (fsdp_config.json, lora_train_meta.json,
// adapter_config.json, ckpt_contents.json, or an HF config.json also handed to the Megatron
// mapping and the dtype rule); the rest is its content, written into a scratch checkpoint
// directory that `detect` then reads. Any problem must be a shardmerge::Error (exit 1 with
// the file named), never a stray nlohmann or standard-library exception.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "layouts/layout.hpp"
#include "plan/build.hpp"
#include "plan/lora.hpp"
#include "plan/megatron_names.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

#include "scratch_dir.hpp"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const ScratchDir scratch_dir("shardmerge-fuzz-json-");
  const fs::path& root = scratch_dir.path;
  std::error_code ec;
  fs::remove_all(root, ec);
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const fs::path actor = root / "actor";
  fs::create_directories(actor / "huggingface");
  shardmerge::write_small_file((actor / "model_world_size_1_rank_0.pt").string(), "");
  const char* const names[] = {"fsdp_config.json", "lora_train_meta.json", "lora_adapter/adapter_config.json",
                               "huggingface/config.json", "ckpt_contents.json"};
  const std::string name = names[data[0] % 5];
  fs::path file = actor / name;
  if (name == "ckpt_contents.json") {
    fs::remove(actor / "model_world_size_1_rank_0.pt");
    fs::create_directories(actor / "model" / "dist_ckpt");
  }
  fs::create_directories(file.parent_path());
  shardmerge::write_small_file(file.string(), text, /*overwrite=*/true);
  try {
    shardmerge::layouts::detect(actor.string());
  } catch (const shardmerge::Error&) {
  }
  // The readers that take the parsed document: what the planner does with a valid JSON file.
  const auto parsed = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return 0;
  try {
    if (name == "lora_train_meta.json") shardmerge::lora_config_from_train_meta(nlohmann::json(parsed), file.string());
    if (name == "lora_adapter/adapter_config.json")
      shardmerge::lora_config_from_adapter_config(nlohmann::json(parsed), file.string());
    if (name == "huggingface/config.json") {
      shardmerge::config_dtype(parsed);
      shardmerge::SourceSet empty;
      shardmerge::map_megatron_to_hf(empty, parsed, {});
    }
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
