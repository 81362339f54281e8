/* tkvk_cuda.cuh - the CUDA side of the kernels' error model, shared by every .cu module.
 *
 * TKVK_CUDA_TRY(call): on failure records "<call>: <CUDA message> (file:line)" as the thread's
 * tkvk_last_error() and returns TKVK_ECUDA from the enclosing launcher. A launcher checks its
 * preconditions, launches, then TKVK_CUDA_TRY(cudaGetLastError()).
 */
#ifndef TKVK_CUDA_CUH
#define TKVK_CUDA_CUH

#include <cuda_runtime.h>

#include "tkvk_internal.h"

#define TKVK_CUDA_TRY(call)                                                                   \
    do {                                                                                      \
        cudaError_t tkvk_err_ = (call);                                                       \
        if (tkvk_err_ != cudaSuccess)                                                         \
            return tkvk__fail(TKVK_ECUDA, "%s: %s (%s:%d)", #call,                            \
                              cudaGetErrorString(tkvk_err_), __FILE__, __LINE__);             \
    } while (0)

#endif
