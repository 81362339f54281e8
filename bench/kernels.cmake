# Kernel benchmarks (GPU only; each exits 77 without a GPU). Included by bench/CMakeLists.txt in
# the full build and by kernels/CMakeLists.txt in the standalone GPU build (scripts/gpu-run),
# so paths are relative to this file and nothing but tkv_kernels is linked.
if(TKV_HAVE_CUDA)
  add_executable(prologue_bench ${CMAKE_CURRENT_LIST_DIR}/prologue_bench.cu)
  target_link_libraries(prologue_bench PRIVATE tkv_kernels)
  target_compile_options(prologue_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>)
endif()
