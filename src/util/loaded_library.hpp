// Shared libraries loaded when first needed (dlopen), not at program start: the binary must start
// on machines without them, and some cost resident memory a run that does not use them should
// not pay (cuBLAS, OpenBLAS, NCCL). Header-only: kernels/ uses it too.
#pragma once

#include <dlfcn.h>

#include <exception>
#include <mutex>
#include <string>

#include "shardmerge/error.hpp"

namespace shardmerge {

// Opens `name` for the life of the process; throws an Error saying what needs it, why it cannot
// be loaded, and `remedy`.
inline void* open_library(const std::string& name, const std::string& needed_for, const std::string& remedy) {
  void* lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    throw Error(needed_for + " needs " + name + ", which cannot be loaded (" + (why ? why : "not found") + "); " + remedy);
  }
  return lib;
}

// Resolves `symbol` of the library `lib` (opened as `name`) into `f`.
template <class F>
void resolve_symbol(void* lib, const std::string& name, const char* symbol, F& f) {
  f = reinterpret_cast<F>(::dlsym(lib, symbol));
  if (!f) throw Error(name + " has no " + symbol + " (a version older than the one shardmerge was built with?)");
}

// What `Load()` returns, computed once: the first caller loads, every later one gets the same
// value, or the same exception again.
template <auto Load>
const auto& load_once() {
  using Api = decltype(Load());
  static std::once_flag once;
  static Api api{};
  static std::exception_ptr failure;
  std::call_once(once, [] {
    try {
      api = Load();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (failure) std::rethrow_exception(failure);
  return api;
}

}  // namespace shardmerge
