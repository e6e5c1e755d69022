// A directory of the fuzzer process's own under the temp dir, for targets whose parser reads
// files; removed when the fuzzer exits.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& prefix)
      : path(std::filesystem::temp_directory_path() / (prefix + std::to_string(getpid()))) {}
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};
