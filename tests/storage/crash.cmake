# The crash test's child: a separate program (fork + exec) so that every run starts with
# fresh RocksDB threads, like a restarted daemon.
add_executable(storage_crash_child ${CMAKE_CURRENT_SOURCE_DIR}/crash_child.c)
target_link_libraries(storage_crash_child PRIVATE tkv_storage)
add_dependencies(storage_test_crash storage_crash_child)
target_compile_definitions(storage_test_crash PRIVATE
                           TKV_CRASH_CHILD="$<TARGET_FILE:storage_crash_child>")
set_tests_properties(storage_test_crash PROPERTIES TIMEOUT 300)
