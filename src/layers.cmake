# The layers of shardmerge, one folder each, and which folders each may use: the one table that
# the build (src/CMakeLists.txt links one library per folder to the libraries of the folders
# listed for it) and the layering checks (tests/check_layering.cmake for #include lines,
# tests/check_link_layering.sh for the symbols each library's objects call) read.
#   formats -> layouts (summaries) -> plan (a pure combine, then build) -> pipeline (orchestration)
#   -> exec -> write / verify -> api -> cli / python
# with util and the public include/shardmerge/ (the ground floor, one library) below everything,
# the sharding arithmetic (geometry/) below layouts and plan, kernels beside exec, synthetic
# checkpoints (synth/) beside layouts. A folder may use the folders listed for it (its own included).
set(allowed_shardmerge shardmerge)
set(allowed_util util shardmerge)
set(allowed_kernels kernels util shardmerge)
set(allowed_formats formats util shardmerge)
# Sharding arithmetic (torch.chunk, DTensor placements to slices, tiling) shared by the layouts'
# combine step and the planner.
set(allowed_geometry geometry formats util shardmerge)
set(allowed_layouts layouts geometry formats util shardmerge)
set(allowed_plan plan layouts geometry formats util shardmerge)
# The orchestration above layouts and plan: detect, summarise, combine, build.
set(allowed_pipeline pipeline plan layouts geometry formats util shardmerge)
# The executor boundary: executors run plans (include/shardmerge/plan.hpp), never parse.
set(allowed_exec exec kernels util shardmerge)
set(allowed_write write util shardmerge)
set(allowed_verify verify exec pipeline plan layouts geometry formats util shardmerge)
# Synthetic checkpoints (for benchmarks) are written with the formats' writers, named as layouts name them.
set(allowed_synth synth layouts formats util shardmerge)
# Reshard: pure planning (row_moves, target) and its executor (rank_files, reshard), which reads
# sources through exec's record checker and writes through write's atomic tree writer.
set(allowed_reshard reshard write exec layouts geometry formats util shardmerge)
# One function per operation (inspect, plan, merge, verify) returning its JSON summary: what the
# CLI's subcommands print and the Python module (python/) returns.
set(allowed_api api verify write exec pipeline plan layouts geometry formats kernels util shardmerge)
set(allowed_python python api util shardmerge)
set(allowed_cli cli api reshard synth verify write exec pipeline plan layouts geometry formats kernels util shardmerge)
set(shardmerge_layers shardmerge util kernels formats geometry layouts plan pipeline exec write verify synth reshard api
    python cli)
