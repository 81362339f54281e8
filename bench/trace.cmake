# trace_replay: replays a Mooncake-format trace through the storage engine (and the oracle)
# and prints prefix hit rates per policy and capacity (docs/perf.md).
add_executable(trace_replay ${CMAKE_CURRENT_SOURCE_DIR}/trace_replay.c)
target_link_libraries(trace_replay PRIVATE tkv_storage)
# --daemon SOCKET: through a running tierkvd, with the shared libkvclient (only kvc_* symbols
# are exported, so it cannot clash with the storage library linked in for the in-process mode).
if(TARGET kvclient)
  target_link_libraries(trace_replay PRIVATE kvclient)
  target_compile_definitions(trace_replay PRIVATE TKV_HAVE_KVCLIENT)
endif()

# Smoke runs (not timed): the replay works end to end on the first requests of the shipped
# trace through the real store, and bad input is reported, skipped, or refused.
add_test(NAME bench_trace_replay_smoke
         COMMAND trace_replay --trace ${TKV_DATA_DIR}/mooncake_conversation_trace.jsonl
                 --capacity 200,1000 --requests 400 --json)
set_tests_properties(bench_trace_replay_smoke PROPERTIES TIMEOUT 300
                     PASS_REGULAR_EXPRESSION "\"policy\": \"tierkv\".*\"hit_rate\"")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/trace_bad_lines.jsonl
     "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
     "not json\n"
     "{\"timestamp\": 5, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 3]}\n"
     "{\"timestamp\": 9, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1, -2]}\n"
     "{\"timestamp\": 12, \"input_length\": 1024, \"output_length\": 7, \"hash_ids\": [1, 2]}\n")
add_test(NAME bench_trace_replay_bad_lines
         COMMAND trace_replay --trace ${CMAKE_CURRENT_BINARY_DIR}/trace_bad_lines.jsonl
                 --capacity 1 --fast)
set_tests_properties(bench_trace_replay_bad_lines PROPERTIES
                     PASS_REGULAR_EXPRESSION "trace_bad_lines.jsonl:2: bad line skipped.*:3: bad line skipped.*:4: bad line skipped.*3 bad line\\(s\\) skipped")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/trace_no_valid.jsonl "{\"timestamp\": 1}\n")
add_test(NAME bench_trace_replay_no_valid
         COMMAND trace_replay --trace ${CMAKE_CURRENT_BINARY_DIR}/trace_no_valid.jsonl
                 --capacity 1)
set_tests_properties(bench_trace_replay_no_valid PROPERTIES WILL_FAIL TRUE)

# policy_bench: nanoseconds per block operation of each registered policy at 10^4..10^6 blocks
# (O(1) per operation shows as a flat line).
add_executable(policy_bench ${CMAKE_CURRENT_SOURCE_DIR}/policy_bench.c)
target_link_libraries(policy_bench PRIVATE tkv_storage)

# --fast must model the store faithfully (same granularity, chunks and call order), so a
# policy tuned with it is tuned for the store: both modes, same requests, same hit counts.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/trace_fast_agrees.cmake [=[
foreach(mode store fast)
  set(extra "")
  if(mode STREQUAL "fast")
    set(extra --fast)
  endif()
  execute_process(COMMAND ${REPLAY} --trace ${TRACE} --capacity 200,1000 --requests 1500
                          --policy lru,tierkv,hazard --json ${extra}
                  OUTPUT_VARIABLE out_${mode} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "trace_replay (${mode}) exited with ${rc}")
  endif()
  string(REGEX MATCHALL "\"hit_blocks\": [0-9]+" hits_${mode} "${out_${mode}}")
endforeach()
list(LENGTH hits_store n)
if(NOT n EQUAL 6)
  message(FATAL_ERROR "expected 6 results, got ${n}: ${out_store}")
endif()
if(NOT hits_store STREQUAL hits_fast)
  message(FATAL_ERROR "--fast disagrees with the store: ${hits_fast} vs ${hits_store}")
endif()
message(STATUS "store and --fast agree: ${hits_store}")
]=])
add_test(NAME bench_trace_replay_fast_agrees
         COMMAND ${CMAKE_COMMAND} -DREPLAY=$<TARGET_FILE:trace_replay>
                 -DTRACE=${TKV_DATA_DIR}/mooncake_conversation_trace.jsonl
                 -P ${CMAKE_CURRENT_BINARY_DIR}/trace_fast_agrees.cmake)
set_tests_properties(bench_trace_replay_fast_agrees PROPERTIES TIMEOUT 300)


# bench/policy_model.py (a Python model of the tier manager for trying policies before building
# them in C, docs/design.md) must model the same manager: its LRU gives trace_replay's LRU hit
# counts, and its learned policy runs and hits.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/policy_model_agrees.cmake [=[
execute_process(COMMAND ${PYTHON} ${MODEL} --trace ${TRACE} --capacity 200,1000 --requests 1500
                        --policy lru
                OUTPUT_VARIABLE model RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "policy_model.py exited with ${rc}")
endif()
execute_process(COMMAND ${PYTHON} ${MODEL} --trace ${TRACE} --capacity 1000 --requests 300
                        --policy index-online
                OUTPUT_VARIABLE online RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT online MATCHES "\"policy\": \"index-online\".*\"hit_blocks\": [1-9]")
  message(FATAL_ERROR "policy_model.py --policy index-online: ${rc} ${online}")
endif()
execute_process(COMMAND ${REPLAY} --trace ${TRACE} --capacity 200,1000 --requests 1500
                        --policy lru --fast --json
                OUTPUT_VARIABLE replay RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "trace_replay exited with ${rc}")
endif()
string(REGEX MATCHALL "\"hit_blocks\": [0-9]+" lru_model "${model}")
string(REGEX MATCHALL "\"hit_blocks\": [0-9]+" lru_replay "${replay}")
list(LENGTH lru_replay n)
if(NOT n EQUAL 2)
  message(FATAL_ERROR "expected 2 results: ${replay}")
endif()
if(NOT lru_model STREQUAL lru_replay)
  message(FATAL_ERROR "the model's LRU disagrees with trace_replay: ${lru_model} vs ${lru_replay}")
endif()
message(STATUS "model and trace_replay agree on LRU: ${lru_model}")
]=])
  add_test(NAME bench_policy_model_agrees
           COMMAND ${CMAKE_COMMAND} -DPYTHON=${Python3_EXECUTABLE}
                   -DMODEL=${CMAKE_CURRENT_SOURCE_DIR}/policy_model.py
                   -DREPLAY=$<TARGET_FILE:trace_replay>
                   -DTRACE=${TKV_DATA_DIR}/mooncake_conversation_trace.jsonl
                   -P ${CMAKE_CURRENT_BINARY_DIR}/policy_model_agrees.cmake)
  set_tests_properties(bench_policy_model_agrees PROPERTIES TIMEOUT 300)
endif()
