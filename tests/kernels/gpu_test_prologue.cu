/* gpu_test_prologue - tkvk_prologue_cuda() against tkvk_prologue_cpu() over the whole
 * supported configuration space, on fresh random inputs (the seed is printed; pass one as
 * argv[1] to replay a run).
 *
 * Every config: head dim 64/128/256 x tokens per page 16/32/64/128 x GQA groups 1/3/8/16 x
 * NeoX/GPT-J x norm off/before/after x Hadamard off/on x KV {FP8 per-tensor, FP8
 * per-token-head, BF16} x Q {FP8, BF16}. Both pools are poisoned the same way first (0x7f: the FP8 NaN code, which finite inputs never produce); the
 * whole pool (all layers, all blocks, padding included), Q and the Q scales are compared.
 * The two implementations do the same float operations, so the expectation is bit equality;
 * what the acceptance allows is: FP8 codes within one step, scales within fp32 rounding,
 * BF16 within one ulp. Mismatch counts are printed either way.
 * Also: the multi-item (prefill-sized) kernel variants, and refusals.
 * Plain program: PASS/FAIL lines, exit 0/1, 77 without a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "tkv_kernels.h"
#include "tkvk_internal.h"

#define CHECK(call)                                                                           \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            printf("FAIL %s: %s (line %d)\n", #call, cudaGetErrorString(e_), __LINE__);      \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static uint64_t rng;
static uint32_t rnd_u32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float rnd_f(void) { return (float)rnd_u32() / 4294967296.0f * 2.0f - 1.0f; }
static float rnd_normal(void)
{
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += rnd_f();
    return s * 0.866f;
}

/* ---- buffers, host and device, sized for the largest config -------------------------------- */

enum { kMaxPos = 4096, kMaxTokens = 1200, kLayers = 2 };

typedef struct bufs {
    size_t qkv_bytes, q_bytes, pool_bytes;
    uint16_t *qkv;
    int32_t *pos;
    float *cos_t, *sin_t, *qw, *kw, *vhs, *qscale, *qscale_gpu;
    uint8_t *qout, *qout_gpu, *pool, *pool_gpu;
    int64_t *slots, *last;
    /* device */
    uint16_t *d_qkv;
    int32_t *d_pos;
    float *d_cos, *d_sin, *d_qw, *d_kw, *d_vhs, *d_qscale;
    uint8_t *d_qout, *d_pool;
    int64_t *d_slots, *d_last;
} bufs;

static void bufs_init(bufs *b)
{
    memset(b, 0, sizeof *b);
    b->qkv_bytes = (size_t)kMaxTokens * 48 * 256 * 2;
    b->q_bytes = (size_t)kMaxTokens * 32 * 256 * 2;
    b->pool_bytes = (size_t)64 << 20;
    b->qkv = (uint16_t *)malloc(b->qkv_bytes);
    b->pos = (int32_t *)malloc(kMaxTokens * 4);
    b->cos_t = (float *)malloc((size_t)kMaxPos * 128 * 4);
    b->sin_t = (float *)malloc((size_t)kMaxPos * 128 * 4);
    b->qw = (float *)malloc(256 * 4);
    b->kw = (float *)malloc(256 * 4);
    b->vhs = (float *)malloc(64 * 4);
    b->qscale = (float *)malloc((size_t)kMaxTokens * 32 * 4);
    b->qscale_gpu = (float *)malloc((size_t)kMaxTokens * 32 * 4);
    b->qout = (uint8_t *)malloc(b->q_bytes);
    b->qout_gpu = (uint8_t *)malloc(b->q_bytes);
    b->pool = (uint8_t *)malloc(b->pool_bytes);
    b->pool_gpu = (uint8_t *)malloc(b->pool_bytes);
    b->slots = (int64_t *)malloc(kMaxTokens * 8);
    b->last = (int64_t *)malloc(64 * 8);
    CHECK(cudaMalloc(&b->d_qkv, b->qkv_bytes));
    CHECK(cudaMalloc(&b->d_pos, kMaxTokens * 4));
    CHECK(cudaMalloc(&b->d_cos, (size_t)kMaxPos * 128 * 4));
    CHECK(cudaMalloc(&b->d_sin, (size_t)kMaxPos * 128 * 4));
    CHECK(cudaMalloc(&b->d_qw, 256 * 4));
    CHECK(cudaMalloc(&b->d_kw, 256 * 4));
    CHECK(cudaMalloc(&b->d_vhs, 64 * 4));
    CHECK(cudaMalloc(&b->d_qscale, (size_t)kMaxTokens * 32 * 4));
    CHECK(cudaMalloc(&b->d_qout, b->q_bytes));
    CHECK(cudaMalloc(&b->d_pool, b->pool_bytes));
    CHECK(cudaMalloc(&b->d_slots, kMaxTokens * 8));
    CHECK(cudaMalloc(&b->d_last, 64 * 8));
}

