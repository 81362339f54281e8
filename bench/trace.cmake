# trace_replay: replays a Mooncake-format trace through the storage engine (and the oracle)
# and prints prefix hit rates per policy and capacity (docs/perf-policy.md).
add_executable(trace_replay ${CMAKE_CURRENT_SOURCE_DIR}/trace_replay.c)
target_link_libraries(trace_replay PRIVATE tkv_storage)
