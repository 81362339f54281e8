# trace_replay: replays a Mooncake-format trace through the storage engine (and the oracle)
# and prints prefix hit rates per policy and capacity (docs/perf.md).
add_executable(trace_replay ${CMAKE_CURRENT_SOURCE_DIR}/trace_replay.c
               ${CMAKE_CURRENT_SOURCE_DIR}/trace_load.c)
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
                     PASS_REGULAR_EXPRESSION "\"policy\": \"hazard\".*\"hit_rate\"")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/trace_bad_lines.jsonl
     "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
     "not json\n"
     "{\"timestamp\": 5, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 3]}\n"
     "{\"timestamp\": 9, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1, -2]}\n"
     "{\"timestamp\": 12, \"input_length\": 1024, \"output_length\": 7, \"hash_ids\": [1, 2]}\n")
add_test(NAME bench_trace_replay_bad_lines
         COMMAND trace_replay --trace ${CMAKE_CURRENT_BINARY_DIR}/trace_bad_lines.jsonl
                 --capacity 1 --policy lru)
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

# trace_synth: synthetic traces of other reuse mixes (recency, scan, one-shot, multi-turn).
add_executable(trace_synth ${CMAKE_CURRENT_SOURCE_DIR}/trace_synth.c)
target_link_libraries(trace_synth PRIVATE m)

# hazard's guard bounds its loss to LRU: on every mix, at two sizes, through the real store,
# hazard's hits in the store's blocks are never more than a fill of the tier (its capacity)
# below LRU's, the bound it keeps by construction, and its trace-block hits at least LRU's
# less 0.2% of the blocks looked up (what its trials lose where the learned
# order loses: docs/design.md, "Cache policy"). Deterministic (fixed seeds, hit counts, no
# timing).
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/hazard_guard_holds.cmake [=[
foreach(mix recency scan oneshot multiturn)
  execute_process(COMMAND ${SYNTH} --mix ${mix} --requests 3000 --seed 7
                  OUTPUT_FILE ${DIR}/synth_${mix}.jsonl RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "trace_synth --mix ${mix} exited with ${rc}")
  endif()
  execute_process(COMMAND ${REPLAY} --trace ${DIR}/synth_${mix}.jsonl --capacity ${CAPS}
                          --policy lru,hazard --json
                  OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "trace_replay (${mix}) exited with ${rc}")
  endif()
  string(REGEX MATCHALL "\"hit_blocks\": [0-9]+" hits "${out}")
  string(REGEX MATCH "\"blocks\": [0-9]+" blocks "${out}")
  string(REGEX REPLACE ".* " "" blocks "${blocks}")
  list(LENGTH hits n)
  math(EXPR last "${n} - 1")
  string(REGEX MATCHALL "\"store_hit_blocks\": [0-9]+" shits "${out}")
  string(REGEX MATCHALL "\"store_capacity\": [0-9]+" scaps "${out}")
  foreach(i RANGE 0 ${last} 2)
    math(EXPR j "${i} + 1")
    list(GET hits ${i} lru)
    list(GET hits ${j} hazard)
    string(REGEX REPLACE ".* " "" lru "${lru}")
    string(REGEX REPLACE ".* " "" hazard "${hazard}")
    list(GET shits ${i} slru)
    list(GET shits ${j} shazard)
    list(GET scaps ${j} cap)
    foreach(v slru shazard cap)
      string(REGEX REPLACE ".* " "" ${v} "${${v}}")
    endforeach()
    math(EXPR bound "${slru} - ${cap}")
    if(shazard LESS bound)
      message(FATAL_ERROR "${mix}: hazard ${shazard} store hits, more than a fill (${cap}) below lru ${slru}: ${out}")
    endif()
    math(EXPR floor "${lru} - ${blocks} / 500")
    if(hazard LESS floor)
      message(FATAL_ERROR "${mix}: hazard ${hazard} hits, more than 0.2% of ${blocks} below lru ${lru}: ${out}")
    endif()
    message(STATUS "${mix}: lru ${lru}, hazard ${hazard} (store blocks: ${slru}, ${shazard})")
  endforeach()
endforeach()
]=])
add_test(NAME bench_hazard_guard_holds
         COMMAND ${CMAKE_COMMAND} -DSYNTH=$<TARGET_FILE:trace_synth>
                 -DREPLAY=$<TARGET_FILE:trace_replay> -DDIR=${CMAKE_CURRENT_BINARY_DIR}
                 -DCAPS=200,1000 -P ${CMAKE_CURRENT_BINARY_DIR}/hazard_guard_holds.cmake)
set_tests_properties(bench_hazard_guard_holds PROPERTIES TIMEOUT 300)
