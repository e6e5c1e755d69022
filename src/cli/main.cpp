// shardmerge: verl / FSDP / Megatron checkpoints to HuggingFace safetensors.
#include <cstdio>
#include <exception>

#include "cli/commands.hpp"
#include "shardmerge/error.hpp"
#include "util/interrupt.hpp"
#include "util/printable.hpp"

int main(int argc, char** argv) {
  using namespace shardmerge;
  // First, before any thread exists: every thread then inherits the blocked signals.
  interrupt::install_handler();
  CLI::App app{"shardmerge: merge distributed training checkpoints (verl FSDP, Megatron) into HuggingFace safetensors"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shardmerge " SHARDMERGE_VERSION);
  // Every option's default is part of its --help line (subcommands inherit this).
  app.option_defaults()->always_capture_default();
  cli::Runner run;
  cli::add_inspect(app, run);
  cli::add_plan(app, run);
  cli::add_merge(app, run);
  cli::add_verify(app, run);
  cli::add_diff(app, run);
  cli::add_fold_lora(app, run);
  cli::add_ls(app, run);
  cli::add_prune(app, run);
  cli::add_bench(app, run);
  cli::add_reshard(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // One line, like every other error; CLI11's messages name the flag ("--dtype: foo not in {...}").
    std::fprintf(stderr, "shardmerge: error: %s (see --help)\n", printable(e.what()).c_str());
    return static_cast<int>(ExitCode::usage);
  }
  try {
    return run();
  } catch (const Error& e) {
    std::fprintf(stderr, "shardmerge: error: %s\n", printable(e.what()).c_str());
    return static_cast<int>(e.exit_code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardmerge: error: %s\n", printable(e.what()).c_str());
    return static_cast<int>(ExitCode::failure);
  }
}
