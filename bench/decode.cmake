# decode_bench: dynamic-split vs static split-KV decode attention on the GPU (kernels/decode*.cu).
# Built in the full build and in the standalone kernels build (kernels/CMakeLists.txt includes
# this file); needs only tkv_kernels and the CUDA runtime. Run by scripts/gpu-run.
#
# The peer: where HPC-Ops' source tree is present (TKV_HPCOPS_DIR, by default .gpu/peers/hpc-ops,
# which is ignored by git and never committed), its dynamic FP8 decode attention is built into
# decode_bench, which then times it beside ours on the same inputs (bench/decode_hpcops.h).
if(TKV_HAVE_CUDA)
  get_filename_component(_tkv_root ${CMAKE_CURRENT_LIST_DIR}/.. ABSOLUTE)
  set(TKV_HPCOPS_DIR "${_tkv_root}/.gpu/peers/hpc-ops" CACHE PATH "HPC-Ops source tree (peer)")
  add_executable(decode_bench ${CMAKE_CURRENT_LIST_DIR}/decode_bench.cu)
  target_link_libraries(decode_bench PRIVATE tkv_kernels tkv_decode_static)
  target_compile_options(decode_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>)
  set(_hpc ${TKV_HPCOPS_DIR}/src/attention/decode)
  if(EXISTS ${_hpc}/sm90/dynamic/smallm_fp8_qpertoken_perhead_kvpertensor_dim128_dynamic.cu)
    message(STATUS "decode_bench: HPC-Ops from ${TKV_HPCOPS_DIR} as the peer")
    set_source_files_properties(${TKV_HPCOPS_DIR}/src/utils/utils.cc PROPERTIES LANGUAGE CUDA)
    add_library(hpcops_decode STATIC
      ${CMAKE_CURRENT_LIST_DIR}/decode_hpcops.cu
      ${_hpc}/assign_task.cu
      ${_hpc}/sm90/dynamic/smallm_fp8_qpertoken_perhead_kvpertensor_dim128_dynamic.cu
      ${TKV_HPCOPS_DIR}/src/utils/utils.cc)
    target_include_directories(hpcops_decode PRIVATE ${TKV_HPCOPS_DIR}
                               ${TKV_HPCOPS_DIR}/3rd/cutlass/include)
    target_compile_definitions(hpcops_decode PRIVATE CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED NDEBUG)
    target_compile_options(hpcops_decode PRIVATE -w -Xcompiler=-w)
    target_link_libraries(hpcops_decode PUBLIC CUDA::cudart CUDA::cuda_driver)
    target_link_libraries(decode_bench PRIVATE hpcops_decode)
    target_compile_definitions(decode_bench PRIVATE TKV_HAVE_HPCOPS=1)
  endif()
endif()
