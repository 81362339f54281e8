/* blockcopy.cu - scattered block moves between HBM and pinned host memory (tier moves).
 *
 * Two engines, because the best one depends on the block size:
 *  - large blocks (a 4 MiB block is one layer-set of a 64-token page): the copy engines via
 *    cudaMemcpyBatchAsync - one call for the whole batch, PCIe-rate, no SM time;
 *  - small blocks: one kernel in which each CTA moves whole blocks with 16-byte loads through
 *    the UVA mapping of pinned memory, so a thousand 64 KiB blocks cost one launch instead of
 *    a thousand copy set-ups.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "tkvk_cuda.cuh"

namespace {

constexpr size_t kDmaMinBlockBytes = 256 * 1024;
constexpr int kCopyThreads = 512;
constexpr size_t kRegisterChunkBytes = size_t(1) << 30;

/* One CTA per block (grid-stride over blocks). Each thread keeps 4 independent 16-byte loads
 * in flight before storing: PCIe reads have microsecond latency, so a single outstanding load
 * per thread would leave the link idle. */
__global__ void __launch_bounds__(kCopyThreads)
blockcopy_kernel(char *__restrict__ dst, const char *__restrict__ src,
                 const uint64_t *__restrict__ dst_off, const uint64_t *__restrict__ src_off,
                 size_t num_blocks, size_t block_bytes)
{
    const size_t num_vec = block_bytes / 16;
    for (size_t iblock = blockIdx.x; iblock < num_blocks; iblock += gridDim.x) {
        const uint4 *s = reinterpret_cast<const uint4 *>(src + src_off[iblock]);
        uint4 *d = reinterpret_cast<uint4 *>(dst + dst_off[iblock]);
        size_t i = threadIdx.x;
        for (; i + 3 * kCopyThreads < num_vec; i += 4 * kCopyThreads) {
            uint4 a = s[i], b = s[i + kCopyThreads], c = s[i + 2 * kCopyThreads],
                  e = s[i + 3 * kCopyThreads];
            d[i] = a;
            d[i + kCopyThreads] = b;
            d[i + 2 * kCopyThreads] = c;
            d[i + 3 * kCopyThreads] = e;
        }
        for (; i < num_vec; i += kCopyThreads)
            d[i] = s[i];
        /* tail bytes when block_bytes is not a multiple of 16 */
        for (size_t j = num_vec * 16 + threadIdx.x; j < block_bytes; j += kCopyThreads)
            dst[dst_off[iblock] + j] = src[src_off[iblock] + j];
    }
}

} // namespace

extern "C" int tkvk_blockcopy_cuda(void *dst_base, const void *src_base,
                                   const uint64_t *dst_offsets, const uint64_t *src_offsets,
                                   size_t num_blocks, size_t block_bytes, int method,
                                   void *stream)
{
    if (num_blocks == 0 || block_bytes == 0)
        return TKVK_OK;
    if (!dst_base || !src_base || !dst_offsets || !src_offsets)
        return tkvk__fail(TKVK_EINVAL, "blockcopy: NULL base or offsets with %zu blocks",
                          num_blocks);
    if (method == TKVK_COPY_AUTO)
        method = block_bytes >= kDmaMinBlockBytes ? TKVK_COPY_DMA : TKVK_COPY_KERNEL;
    cudaStream_t st = static_cast<cudaStream_t>(stream);

    if (method == TKVK_COPY_DMA) {
        if (st == nullptr)
            return tkvk__fail(TKVK_EINVAL, "blockcopy: DMA batches need a non-default stream");
        /* The pointer arrays are read during the call only (host arrays). */
        void **dsts = static_cast<void **>(malloc(num_blocks * sizeof(void *)));
        const void **srcs = static_cast<const void **>(malloc(num_blocks * sizeof(void *)));
        size_t *sizes = static_cast<size_t *>(malloc(num_blocks * sizeof(size_t)));
        if (!dsts || !srcs || !sizes) {
            free(dsts);
            free(srcs);
            free(sizes);
            return tkvk__fail(TKVK_EINVAL, "blockcopy: out of host memory for %zu blocks",
                              num_blocks);
        }
        for (size_t i = 0; i < num_blocks; i++) {
            dsts[i] = static_cast<char *>(dst_base) + dst_offsets[i];
            srcs[i] = static_cast<const char *>(src_base) + src_offsets[i];
            sizes[i] = block_bytes;
        }
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attr_idx = 0;
        cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, num_blocks, &attr, &attr_idx,
                                               1, st);
        free(dsts);
        free(srcs);
        free(sizes);
        TKVK_CUDA_TRY(err);
        return TKVK_OK;
    }
    if (method != TKVK_COPY_KERNEL)
        return tkvk__fail(TKVK_EINVAL, "blockcopy: unknown method %d", method);

    int dev = 0, num_sms = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
    /* Two resident CTAs per SM keep enough loads in flight to cover PCIe latency. */
    size_t grid = num_blocks < size_t(2 * num_sms) ? num_blocks : size_t(2 * num_sms);
    const bool aligned = ((reinterpret_cast<uintptr_t>(dst_base) |
                           reinterpret_cast<uintptr_t>(src_base)) & 15) == 0;
    if (!aligned)
        return tkvk__fail(TKVK_EINVAL, "blockcopy: kernel path needs 16-byte aligned bases");
    blockcopy_kernel<<<static_cast<unsigned>(grid), kCopyThreads, 0, st>>>(
        static_cast<char *>(dst_base), static_cast<const char *>(src_base), dst_offsets,
        src_offsets, num_blocks, block_bytes);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

/* Chunk size: about kRegisterChunkBytes, a whole number of units. */
static size_t register_chunk(size_t unit_bytes)
{
    if (unit_bytes == 0 || unit_bytes >= kRegisterChunkBytes)
        return unit_bytes ? unit_bytes : kRegisterChunkBytes;
    return kRegisterChunkBytes / unit_bytes * unit_bytes;
}

extern "C" int tkvk_host_register(void *p, size_t bytes, size_t unit_bytes)
{
    if (!p || bytes == 0)
        return tkvk__fail(TKVK_EINVAL, "host_register: empty range");
    const size_t chunk = register_chunk(unit_bytes);
    size_t done = 0;
    while (done < bytes) {
        size_t n = bytes - done < chunk ? bytes - done : chunk;
        cudaError_t err = cudaHostRegister(static_cast<char *>(p) + done, n,
                                           cudaHostRegisterMapped | cudaHostRegisterPortable);
        if (err != cudaSuccess) {
            for (size_t undo = 0; undo < done; undo += chunk)
                cudaHostUnregister(static_cast<char *>(p) + undo);
            return tkvk__fail(TKVK_ECUDA, "cudaHostRegister(%zu bytes at +%zu): %s", n, done,
                              cudaGetErrorString(err));
        }
        done += n;
    }
    return TKVK_OK;
}

extern "C" int tkvk_host_unregister(void *p, size_t bytes, size_t unit_bytes)
{
    if (!p || bytes == 0)
        return tkvk__fail(TKVK_EINVAL, "host_unregister: empty range");
    const size_t chunk = register_chunk(unit_bytes);
    int rc = TKVK_OK;
    for (size_t done = 0; done < bytes; done += chunk) {
        cudaError_t err = cudaHostUnregister(static_cast<char *>(p) + done);
        if (err != cudaSuccess && rc == TKVK_OK)
            rc = tkvk__fail(TKVK_ECUDA, "cudaHostUnregister(+%zu): %s", done,
                            cudaGetErrorString(err));
    }
    return rc;
}
