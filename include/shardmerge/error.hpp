// One error type for everything that can go wrong with user input: a checkpoint file, a
// directory layout, a plan, a command line. It carries the context a user needs to act
// (which file, which tensor, which byte) and prints as a single line.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace shardmerge {

// Process exit codes used by the CLI.
enum class ExitCode : int { ok = 0, failure = 1, usage = 2 };

class Error : public std::exception {
 public:
  explicit Error(std::string message, ExitCode code = ExitCode::failure)
      : message_(std::move(message)), code_(code) {
    render();
  }

  // Context is added as the exception travels up; the innermost (most precise) value wins.
  Error& file(const std::string& path) {
    if (file_.empty()) file_ = path;
    render();
    return *this;
  }
  Error& tensor(const std::string& name) {
    if (tensor_.empty()) tensor_ = name;
    render();
    return *this;
  }
  Error& offset(uint64_t byte_offset) {
    if (!offset_) offset_ = byte_offset;
    render();
    return *this;
  }

  const std::string& message() const { return message_; }
  const std::string& file() const { return file_; }
  const std::string& tensor() const { return tensor_; }
  const std::optional<uint64_t>& offset() const { return offset_; }
  ExitCode exit_code() const { return code_; }
  const char* what() const noexcept override { return line_.c_str(); }

 private:
  void render() {
    line_.clear();
    if (!file_.empty()) line_ += file_ + ": ";
    if (!tensor_.empty()) line_ += "tensor '" + tensor_ + "': ";
    if (offset_) line_ += "at byte " + std::to_string(*offset_) + ": ";
    line_ += message_;
  }

  std::string message_;
  std::string file_;
  std::string tensor_;
  std::optional<uint64_t> offset_;
  ExitCode code_;
  std::string line_;
};

// A command line that cannot be run as written (exit 2), e.g. a path that does not exist.
inline Error usage_error(std::string message) { return Error(std::move(message), ExitCode::usage); }

}  // namespace shardmerge
