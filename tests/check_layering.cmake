# The folders' one-way layering, checked over every #include "folder/..." line:
#   formats -> layouts (summaries) -> plan (a pure combine, then build) -> pipeline (orchestration)
#   -> exec -> write / verify
# with util and the public include/shardmerge/ below everything, the sharding arithmetic
# (geometry/) below layouts and plan, kernels beside exec, synthetic checkpoints (synth/) beside
# layouts, and the CLI on top. A folder may include only the folders listed for it (its own
# included). Run by ctest:
#   cmake -DROOT=<source dir> -P tests/check_layering.cmake
# Prints every forbidden include as "file: includes folder/header (folder may include: ...)"
# and fails when there is one.
cmake_minimum_required(VERSION 3.20)
if(NOT ROOT)
  message(FATAL_ERROR "check_layering: pass -DROOT=<source dir>")
endif()

set(allowed_shardmerge shardmerge)
set(allowed_util util shardmerge)
set(allowed_kernels kernels util shardmerge)
set(allowed_formats formats util shardmerge)
# Sharding arithmetic (torch.chunk, DTensor placements to slices, tiling) shared by the layouts
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
set(allowed_python python api pipeline util shardmerge)
set(allowed_cli cli api reshard synth verify write exec pipeline plan layouts geometry formats kernels util shardmerge)
set(known shardmerge util kernels formats geometry layouts plan pipeline exec write verify synth reshard api python cli)

file(GLOB_RECURSE sources RELATIVE "${ROOT}"
     "${ROOT}/src/*.cpp" "${ROOT}/src/*.hpp" "${ROOT}/src/*.cu" "${ROOT}/src/*.cuh"
     "${ROOT}/kernels/*.cpp" "${ROOT}/kernels/*.hpp" "${ROOT}/kernels/*.cu" "${ROOT}/kernels/*.cuh"
     "${ROOT}/include/shardmerge/*.hpp")
set(violations 0)
foreach(rel IN LISTS sources)
  # The folder a file belongs to: src/<folder>/..., kernels/..., include/shardmerge/...
  if(rel MATCHES "^src/([a-z_]+)/")
    set(folder "${CMAKE_MATCH_1}")
  elseif(rel MATCHES "^kernels/")
    set(folder kernels)
  elseif(rel MATCHES "^include/shardmerge/")
    set(folder shardmerge)
  else()
    continue()
  endif()
  if(NOT folder IN_LIST known)
    message(SEND_ERROR "${rel}: folder '${folder}' has no place in the layering (tests/check_layering.cmake)")
    math(EXPR violations "${violations} + 1")
    continue()
  endif()
  file(STRINGS "${ROOT}/${rel}" includes REGEX "^[ \t]*#[ \t]*include[ \t]+\"[a-z_]+/")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]+\"([a-z_]+)/([^\"]*)\".*" "\\1;\\2" parts "${line}")
    list(GET parts 0 target)
    list(GET parts 1 header)
    if(NOT target IN_LIST allowed_${folder})
      string(REPLACE ";" ", " may "${allowed_${folder}}")
      message(SEND_ERROR "${rel}: includes ${target}/${header} (${folder}/ may include: ${may})")
      math(EXPR violations "${violations} + 1")
    endif()
  endforeach()
endforeach()

list(LENGTH sources checked)
if(violations GREATER 0)
  message(FATAL_ERROR "check_layering: ${violations} forbidden include(s) in ${checked} files")
endif()
message(STATUS "check_layering: ${checked} files, every include follows the layering")
