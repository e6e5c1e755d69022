// Element types: the union of what torch checkpoints hold and what safetensors can store,
// with each format's spelling. One table, so that a new dtype is one line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace shardmerge {

enum class DType : uint8_t {
  Bool,
  U8,
  I8,
  I16,
  U16,
  I32,
  U32,
  I64,
  U64,
  F16,
  BF16,
  F32,
  F64,
  C32,  // complex32 (torch only)
  C64,
  C128,  // complex128 (torch only)
  F8_E4M3,
  F8_E5M2,
  F8_E8M0,
  F8_E4M3FNUZ,
  F8_E5M2FNUZ,
};

struct DTypeInfo {
  DType dtype;
  uint8_t size;                    // bytes per element
  std::string_view torch_name;     // torch.<name>
  std::string_view legacy_storage; // torch.<X>Storage, empty for dtypes saved as UntypedStorage
  std::string_view st_name;        // safetensors dtype string, empty when safetensors cannot hold it
  bool is_floating;                // floating point (incl. complex): what --dtype casts apply to
  uint8_t st_alignment_rank;       // safetensors writer order: higher sorts first
};

const DTypeInfo& dtype_info(DType t);
inline uint8_t dtype_size(DType t) { return dtype_info(t).size; }
inline std::string_view dtype_name(DType t) { return dtype_info(t).torch_name; }
inline bool is_floating(DType t) { return dtype_info(t).is_floating; }
// Complex tensors are refused at planning: no HF model stores them, casts would drop the
// imaginary part, and safetensors' reference reader does not know C32/C128.
inline bool is_complex(DType t) { return t == DType::C32 || t == DType::C64 || t == DType::C128; }

std::optional<DType> dtype_from_torch_name(std::string_view name);      // "bfloat16"
std::optional<DType> dtype_from_storage_class(std::string_view name);   // "BFloat16Storage"
std::optional<DType> dtype_from_safetensors(std::string_view name);     // "BF16"
std::optional<DType> dtype_from_user(std::string_view name);            // "bf16", "bfloat16", "fp32", ...

}  // namespace shardmerge
