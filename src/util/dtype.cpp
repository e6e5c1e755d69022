#include "shardmerge/dtype.hpp"

#include <array>

namespace shardmerge {
namespace {

// safetensors' Rust writer sorts tensors by dtype alignment, descending; st_alignment_rank
// reproduces its enum order (U64/I64/F64/C64 first, BOOL last) so our files look the same.
constexpr std::array<DTypeInfo, 21> kTable = {{
    {DType::Bool, 1, "bool", "BoolStorage", "BOOL", false, 0},
    {DType::U8, 1, "uint8", "ByteStorage", "U8", false, 4},
    {DType::I8, 1, "int8", "CharStorage", "I8", false, 5},
    {DType::I16, 2, "int16", "ShortStorage", "I16", false, 11},
    {DType::U16, 2, "uint16", "", "U16", false, 12},
    {DType::I32, 4, "int32", "IntStorage", "I32", false, 15},
    {DType::U32, 4, "uint32", "", "U32", false, 16},
    {DType::I64, 8, "int64", "LongStorage", "I64", false, 20},
    {DType::U64, 8, "uint64", "", "U64", false, 21},
    {DType::F16, 2, "float16", "HalfStorage", "F16", true, 13},
    {DType::BF16, 2, "bfloat16", "BFloat16Storage", "BF16", true, 14},
    {DType::F32, 4, "float32", "FloatStorage", "F32", true, 17},
    {DType::F64, 8, "float64", "DoubleStorage", "F64", true, 19},
    {DType::C32, 4, "complex32", "", "", true, 0},
    {DType::C64, 8, "complex64", "ComplexFloatStorage", "C64", true, 18},
    {DType::C128, 16, "complex128", "ComplexDoubleStorage", "", true, 0},
    {DType::F8_E4M3, 1, "float8_e4m3fn", "", "F8_E4M3", true, 7},
    {DType::F8_E5M2, 1, "float8_e5m2", "", "F8_E5M2", true, 6},
    {DType::F8_E8M0, 1, "float8_e8m0fnu", "", "F8_E8M0", true, 8},
    {DType::F8_E4M3FNUZ, 1, "float8_e4m3fnuz", "", "F8_E4M3FNUZ", true, 9},
    {DType::F8_E5M2FNUZ, 1, "float8_e5m2fnuz", "", "F8_E5M2FNUZ", true, 10},
}};

// dtype_info() indexes the table by enum value.
constexpr bool table_in_enum_order() {
  for (size_t i = 0; i < kTable.size(); ++i)
    if (static_cast<size_t>(kTable[i].dtype) != i) return false;
  return true;
}
static_assert(table_in_enum_order(), "kTable must list dtypes in DType order");

template <typename Field>
std::optional<DType> find_by(Field field, std::string_view value) {
  if (value.empty()) return std::nullopt;
  for (const auto& info : kTable)
    if (info.*field == value) return info.dtype;
  return std::nullopt;
}

}  // namespace

const DTypeInfo& dtype_info(DType t) { return kTable[static_cast<size_t>(t)]; }

std::optional<DType> dtype_from_torch_name(std::string_view name) {
  // Aliases that torch pickles under their canonical names but users and configs spell otherwise.
  if (name == "float") return DType::F32;
  if (name == "half") return DType::F16;
  if (name == "double") return DType::F64;
  if (name == "long") return DType::I64;
  if (name == "int") return DType::I32;
  if (name == "short") return DType::I16;
  return find_by(&DTypeInfo::torch_name, name);
}

std::optional<DType> dtype_from_storage_class(std::string_view name) {
  return find_by(&DTypeInfo::legacy_storage, name);
}

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  return find_by(&DTypeInfo::st_name, name);
}

std::optional<DType> dtype_from_user(std::string_view name) {
  if (name == "bf16") return DType::BF16;
  if (name == "fp16" || name == "f16") return DType::F16;
  if (name == "fp32" || name == "f32") return DType::F32;
  if (name == "fp64" || name == "f64") return DType::F64;
  if (auto t = dtype_from_torch_name(name)) return t;
  return dtype_from_safetensors(name);
}

}  // namespace shardmerge
