// Subcommands of the shardmerge CLI. Each add_* registers its options on `app` and, when the
// subcommand is chosen, sets `run` to the function that carries it out (returning the exit code).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace shardmerge::cli {

using Runner = std::function<int()>;

void add_inspect(CLI::App& app, Runner& run);
void add_plan(CLI::App& app, Runner& run);
void add_merge(CLI::App& app, Runner& run);
void add_verify(CLI::App& app, Runner& run);
void add_diff(CLI::App& app, Runner& run);
void add_fold_lora(CLI::App& app, Runner& run);
void add_ls(CLI::App& app, Runner& run);
void add_prune(CLI::App& app, Runner& run);
void add_bench(CLI::App& app, Runner& run);
void add_reshard(CLI::App& app, Runner& run);

}  // namespace shardmerge::cli
