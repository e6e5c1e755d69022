// shardmerge: verl / FSDP / Megatron checkpoints to HuggingFace safetensors.
#include <cstdio>
#include <exception>

#include "cli/commands.hpp"
#include "shardmerge/error.hpp"

int main(int argc, char** argv) {
  using namespace shardmerge;
  CLI::App app{"shardmerge: merge distributed training checkpoints (verl FSDP, Megatron) into HuggingFace safetensors"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shardmerge 0.1.0");
  cli::Runner run;
  cli::add_inspect(app, run);
  cli::add_plan(app, run);
  cli::add_merge(app, run);
  cli::add_verify(app, run);
  cli::add_diff(app, run);
  cli::add_fold_lora(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : static_cast<int>(ExitCode::usage);
  }
  try {
    return run();
  } catch (const Error& e) {
    std::fprintf(stderr, "shardmerge: error: %s\n", e.what());
    return static_cast<int>(e.exit_code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardmerge: error: %s\n", e.what());
    return static_cast<int>(ExitCode::failure);
  }
}
