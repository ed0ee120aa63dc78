# Precompiled headers for the server, client and their test suites (GCC only).
#
# Why: parsing the gRPC, protobuf, Abseil and GoogleTest headers is most of each of these files'
# compile time (an end-to-end test file at -Og: ~9 s of CPU, ~4.5 s with them precompiled), and CI
# compiles these files in three trees (CPU, ASan+UBSan, TSan) on two cores.
#
# One header is compiled per group and reused by every target of the group (REUSE_FROM), so it is
# compiled once per tree, not once per test executable. GCC uses a precompiled header only where
# it was made with the same code-generation flags and with no macro the user lacks: each group's
# host is an object library of no sources of its own, with no definitions and the group's -fPIC /
# -fPIE and optimisation flags, so every member qualifies (-Winvalid-pch, which CMake adds, names
# any that does not; it then parses the header instead: slower, never wrong). Clang rejects a
# header made with other -D macros outright, hence GCC only (the fuzz build is clang).
option(FUSEDLAYER_PCH "Precompile the headers shared by the server, client and their suites (GCC)" ON)

# fusedlayer_precompile_headers(HOST name HEADER file [PIE] LINK libs... TARGETS targets...)
#   HOST     the object library that compiles HEADER (made here, in the calling directory, so it
#            gets that directory's compile options)
#   PIE      the targets are executables (-fPIE); without it, libraries (-fPIC)
#   LINK     what the host links for include directories and the definitions the header depends on
#   TARGETS  the targets that reuse it (names that are not targets of this build are skipped)
function(fusedlayer_precompile_headers)
  cmake_parse_arguments(PCH "PIE" "HOST;HEADER" "LINK;TARGETS" ${ARGN})
  if(NOT FUSEDLAYER_PCH OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    return()
  endif()
  add_library(${PCH_HOST} OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch/anchor.cc)
  target_link_libraries(${PCH_HOST} PRIVATE ${PCH_LINK})
  target_include_directories(${PCH_HOST} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/pch)
  if(PCH_PIE)
    set_target_properties(${PCH_HOST} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${PCH_HOST} PRIVATE -fPIE)
  endif()
  target_precompile_headers(${PCH_HOST} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${PCH_HEADER}>")
  foreach(t ${PCH_TARGETS})
    if(TARGET ${t})
      target_precompile_headers(${t} REUSE_FROM ${PCH_HOST})
    endif()
  endforeach()
endfunction()