static void bufs_free(bufs *b)
{
    free(b->qkv); free(b->pos); free(b->cos_t); free(b->sin_t); free(b->qw); free(b->kw);
    free(b->vhs); free(b->qscale); free(b->qscale_gpu); free(b->qout); free(b->qout_gpu);
    free(b->pool); free(b->pool_gpu); free(b->slots); free(b->last);
    cudaFree(b->d_qkv); cudaFree(b->d_pos); cudaFree(b->d_cos); cudaFree(b->d_sin);
    cudaFree(b->d_qw); cudaFree(b->d_kw); cudaFree(b->d_vhs); cudaFree(b->d_qscale);
    cudaFree(b->d_qout); cudaFree(b->d_pool); cudaFree(b->d_slots); cudaFree(b->d_last);
}

/* ---- one configuration --------------------------------------------------------------------- */

typedef struct cfg {
    int d, P, hq, hkv, rope, norm, had, kvmode, qdt;
    int tokens_hint; /* 0: a few requests of random lengths */
} cfg;

typedef struct tally {
    long configs, failed;
    long q_exact_diff, kv_exact_diff, scale_diff; /* bit differences (allowed within bounds) */
} tally;

/* Codes a and b within one FP8 step: same sign and magnitudes adjacent (or equal). */
static int fp8_within_one(uint8_t a, uint8_t b)
{
    if (a == b)
        return 1;
    if ((a ^ b) & 0x80)
        return (a & 0x7f) + (b & 0x7f) <= 1; /* +0/-0 next to the smallest subnormal */
    int d = (int)(a & 0x7f) - (int)(b & 0x7f);
    return d == 1 || d == -1;
}

static int float_close(float a, float b)
{
    if (a == b)
        return 1;
    return fabsf(a - b) <= 2.5e-7f * fmaxf(fabsf(a), fabsf(b));
}

