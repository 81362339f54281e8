# storage_bench: L3 throughput against fio on the same file system, prefix lookups, key
# derivation. Run: build/bench/storage_bench [--json] (see docs/perf.md).
add_executable(storage_bench ${CMAKE_CURRENT_SOURCE_DIR}/storage_bench.c)
target_link_libraries(storage_bench PRIVATE tkv_storage m)
