/* blockcopy.c - CPU block copy for tier moves (the reference of blockcopy.cu), and the
 * host-registration entry points' fallbacks when the library is built without CUDA. */
#include <string.h>

#include "tkvk_internal.h"

int tkvk_blockcopy_cpu(void *dst_base, const void *src_base, const uint64_t *dst_offsets,
                       const uint64_t *src_offsets, size_t num_blocks, size_t block_bytes)
{
    if (num_blocks == 0)
        return TKVK_OK;
    if (!dst_base || !src_base || !dst_offsets || !src_offsets)
        return tkvk__fail(TKVK_EINVAL, "blockcopy: NULL base or offsets with %zu blocks",
                          num_blocks);
    for (size_t i = 0; i < num_blocks; i++)
        memcpy((char *)dst_base + dst_offsets[i], (const char *)src_base + src_offsets[i],
               block_bytes);
    return TKVK_OK;
}

#ifndef TKVK_HAVE_CUDA
int tkvk_blockcopy_cuda(void *dst_base, const void *src_base, const uint64_t *dst_offsets,
                        const uint64_t *src_offsets, size_t num_blocks, size_t block_bytes,
                        int method, void *stream)
{
    return tkvk__fail(TKVK_ENODEV, "blockcopy: built without CUDA");
}

int tkvk_host_register(void *p, size_t bytes, size_t unit_bytes)
{
    return tkvk__fail(TKVK_ENODEV, "host_register: built without CUDA");
}

int tkvk_host_unregister(void *p, size_t bytes, size_t unit_bytes)
{
    return tkvk__fail(TKVK_ENODEV, "host_unregister: built without CUDA");
}
#endif
