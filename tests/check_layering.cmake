# The folders' one-way layering (src/layers.cmake), checked over every #include "folder/..." line:
# a file of folder F may include only the folders listed for F. Run by ctest:
#   cmake -DROOT=<source dir> [-DLAYERS=<layers.cmake>] -P tests/check_layering.cmake
# Prints every forbidden include as "file: includes folder/header (folder may include: ...)"
# and fails when there is one. tests/check_link_layering.sh checks the same table at link time.
cmake_minimum_required(VERSION 3.20)
if(NOT ROOT)
  message(FATAL_ERROR "check_layering: pass -DROOT=<source dir>")
endif()
if(NOT LAYERS)
  set(LAYERS "${ROOT}/src/layers.cmake")
endif()
include("${LAYERS}")
set(known ${shardmerge_layers})

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
