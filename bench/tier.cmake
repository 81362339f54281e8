# bench/tier_bench: scattered block moves between L2 (pinned host) and L1 (HBM), and the time
# to restore a 32K-token prefix from L2 and from L3. Needs CUDA and the storage library.
if(TKV_HAVE_CUDA AND TARGET tkv_storage)
  add_executable(tier_bench ${CMAKE_CURRENT_SOURCE_DIR}/tier_bench.c)
  target_link_libraries(tier_bench PRIVATE tkv_kernels tkv_storage CUDA::cudart Threads::Threads m)
endif()
