# crash_soak: kill -9 / restart cycles of a real tierkvd under put/get load (docs/perf.md has
# the 1,000-cycle figures: `bench/crash_soak.py build/daemon/tierkvd proto --cycles 1000`).
# The smoke run here (not timed) checks the soak itself works and finds nothing wrong.
set(TKV_SOAK_PYTHON /usr/bin/python3)
add_test(NAME bench_crash_soak_smoke
         COMMAND ${TKV_SOAK_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/crash_soak.py $<TARGET_FILE:tierkvd>
                 ${CMAKE_SOURCE_DIR}/proto --cycles 5)
set_tests_properties(bench_crash_soak_smoke PROPERTIES TIMEOUT 180 SKIP_RETURN_CODE 77
                     PASS_REGULAR_EXPRESSION "PASS")
