# The decode tests compare the dynamic split against the static baseline (dev/decode/), which
# is not part of tkv_kernels. Included by tests/kernels/CMakeLists.txt (full build) and by
# kernels/CMakeLists.txt (standalone build).
if(TARGET kernels_test_decode)
  target_link_libraries(kernels_test_decode PRIVATE tkv_decode_static)
endif()
if(TARGET gpu_test_decode)
  target_link_libraries(gpu_test_decode PRIVATE tkv_decode_static)
endif()