static int run_config(bufs *b, const cfg *c, int items_per_warp, tally *t, int verbose)
{
    tkvk_layout lay;
    int kv_dtype = c->kvmode == 2 ? TKVK_DTYPE_BF16 : TKVK_DTYPE_FP8_E4M3;
    int smode = c->kvmode == 1 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR;
    if (tkvk_layout_init(&lay, kLayers, c->hkv, c->d, c->P, kv_dtype, smode) != TKVK_OK) {
        printf("FAIL layout_init: %s\n", tkvk_last_error());
        return 1;
    }
    const int d = c->d, P = c->P, heads = c->hq + 2 * c->hkv;

    /* Requests: new prompts from offset 0, or continuations starting mid-page. */
    int nreq = c->tokens_hint ? 3 : 1 + (int)(rnd_u32() % 4);
    int tokens = 0, nblocks_used = 0;
    int64_t num_blocks = (int64_t)(b->pool_bytes / lay.block_stride);
    if (num_blocks > 64)
        num_blocks = 64; /* enough for every request here; keeps the whole-pool compare cheap */
    int *perm = (int *)malloc(num_blocks * sizeof(int));
    for (int i = 0; i < num_blocks; i++)
        perm[i] = i;
    for (int i = (int)num_blocks - 1; i > 0; i--) {
        int j = (int)(rnd_u32() % (uint32_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    for (int r = 0; r < nreq; r++) {
        int len = c->tokens_hint ? c->tokens_hint / nreq : 1 + (int)(rnd_u32() % 40);
        int start = (rnd_u32() & 1) ? (int)(rnd_u32() % P) : 0;
        int pages = (start + len + P - 1) / P;
        if (nblocks_used + pages > num_blocks - 2) {
            len = 1;
            start = 0;
            pages = 1;
        }
        int first_block = nblocks_used;
        nblocks_used += pages;
        for (int i = 0; i < len; i++) {
            int o = start + i;
            int64_t slot = (int64_t)perm[first_block + o / P] * P + o % P;
            b->slots[tokens] = (rnd_u32() % 17 == 0) ? -1 : slot; /* some padding tokens */
            b->pos[tokens] = (int)(rnd_u32() % kMaxPos);
            tokens++;
        }
        b->last[r] = (rnd_u32() % 9 == 0) ? -1
                     : (int64_t)perm[first_block + (start + len - 1) / P] * P + (start + len - 1) % P;
    }
    free(perm);

    /* Inputs: per-head magnitudes vary over 2^-6 .. 2^6 so scales and subnormals are hit. */
    for (int tk = 0; tk < tokens; tk++)
        for (int h = 0; h < heads; h++) {
            float mag = ldexpf(1.0f, (int)(rnd_u32() % 13) - 6);
            for (int i = 0; i < d; i++)
                b->qkv[((size_t)tk * heads + h) * d + i] = tkvk_bf16_from_float(rnd_normal() * mag);
        }
    for (int i = 0; i < d; i++) {
        b->qw[i] = 0.5f + (rnd_f() + 1.0f);
        b->kw[i] = 0.5f + (rnd_f() + 1.0f);
    }
    for (int h = 0; h < c->hkv; h++)
        b->vhs[h] = ldexpf(1.0f + 0.5f * rnd_f(), -(int)(rnd_u32() % 8));
    /* A fresh random angle table per head dim (cos/sin of random angles). */
    static int table_dim = 0;
    if (table_dim != d) {
        for (size_t i = 0; i < (size_t)kMaxPos * (d / 2); i++) {
            double ang = rnd_f() * 3.14159265;
            b->cos_t[i] = (float)cos(ang);
            b->sin_t[i] = (float)sin(ang);
        }
        CHECK(cudaMemcpy(b->d_cos, b->cos_t, (size_t)kMaxPos * (d / 2) * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(b->d_sin, b->sin_t, (size_t)kMaxPos * (d / 2) * 4, cudaMemcpyHostToDevice));
        table_dim = d;
    }

    tkvk_prologue_params p;
    tkvk_prologue_params_init(&p);
    p.num_tokens = tokens;
    p.num_q_heads = c->hq;
    p.max_pos = kMaxPos;
    p.rope_style = c->rope;
    p.norm_mode = c->norm;
    p.norm_eps = 1e-5f;
    p.hadamard = c->had;
    p.q_dtype = c->qdt;
    p.layout = &lay;
    p.layer = (int)(rnd_u32() % kLayers);
    p.num_blocks = num_blocks;
    p.k_scale = ldexpf(1.0f, -(int)(rnd_u32() % 6)); /* some K values saturate */
    p.v_scale = ldexpf(1.0f, -(int)(rnd_u32() % 6));
    p.num_reqs = nreq;

    size_t qkv_bytes = (size_t)tokens * heads * d * 2;
    size_t q_bytes = (size_t)tokens * c->hq * d * (c->qdt == TKVK_DTYPE_BF16 ? 2 : 1);
    size_t pool_bytes = (size_t)num_blocks * lay.block_stride;
    memset(b->pool, 0x7f, pool_bytes);
    memset(b->qout, 0xcd, q_bytes);
    memset(b->qscale, 0xcd, (size_t)tokens * c->hq * 4);

    /* CPU reference. */
    p.qkv = b->qkv; p.positions = b->pos; p.rope_cos = b->cos_t; p.rope_sin = b->sin_t;
    p.q_norm_weight = b->qw; p.k_norm_weight = b->kw; p.q_out = b->qout;
    p.q_scale_out = b->qscale; p.pool = b->pool; p.slot_mapping = b->slots;
    p.v_head_scales = b->vhs; p.req_last_slot = b->last;
    int rc = tkvk_prologue_cpu(&p);
    if (rc != TKVK_OK) {
        printf("FAIL cpu reference: %s\n", tkvk_last_error());
        return 1;
    }

    /* GPU. */
    CHECK(cudaMemcpy(b->d_qkv, b->qkv, qkv_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_pos, b->pos, tokens * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_qw, b->qw, d * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_kw, b->kw, d * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_vhs, b->vhs, c->hkv * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_slots, b->slots, tokens * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b->d_last, b->last, nreq * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(b->d_pool, 0x7f, pool_bytes));
    CHECK(cudaMemset(b->d_qout, 0xcd, q_bytes));
    CHECK(cudaMemset(b->d_qscale, 0xcd, (size_t)tokens * c->hq * 4));
    p.qkv = b->d_qkv; p.positions = b->d_pos; p.rope_cos = b->d_cos; p.rope_sin = b->d_sin;
    p.q_norm_weight = b->d_qw; p.k_norm_weight = b->d_kw; p.q_out = b->d_qout;
    p.q_scale_out = b->d_qscale; p.pool = b->d_pool; p.slot_mapping = b->d_slots;
    p.v_head_scales = b->d_vhs; p.req_last_slot = b->d_last;
    rc = tkvk__prologue_cuda_tuned(&p, NULL, items_per_warp);
    if (rc != TKVK_OK) {
        printf("FAIL launch: %s\n", tkvk_last_error());
        return 1;
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(b->pool_gpu, b->d_pool, pool_bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b->qout_gpu, b->d_qout, q_bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b->qscale_gpu, b->d_qscale, (size_t)tokens * c->hq * 4, cudaMemcpyDeviceToHost));

    /* Compare. */
    long bad = 0, q_diff = 0, kv_diff = 0, s_diff = 0;
    if (c->qdt == TKVK_DTYPE_BF16) {
        const uint16_t *a = (const uint16_t *)b->qout, *g = (const uint16_t *)b->qout_gpu;
        for (size_t i = 0; i < q_bytes / 2; i++)
            if (a[i] != g[i]) {
                q_diff++;
                int dd = (int)a[i] - (int)g[i];
                if (((a[i] ^ g[i]) & 0x8000) || (dd != 1 && dd != -1))
                    bad++;
            }
    } else {
        for (size_t i = 0; i < q_bytes; i++)
            if (b->qout[i] != b->qout_gpu[i]) {
                q_diff++;
                bad += !fp8_within_one(b->qout[i], b->qout_gpu[i]);
            }
        for (size_t i = 0; i < (size_t)tokens * c->hq; i++)
            if (memcmp(&b->qscale[i], &b->qscale_gpu[i], 4)) {
                s_diff++;
                bad += !float_close(b->qscale[i], b->qscale_gpu[i]);
            }
    }
    /* The pool: byte by byte; where bytes differ decide by what they hold. */
    for (int64_t blk = 0; blk < num_blocks; blk++)
        for (int l = 0; l < kLayers; l++) {
            size_t base = (size_t)blk * lay.block_stride + (size_t)l * lay.layer_stride;
            const uint8_t *A = b->pool + base, *G = b->pool_gpu + base;
            if (!memcmp(A, G, lay.layer_stride))
                continue;
            for (size_t i = 0; i < lay.layer_stride; i++) {
                if (A[i] == G[i])
                    continue;
                if (smode == TKVK_SCALE_PER_TOKEN_HEAD && i >= lay.kscale_offset) {
                    size_t k = (i - lay.kscale_offset) / 4 * 4 + lay.kscale_offset;
                    float fa, fg;
                    memcpy(&fa, A + k, 4);
                    memcpy(&fg, G + k, 4);
                    s_diff++;
                    bad += !float_close(fa, fg) || (k + 4 > (size_t)P * c->hkv * 4 + lay.kscale_offset);
                    i = k + 3;
                } else if (kv_dtype == TKVK_DTYPE_BF16 && i < lay.kscale_offset + 2 * lay.v_offset) {
                    size_t k = i & ~(size_t)1;
                    uint16_t ua, ug;
                    memcpy(&ua, A + k, 2);
                    memcpy(&ug, G + k, 2);
                    int dd = (int)ua - (int)ug;
                    kv_diff++;
                    bad += ((ua ^ ug) & 0x8000) || (dd != 1 && dd != -1) || A[i] == 0x7f || G[i] == 0x7f;
                    i = k + 1;
                } else {
                    kv_diff++;
                    /* Poison on one side only means a write outside (or missing inside) the
                     * mapped slots: never allowed. */
                    bad += i >= 2 * lay.v_offset || !fp8_within_one(A[i], G[i]) ||
                           (A[i] == 0x7f) != (G[i] == 0x7f);
                }
            }
        }
    t->configs++;
    t->q_exact_diff += q_diff;
    t->kv_exact_diff += kv_diff;
    t->scale_diff += s_diff;
    if (bad) {
        t->failed++;
        if (verbose || t->failed <= 10)
            printf("FAIL config d=%d P=%d hq=%d hkv=%d rope=%d norm=%d had=%d kv=%d q=%d items=%d "
                   "tokens=%d: %ld out of bounds (q diff %ld, kv diff %ld, scale diff %ld)\n",
                   c->d, c->P, c->hq, c->hkv, c->rope, c->norm, c->had, c->kvmode, c->qdt,
                   items_per_warp, tokens, bad, q_diff, kv_diff, s_diff);
        return 1;
    }
    return 0;
}

/* ---- refusals on the device path ----------------------------------------------------------- */

static int refusals(bufs *b)
{
    int fails = 0;
    tkvk_layout lay;
    tkvk_layout_init(&lay, 1, 2, 128, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR);
    tkvk_prologue_params p;
    tkvk_prologue_params_init(&p);
    p.layout = &lay;
    p.num_tokens = 1;
    p.num_q_heads = 34; /* group 17 */
    p.qkv = b->d_qkv; p.positions = b->d_pos; p.rope_cos = b->d_cos; p.rope_sin = b->d_sin;
    p.q_out = b->d_qout; p.q_scale_out = b->d_qscale; p.pool = b->d_pool; p.num_blocks = 1;
    p.slot_mapping = b->d_slots; p.max_pos = kMaxPos;
    int rc = tkvk_prologue_cuda(&p, NULL);
    fails += rc != TKVK_EUNSUPPORTED;
    printf("%s refusal: group 17 -> %s (%s)\n", rc == TKVK_EUNSUPPORTED ? "PASS" : "FAIL",
           tkvk_strerror(rc), tkvk_last_error());
    p.num_q_heads = 4;
    p.qkv = b->d_qkv + 1; /* misaligned */
    rc = tkvk_prologue_cuda(&p, NULL);
    fails += rc != TKVK_EINVAL;
    printf("%s refusal: misaligned qkv -> %s (%s)\n", rc == TKVK_EINVAL ? "PASS" : "FAIL",
           tkvk_strerror(rc), tkvk_last_error());
    tkvk_layout bad = lay;
    bad.head_dim = 96;
    p.qkv = b->d_qkv;
    p.layout = &bad;
    rc = tkvk_prologue_cuda(&p, NULL);
    fails += rc != TKVK_EUNSUPPORTED;
    printf("%s refusal: head_dim 96 -> %s (%s)\n", rc == TKVK_EUNSUPPORTED ? "PASS" : "FAIL",
           tkvk_strerror(rc), tkvk_last_error());
    return fails;
}

int main(int argc, char **argv)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("SKIP gpu_test_prologue: no CUDA device\n");
        return 77;
    }
    rng = argc > 1 ? strtoull(argv[1], NULL, 0) : ((uint64_t)time(NULL) * 2654435761u) | 1;
    printf("seed %llu\n", (unsigned long long)rng);
    bufs b;
    bufs_init(&b);
    int failures = refusals(&b);

    const int dims[3] = {64, 128, 256}, pages[4] = {16, 32, 64, 128};
    const int hqs[4] = {2, 6, 8, 32}, hkvs[4] = {2, 2, 1, 2}; /* groups 1, 3, 8, 16 */
    tally t = {};
    for (int di = 0; di < 3; di++)
        for (int pi = 0; pi < 4; pi++)
            for (int gi = 0; gi < 4; gi++)
                for (int rope = 0; rope < 2; rope++)
                    for (int norm = 0; norm < 3; norm++)
                        for (int had = 0; had < 2; had++)
                            for (int kv = 0; kv < 3; kv++)
                                for (int q = 0; q < 2; q++) {
                                    cfg c = {dims[di], pages[pi], hqs[gi], hkvs[gi], rope, norm,
                                             had, kv, q, 0};
                                    run_config(&b, &c, 0, &t, 0);
                                }
    printf("%s sweep: %ld configs, %ld failed; bit differences: q %ld, kv %ld, scales %ld\n",
           t.failed ? "FAIL" : "PASS", t.configs, t.failed, t.q_exact_diff, t.kv_exact_diff,
           t.scale_diff);
    failures += t.failed != 0;

    /* Prefill-sized calls: every variant of the kernel (1, 2, 4 items per group, the persistent
     * grid, the walk grid, the ring grid, the prefetching persistent grid, the fixed-mode
     * persistent grid), the default choice
     * included; the grids also on head counts that are not multiples of the groups per warp
     * (8/1, 6/2: warps that would mix head kinds, a partial last tile of the walk at head dim
     * 64), on every page size. */
    tally big = {};
    const int variants[9] = {0, 1, 2, 4, 8, 16, 32, 64, 128};
    for (int di = 0; di < 3; di++)
        for (int v = 0; v < 9; v++)
            for (int kv = 0; kv < 3; kv++) {
                cfg c = {dims[di], 64, 32, 8, (v + kv) & 1, (v + di) % 3, (kv + di + v) & 1, kv,
                         (v + di) & 1, 1140};
                run_config(&b, &c, variants[v], &big, 1);
            }
    const int mixed_hq[2] = {8, 6}, mixed_hkv[2] = {1, 2};
    for (int di = 0; di < 3; di++)
        for (int s = 0; s < 2; s++)
            for (int kv = 0; kv < 3; kv++) {
                cfg c = {dims[di], 16 << (kv + s), mixed_hq[s], mixed_hkv[s], (s + kv) & 1,
                         (s + di + kv) % 3, (kv + di) & 1, kv, (s + di) & 1, 1140};
                run_config(&b, &c, 8, &big, 1);
                run_config(&b, &c, 16, &big, 1);
                run_config(&b, &c, 32, &big, 1);
                run_config(&b, &c, 64, &big, 1);
                run_config(&b, &c, 128, &big, 1);
            }
    /* The fixed mode (norm before RoPE, NeoX, no Hadamard, FP8 Q, per-tensor FP8 K/V: the
     * persistent grid compiled for it, variant 128 and the default) on every head dim, with
     * warps of one head kind (32/8) and mixed (8/1, 30/6). */
    const int fixed_hq[3] = {32, 8, 30}, fixed_hkv[3] = {8, 1, 6};
    for (int di = 0; di < 3; di++)
        for (int s = 0; s < 3; s++) {
            cfg c = {dims[di], 32 << s, fixed_hq[s], fixed_hkv[s], TKVK_ROPE_NEOX,
                     TKVK_NORM_BEFORE_ROPE, 0, 0, TKVK_DTYPE_FP8_E4M3, 1140};
            run_config(&b, &c, 128, &big, 1);
            run_config(&b, &c, 256, &big, 1);
            run_config(&b, &c, 0, &big, 1);
        }
    /* The ring and prefetching grids where the warps mix head kinds over several items per
     * group: 30/6 heads (42 per token) at 1140 tokens are some 48000 items, several times a
     * resident grid's stride (a ring refill needs 2 strides, a prefetch 3: at head dim 256
     * both, at 128 the refills), and groups end their walks at different items. Pages of 32
     * tokens and more, so that the pool's 64 blocks hold all three requests. */
    for (int di = 0; di < 3; di++)
        for (int kv = 0; kv < 3; kv++) {
            cfg c = {dims[di], 32 << kv, 30, 6, kv & 1, (di + kv) % 3, (di + 1) & 1, kv,
                     (di + kv) & 1, 1140};
            run_config(&b, &c, 32, &big, 1);
            run_config(&b, &c, 64, &big, 1);
        }
    printf("%s large calls: %ld configs (1140 tokens), %ld failed; bit differences: "
           "q %ld, kv %ld, scales %ld\n", big.failed ? "FAIL" : "PASS", big.configs, big.failed,
           big.q_exact_diff, big.kv_exact_diff, big.scale_diff);
    failures += big.failed != 0;

    bufs_free(&b);
    printf("%s gpu_test_prologue\n", failures ? "FAIL" : "PASS");
    return failures ? 1 : 0;
}
