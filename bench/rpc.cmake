# rpc_bench: lookup round trip and lookups/s over the UNIX socket against redis-server GET, and
# get bandwidth through the mapped L2 pool against memcpy (docs/perf.md).
if(TARGET kvclient AND TARGET tierkvd)
  add_executable(rpc_bench ${CMAKE_CURRENT_SOURCE_DIR}/rpc_bench.c)
  target_include_directories(rpc_bench PRIVATE ${CMAKE_SOURCE_DIR}/tests/client)
  target_compile_definitions(rpc_bench PRIVATE TKV_BUILD_DIR="${CMAKE_BINARY_DIR}")
  target_link_libraries(rpc_bench PRIVATE kvclient Threads::Threads m)
  add_dependencies(rpc_bench tierkvd)
endif()
