# bench/store_bench: the tier manager end to end (put, write-through, get, prefetch, lookup).
if(TARGET tkv_storage)
  add_executable(store_bench ${CMAKE_CURRENT_SOURCE_DIR}/store_bench.c)
  target_link_libraries(store_bench PRIVATE tkv_storage Threads::Threads m)
endif()
