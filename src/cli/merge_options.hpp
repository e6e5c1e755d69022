// Options shared by `plan`, `merge` and `verify`: verl's spellings and ours, filled into the
// option values of api/options.hpp.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "api/merge.hpp"
#include "api/options.hpp"

namespace shardmerge::cli {

struct MergeCliOptions {
  api::MergeOptions plan;
  bool trust_remote_code = false;  // accepted for verl compatibility: nothing is executed anyway
  int verbose = 0;
};

void add_merge_options(CLI::App* cmd, MergeCliOptions& o);

// --lora-alpha and --force-lora-alpha (`merge`, `plan`, `verify`, `fold-lora`).
void add_lora_alpha_options(CLI::App* cmd, double& alpha, bool& force);

// How a plan is carried out and written (`merge`, `fold-lora`), and how the result is shown.
struct ExecCliOptions {
  api::WriteOptions write;
  bool json = false;
  int verbose = 0;  // the subcommand's -v: phase timings and one line per output tensor
};

void add_exec_options(CLI::App* cmd, ExecCliOptions& o);

// --device and --gpu-memory (`merge`, `fold-lora`, `verify`).
void add_device_options(CLI::App* cmd, std::string& device, std::string& gpu_memory);
// A byte size as parse_size reads it ("5GB", "500MiB"), positive; "auto" too where allowed. A bad
// value fails parsing, so the error names the flag and exits 2.
CLI::Validator byte_size_check(bool allow_auto = false);
// Runs api::merge with a progress bar, then prints its summary (as JSON with --json).
int write_merge(const api::MergeSource& source, const ExecCliOptions& o);

}  // namespace shardmerge::cli
