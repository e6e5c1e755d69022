// Optional fields of the JSON files found beside checkpoints (config.json, adapter_config.json,
// lora_train_meta.json, ckpt_contents.json, ...), read with the file and the field named in
// every error: nlohmann's own type errors ("type must be string, but is number") name neither.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>

#include "shardmerge/error.hpp"

namespace shardmerge {

namespace json_fields_detail {

template <typename T>
std::string expected_name() {
  if constexpr (std::is_same_v<T, bool>) return "a boolean";
  else if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else if constexpr (std::is_same_v<T, uint64_t>) return "a non-negative integer";
  else if constexpr (std::is_integral_v<T>)
    return "an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
           std::to_string(std::numeric_limits<T>::max()) + "]";
  else return "a number";
}

// Integers must fit T: a negative value is not read as a huge unsigned one, nor a large one cut short.
template <typename T, typename Json>
bool holds(const Json& v) {
  if constexpr (std::is_same_v<T, bool>) return v.is_boolean();
  else if constexpr (std::is_same_v<T, std::string>) return v.is_string();
  else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned())
      return v.template get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
    const int64_t x = v.template get<int64_t>();
    if constexpr (std::is_unsigned_v<T>) return x >= 0 && static_cast<uint64_t>(x) <= std::numeric_limits<T>::max();
    else return x >= std::numeric_limits<T>::min() && x <= std::numeric_limits<T>::max();
  } else return v.is_number();
}

}  // namespace json_fields_detail

// `object[key]` as T (bool, std::string, an integer type or double); nullopt when `object` is not an
// object or has no such key or holds null there. Another type is an Error naming `file` and
// the field (`parent.key` when `parent` is given).
template <typename T, typename Json>
std::optional<T> json_field(const Json& object, const std::string& key, const std::string& file,
                            const std::string& parent = "") {
  if (!object.is_object()) return std::nullopt;
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!json_fields_detail::holds<T>(*it)) {
    std::string value = it->dump();
    if (value.size() > 40) value = value.substr(0, 40) + "...";
    throw Error("'" + (parent.empty() ? key : parent + "." + key) + "' is " + value + ", not " +
                json_fields_detail::expected_name<T>())
        .file(file);
  }
  return it->template get<T>();
}

// A HuggingFace config.json's language-model part: a multimodal config (transformers 5's
// Qwen2.5-VL, Qwen3.5, ...) states the decoder's sizes in a nested text_config; a text model's
// config is its own.
inline const nlohmann::ordered_json& hf_text_config(const nlohmann::ordered_json& config) {
  return config.contains("text_config") && config["text_config"].is_object() ? config["text_config"] : config;
}

}  // namespace shardmerge
