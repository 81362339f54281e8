/* gpu_test_fp8 - the device FP8/bf16 helpers of kernels/fp8.cuh against the CPU functions.
 *
 * Exhaustive: all 2^32 float bit patterns through the exact device encoder, the cvt-based
 * fast encoder (compared on the device) and the CPU encoder (compared on the host, 16
 * threads); all 256 codes through both device decoders; bf16 on a dense stride.
 * Plain program: PASS/FAIL lines, exit 0/1, 77 without a GPU. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "fp8.cuh"
#include "tkv_kernels.h"

#define CHECK(call)                                                                           \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            printf("FAIL %s: %s (line %d)\n", #call, cudaGetErrorString(e_), __LINE__);      \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static const uint64_t kChunk = 1ull << 30;

/* Four patterns per thread: through the x4 fast path and the x2 one (two calls). */
__global__ void encode_chunk(uint32_t base, uint8_t *exact, unsigned long long *fast_mismatch,
                             uint32_t *first_bad)
{
    uint64_t i = 4 * ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= kChunk)
        return;
    float x[4];
    uint8_t e[4];
    for (int k = 0; k < 4; k++) {
        x[k] = __uint_as_float(base + (uint32_t)i + k);
        e[k] = tkvk_fp8_from_float_exact(x[k]);
        exact[i + k] = e[k];
    }
    uint32_t f4 = tkvk_fp8x4_from_float4(x[0], x[1], x[2], x[3]);
    uint32_t f2 = (uint32_t)tkvk_fp8x2_from_float2(x[0], x[1]) |
                  ((uint32_t)tkvk_fp8x2_from_float2(x[2], x[3]) << 16);
    for (int k = 0; k < 4; k++) {
        if (((f4 >> (8 * k)) & 0xff) != e[k] || ((f2 >> (8 * k)) & 0xff) != e[k]) {
            atomicAdd(fast_mismatch, 1ull);
            atomicMin(first_bad, base + (uint32_t)i + k);
        }
    }
}

__global__ void decode_all(float *portable, float *fast)
{
    int c = threadIdx.x;
    portable[c] = tkvk_fp8_to_float_dev((uint8_t)c);
    if ((c & 1) == 0) {
        float2 f = tkvk_fp8x2_to_float2((uint16_t)(c | ((c + 1) << 8)));
        fast[c] = f.x;
        fast[c + 1] = f.y;
    }
}

__global__ void bf16_stride(uint32_t stride, uint64_t n, uint16_t *out, uint32_t *out2)
{
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float x = __uint_as_float((uint32_t)(i * stride));
    out[i] = tkvk_bf16_from_float_dev(x);
    if ((i & 1) == 0 && i + 1 < n)
        out2[i / 2] = tkvk_bf16x2_from_float2(x, __uint_as_float((uint32_t)((i + 1) * stride)));
}

struct cmp_job {
    const uint8_t *codes;
    uint32_t base;
    uint64_t begin, end;
    uint64_t bad;
    uint32_t first_bad;
};

static void *cmp_run(void *arg)
{
    cmp_job *j = (cmp_job *)arg;
    for (uint64_t i = j->begin; i < j->end; i++) {
        uint32_t u = j->base + (uint32_t)i;
        float x;
        memcpy(&x, &u, 4);
        if (tkvk_fp8_from_float(x) != j->codes[i]) {
            if (!j->bad)
                j->first_bad = u;
            j->bad++;
        }
    }
    return NULL;
}

