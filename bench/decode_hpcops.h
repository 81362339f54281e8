/* decode_hpcops.h - HPC-Ops' dynamic FP8 decode attention (Q per token and head, K/V per
 * tensor, head dim 128, pages of 64), run by decode_bench beside ours on the same inputs.
 *
 * Built only where its source tree is present (bench/decode.cmake, TKV_HPCOPS_DIR; on an H200
 * machine scripts/gpu-run finds it in .gpu/peers/hpc-ops). Nothing of it is part of tierkv:
 * it is the peer the decode figures are measured against. It reads our pool in place (its K
 * and V tensors are strided views of our pages) and writes BF16 O in our layout. */
#ifndef TKV_DECODE_HPCOPS_H
#define TKV_DECODE_HPCOPS_H

#include <cuda_runtime.h>
#include <stdint.h>

typedef struct hpcops_decode_args {
    int num_requests, q_len, num_q_heads, num_kv_heads;
    const int32_t *kv_lens;    /* device, q_len included */
    int32_t max_kv_len;
    const int32_t *block_table; /* device, [request][table_stride] */
    int table_stride, num_blocks;
    const void *q;              /* device, e4m3 [request][q_len][Hq][128] */
    const float *q_scales;      /* device, [request][q_len][Hq] */
    const void *k, *v;          /* device, first K and V byte of block 0 */
    int64_t block_stride, token_stride, head_stride; /* bytes */
    float k_scale, v_scale;
    void *out;                  /* device, bf16 [request][q_len][Hq][128] */
} hpcops_decode_args;

typedef struct hpcops_decode hpcops_decode;

/* 1 when HPC-Ops runs this shape (group 4 or 8, query length 1..4), else 0. */
int hpcops_decode_supported(int group, int q_len);
/* Allocates its workspaces and computes its task map (on s, synchronised); NULL on failure or
 * where its partials' 32-bit offsets would wrap (large batches of many heads). */
hpcops_decode *hpcops_decode_create(const hpcops_decode_args *a, cudaStream_t s);
/* Enqueues attention + combine on s (capturable). 0 on success. */
int hpcops_decode_run(hpcops_decode *h, cudaStream_t s);
void hpcops_decode_destroy(hpcops_decode *h);

#endif
