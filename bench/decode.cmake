# decode_bench: dynamic-split vs static split-KV decode attention on the GPU (kernels/decode.cu).
# Built in the full build and in the standalone kernels build (kernels/CMakeLists.txt includes
# this file); needs only tkv_kernels and the CUDA runtime. Run by scripts/gpu-run.
if(TKV_HAVE_CUDA)
  add_executable(decode_bench ${CMAKE_CURRENT_LIST_DIR}/decode_bench.cu)
  target_link_libraries(decode_bench PRIVATE tkv_kernels)
  target_compile_options(decode_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>)
endif()