static int same_float(float a, float b)
{
    if (a != a || b != b)
        return a != a && b != b;
    return memcmp(&a, &b, 4) == 0;
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("SKIP gpu_test_fp8: no CUDA device\n");
        return 77;
    }
    int failures = 0;

    /* ---- encoder: all 2^32 patterns ---- */
    uint8_t *d_codes, *h_codes;
    unsigned long long *d_fast_bad;
    uint32_t *d_first;
    CHECK(cudaMalloc(&d_codes, kChunk));
    CHECK(cudaMallocHost(&h_codes, kChunk));
    CHECK(cudaMalloc(&d_fast_bad, sizeof *d_fast_bad));
    CHECK(cudaMalloc(&d_first, sizeof *d_first));
    CHECK(cudaMemset(d_fast_bad, 0, sizeof *d_fast_bad));
    CHECK(cudaMemset(d_first, 0xff, sizeof *d_first));
    uint64_t cpu_bad = 0;
    uint32_t cpu_first = 0;
    for (uint64_t c = 0; c < 4; c++) {
        uint32_t base = (uint32_t)(c * kChunk);
        encode_chunk<<<(unsigned)(kChunk / 4 / 256), 256>>>(base, d_codes, d_fast_bad, d_first);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(h_codes, d_codes, kChunk, cudaMemcpyDeviceToHost));
        enum { kThreads = 16 };
        pthread_t th[kThreads];
        cmp_job jobs[kThreads];
        for (int t = 0; t < kThreads; t++) {
            jobs[t] = (cmp_job){h_codes, base, kChunk / kThreads * t, kChunk / kThreads * (t + 1), 0, 0};
            pthread_create(&th[t], NULL, cmp_run, &jobs[t]);
        }
        for (int t = 0; t < kThreads; t++) {
            pthread_join(th[t], NULL);
            if (jobs[t].bad && !cpu_bad)
                cpu_first = jobs[t].first_bad;
            cpu_bad += jobs[t].bad;
        }
    }
    unsigned long long fast_bad;
    uint32_t fast_first;
    CHECK(cudaMemcpy(&fast_bad, d_fast_bad, sizeof fast_bad, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&fast_first, d_first, sizeof fast_first, cudaMemcpyDeviceToHost));
    if (cpu_bad) {
        printf("FAIL fp8 encode: device exact vs CPU differ on %llu of 2^32 floats (first 0x%08x)\n",
               (unsigned long long)cpu_bad, cpu_first);
        failures++;
    } else {
        printf("PASS fp8 encode: device exact == CPU on all 2^32 floats\n");
    }
    if (fast_bad) {
        printf("FAIL fp8 encode: cvt fast path vs exact differ on %llu of 2^32 floats (first 0x%08x)\n",
               fast_bad, fast_first);
        failures++;
    } else {
        printf("PASS fp8 encode: cvt fast paths (x2, x4) == exact on all 2^32 floats\n");
    }
    CHECK(cudaFree(d_codes));
    CHECK(cudaFreeHost(h_codes));
    CHECK(cudaFree(d_fast_bad));
    CHECK(cudaFree(d_first));

    /* ---- decoders: all 256 codes ---- */
    float *d_dec, h_dec[512];
    CHECK(cudaMalloc(&d_dec, 512 * sizeof(float)));
    decode_all<<<1, 256>>>(d_dec, d_dec + 256);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h_dec, d_dec, sizeof h_dec, cudaMemcpyDeviceToHost));
    CHECK(cudaFree(d_dec));
    int dec_bad = 0;
    for (int c = 0; c < 256; c++) {
        float want = tkvk_fp8_to_float((uint8_t)c);
        if (!same_float(h_dec[c], want) || !same_float(h_dec[256 + c], want)) {
            if (dec_bad++ < 4)
                printf("  code 0x%02x: cpu %g portable %g fast %g\n", c, want, h_dec[c], h_dec[256 + c]);
        }
    }
    printf("%s fp8 decode: both device decoders == CPU on all 256 codes (%d differ)\n",
           dec_bad ? "FAIL" : "PASS", dec_bad);
    failures += dec_bad != 0;

    /* ---- bf16: every 61st float pattern (70 million) ---- */
    const uint32_t stride = 61;
    const uint64_t n = (1ull << 32) / stride;
    uint16_t *d_b, *h_b;
    uint32_t *d_b2, *h_b2;
    CHECK(cudaMalloc(&d_b, n * 2));
    CHECK(cudaMalloc(&d_b2, n * 2));
    h_b = (uint16_t *)malloc(n * 2);
    h_b2 = (uint32_t *)malloc(n * 2);
    bf16_stride<<<(unsigned)((n + 255) / 256), 256>>>(stride, n, d_b, d_b2);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h_b, d_b, n * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(h_b2, d_b2, n / 2 * 4, cudaMemcpyDeviceToHost));
    uint64_t bf_bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)(i * stride);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            continue; /* NaN: both stay NaN, payloads may differ (documented) */
        float x;
        memcpy(&x, &u, 4);
        uint16_t want = tkvk_bf16_from_float(x);
        uint16_t pair = (i + 1 < n || (i & 1)) ? (uint16_t)(h_b2[i / 2] >> ((i & 1) * 16)) : want;
        if (h_b[i] != want || pair != want)
            bf_bad++;
    }
    printf("%s bf16 encode: device == CPU on %llu floats (%llu differ)\n", bf_bad ? "FAIL" : "PASS",
           (unsigned long long)n, (unsigned long long)bf_bad);
    failures += bf_bad != 0;
    free(h_b);
    free(h_b2);
    CHECK(cudaFree(d_b));
    CHECK(cudaFree(d_b2));

    printf("%s gpu_test_fp8\n", failures ? "FAIL" : "PASS");
    return failures ? 1 : 0;
}
