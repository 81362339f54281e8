# l4_bench: the shared tier's put/get rates against redis-benchmark on one Redis Cluster it
# starts itself. Run: build/bench/l4_bench [--blocks N] [--json FILE] (see docs/perf.md).
add_executable(l4_bench ${CMAKE_CURRENT_SOURCE_DIR}/l4_bench.c)
target_link_libraries(l4_bench PRIVATE tkv_storage m)
