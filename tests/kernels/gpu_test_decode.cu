/* gpu_test_decode.cu - decode attention on the GPU (kernels/decode.cu) against a float64
 * reference computed here on fresh random inputs (the seed is printed; TKV_SEED=N repeats it).
 *
 * Checked: dynamic (plan + persistent attention + combine) and static split-KV, over head dims
 * 64/128/256, pages of 16..128 tokens, FP8 KV in both scale modes and BF16 KV, BF16 and FP8 Q,
 * GQA groups 1..16, query lengths 1..8 (causal within the new tokens); KV lengths 0, 1, P-1,
 * P, P+1 and 128K mixed in one batch; the device task map equals the CPU planner's; the same
 * inputs give bit-identical outputs run after run; outputs are poisoned before every run and
 * every element must be written, guard words after them must survive; NaN never passes;
 * tokens past a request's end hold NaN codes and must never be read into the result; a CUDA
 * graph of plan + attention + combine replays correctly after the KV lengths change; merge
 * states agrees with the CPU one.
 *
 * Tolerances (relative L2 error of O over all rows; absolute error of the base-2 LSE):
 *   FP8 KV: 6e-3 / 2e-3. The products run on f16 operands (FP8 K/V and Q are exact in f16,
 *           BF16 Q is rescaled per row so f16 holds it exactly), P is rounded to f16
 *           (2^-11) and O to bf16 (2^-9 relative per element): about 2e-3 expected.
 *   BF16 KV: 1.2e-2 / 4e-3. P and the products are bf16 (2^-9 per weight) on top of the
 *           bf16 output rounding.
 * Exit 0 = all pass, 1 = a failure, 77 = no GPU.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vector>

#include "decode_internal.h"
#include "tkv_kernels.h"
#include "decode_static.h"

#define CK(call)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #call,                     \
                    cudaGetErrorString(e_));                                                     \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)
#define TK(call)                                                                                 \
    do {                                                                                         \
        int r_ = (call);                                                                         \
        if (r_ != TKVK_OK) {                                                                     \
            fprintf(stderr, "FAIL %s:%d %s: %s (%s)\n", __FILE__, __LINE__, #call,                \
                    tkvk_strerror(r_), tkvk_last_error());                                       \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

static int g_failures = 0;
static uint64_t g_rng;

static uint64_t rnd_u64(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rnd_unit(void)
{
    return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0);
}
static float rnd_normal(void)
{
    double u1 = rnd_unit() + 1e-12, u2 = rnd_unit();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
static int rnd_int(int n)
{
    return (int)(rnd_u64() % (uint64_t)n);
}

/* ---- one test case ------------------------------------------------------------------------ */

struct Case {
    int head_dim, page_tokens, kv_dtype, scale_mode, q_dtype, hkv, group, q_len;
    std::vector<int32_t> lens;
    int plan_rows = 0; /* rows the plan is made for; 0: group * q_len */
};

struct Inputs {
    tkvk_layout lay;
    int layer, num_blocks, bt_stride;
    std::vector<uint8_t> pool;
    std::vector<int32_t> table;
    std::vector<uint8_t> q; /* bf16 or fp8 bytes */
    std::vector<float> q_scales, v_head_scales;
    float k_scale, v_scale, sm_scale;
};

static void case_name(const Case &c, char *buf, size_t n)
{
    snprintf(buf, n, "D%d P%d %s Q%s hkv%d g%d q%d n%zu", c.head_dim, c.page_tokens,
             c.kv_dtype == TKVK_DTYPE_BF16 ? "bf16kv"
             : c.scale_mode == TKVK_SCALE_PER_TENSOR ? "fp8kv-tensor"
                                                      : "fp8kv-tokhead",
             c.q_dtype == TKVK_DTYPE_BF16 ? "bf16" : "fp8", c.hkv, c.group, c.q_len,
             c.lens.size());
}

/* Random pool, block table (shuffled ids), queries and scales. Tokens past a request's end in
 * its last page are NaN codes: a kernel that lets them into the result fails. */
static void make_inputs(const Case &c, Inputs &in)
{
    const int layers = 2;
    TK(tkvk_layout_init(&in.lay, layers, c.hkv, c.head_dim, c.page_tokens, c.kv_dtype,
                        c.scale_mode));
    in.layer = 1;
    int nreq = (int)c.lens.size(), P = c.page_tokens;
    int max_blocks = 1;
    int total_blocks = 0;
    for (int32_t L : c.lens) {
        int b = (L + P - 1) / P;
        if (b > max_blocks)
            max_blocks = b;
        total_blocks += b;
    }
    in.bt_stride = max_blocks + 1;
    in.num_blocks = total_blocks + 3;
    in.pool.assign((size_t)in.num_blocks * in.lay.block_stride, 0);
    /* contents */
    const tkvk_layout &L = in.lay;
    bool fp8 = c.kv_dtype == TKVK_DTYPE_FP8_E4M3;
    size_t elems = (size_t)P * c.hkv * c.head_dim;
    for (int b = 0; b < in.num_blocks; b++)
        for (int l = 0; l < layers; l++) {
            uint8_t *page = in.pool.data() + (size_t)b * L.block_stride + (size_t)l * L.layer_stride;
            for (size_t i = 0; i < 2 * elems; i++) {
                float x = rnd_normal() * 2.5f;
                if (fp8) {
                    page[i] = tkvk_fp8_from_float(x);
                } else {
                    uint16_t h = tkvk_bf16_from_float(x);
                    memcpy(page + 2 * i, &h, 2);
                }
            }
            if (c.scale_mode == TKVK_SCALE_PER_TOKEN_HEAD)
                for (int t = 0; t < P * c.hkv; t++) {
                    float s = (float)(0.3 + 1.2 * rnd_unit());
                    memcpy(page + L.kscale_offset + 4 * (size_t)t, &s, 4);
                }
        }
    /* block table: a shuffled set of distinct ids; unused entries are out of range */
    std::vector<int32_t> ids(in.num_blocks);
    for (int i = 0; i < in.num_blocks; i++)
        ids[i] = i;
    for (int i = in.num_blocks - 1; i > 0; i--) {
        int j = rnd_int(i + 1);
        int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    in.table.assign((size_t)nreq * in.bt_stride, -7);
    int next = 0;
    for (int r = 0; r < nreq; r++) {
        int nb = (c.lens[r] + P - 1) / P;
        for (int b = 0; b < nb; b++)
            in.table[(size_t)r * in.bt_stride + b] = ids[next++];
        /* NaN codes in the unused tail of the last page, in the tested layer */
        if (c.lens[r] % P) {
            int32_t blk = in.table[(size_t)r * in.bt_stride + nb - 1];
            uint8_t *page = in.pool.data() + (size_t)blk * L.block_stride +
                            (size_t)in.layer * L.layer_stride;
            for (int t = c.lens[r] % P; t < P; t++)
                for (int kv = 0; kv < 2; kv++) {
                    uint8_t *row = page + (kv ? L.v_offset : 0) + (size_t)t * L.token_stride;
                    for (size_t i = 0; i < L.token_stride; i += L.elem_bytes) {
                        if (fp8)
                            row[i] = 0x7f;
                        else {
                            uint16_t h = 0x7fc0;
                            memcpy(row + i, &h, 2);
                        }
                    }
                }
        }
    }
    int hq = c.hkv * c.group;
    size_t qn = (size_t)nreq * c.q_len * hq * c.head_dim;
    in.q.assign(qn * (c.q_dtype == TKVK_DTYPE_BF16 ? 2 : 1), 0);
    in.q_scales.assign((size_t)nreq * c.q_len * hq, 0.0f);
    for (size_t i = 0; i < in.q_scales.size(); i++)
        in.q_scales[i] = (float)(0.004 + 0.01 * rnd_unit());
    for (size_t i = 0; i < qn; i++) {
        if (c.q_dtype == TKVK_DTYPE_BF16) {
            uint16_t h = tkvk_bf16_from_float(rnd_normal() * 1.5f);
            memcpy(&in.q[2 * i], &h, 2);
        } else {
            in.q[i] = tkvk_fp8_from_float(rnd_normal() * 150.0f);
        }
    }
    in.v_head_scales.assign(c.hkv, 0.0f);
    for (int h = 0; h < c.hkv; h++)
        in.v_head_scales[h] = (float)(0.2 + rnd_unit());
    in.k_scale = (float)(0.4 + 0.8 * rnd_unit());
    in.v_scale = (float)(0.2 + 0.5 * rnd_unit());
    in.sm_scale = 1.0f / sqrtf((float)c.head_dim);
}

/* float64 reference: out [nreq][q_len][hq][D], lse base 2 */
static void reference(const Case &c, const Inputs &in, std::vector<double> &out,
                      std::vector<double> &lse)
{
    const tkvk_layout &L = in.lay;
    int nreq = (int)c.lens.size(), hq = c.hkv * c.group, D = c.head_dim, P = c.page_tokens;
    out.assign((size_t)nreq * c.q_len * hq * D, 0.0);
    lse.assign((size_t)nreq * c.q_len * hq, -INFINITY);
    bool fp8 = c.kv_dtype == TKVK_DTYPE_FP8_E4M3;
    std::vector<double> k, v, q(D), s, acc(D);
    for (int r = 0; r < nreq; r++) {
        int32_t len = c.lens[r];
        for (int h = 0; h < c.hkv; h++) {
            k.assign((size_t)len * D, 0.0);
            v.assign((size_t)len * D, 0.0);
            for (int pos = 0; pos < len; pos++) {
                int32_t blk = in.table[(size_t)r * in.bt_stride + pos / P];
                const uint8_t *page = in.pool.data() + (size_t)blk * L.block_stride +
                                      (size_t)in.layer * L.layer_stride;
                size_t off = (size_t)(pos % P) * L.token_stride + (size_t)h * D * L.elem_bytes;
                double ks = in.k_scale, vs = in.v_scale;
                if (c.scale_mode == TKVK_SCALE_PER_TOKEN_HEAD) {
                    float f;
                    memcpy(&f, page + L.kscale_offset + ((size_t)(pos % P) * c.hkv + h) * 4, 4);
                    ks = f;
                    vs = in.v_head_scales[h];
                }
                for (int d = 0; d < D; d++) {
                    if (fp8) {
                        k[(size_t)pos * D + d] = tkvk_fp8_to_float(page[off + d]) * ks;
                        v[(size_t)pos * D + d] =
                            tkvk_fp8_to_float(page[L.v_offset + off + d]) * vs;
                    } else {
                        uint16_t a, b;
                        memcpy(&a, page + off + 2 * d, 2);
                        memcpy(&b, page + L.v_offset + off + 2 * d, 2);
                        k[(size_t)pos * D + d] = tkvk_bf16_to_float(a);
                        v[(size_t)pos * D + d] = tkvk_bf16_to_float(b);
                    }
                }
            }
            for (int t = 0; t < c.q_len; t++)
                for (int gh = 0; gh < c.group; gh++) {
                    size_t qi = ((size_t)r * c.q_len + t) * hq + (size_t)h * c.group + gh;
                    for (int d = 0; d < D; d++) {
                        if (c.q_dtype == TKVK_DTYPE_BF16) {
                            uint16_t b;
                            memcpy(&b, &in.q[2 * (qi * D + d)], 2);
                            q[d] = tkvk_bf16_to_float(b);
                        } else {
                            q[d] = (double)tkvk_fp8_to_float(in.q[qi * D + d]) * in.q_scales[qi];
                        }
                    }
                    int vis = len - c.q_len + t + 1;
                    if (vis <= 0)
                        continue;
                    s.assign(vis, 0.0);
                    double mx = -INFINITY;
                    for (int pos = 0; pos < vis; pos++) {
                        double dot = 0.0;
                        for (int d = 0; d < D; d++)
                            dot += q[d] * k[(size_t)pos * D + d];
                        s[pos] = dot * in.sm_scale * 1.4426950408889634;
                        if (s[pos] > mx)
                            mx = s[pos];
                    }
                    double sum = 0.0;
                    for (int d = 0; d < D; d++)
                        acc[d] = 0.0;
                    for (int pos = 0; pos < vis; pos++) {
                        double w = exp2(s[pos] - mx);
                        sum += w;
                        for (int d = 0; d < D; d++)
                            acc[d] += w * v[(size_t)pos * D + d];
                    }
                    for (int d = 0; d < D; d++)
                        out[qi * D + d] = acc[d] / sum;
                    lse[qi] = mx + log2(sum);
                }
        }
    }
}

/* ---- device buffers of one case ----------------------------------------------------------- */

static const int kGuard = 256; /* guard elements after each output */

struct Dev {
    uint8_t *pool;
    int32_t *table, *lens;
    void *q;
    float *q_scales, *v_head_scales;
    uint16_t *out;
    float *lse;
    size_t out_n, lse_n;
};

static void dev_upload(const Case &c, const Inputs &in, Dev &d)
{
    int nreq = (int)c.lens.size(), hq = c.hkv * c.group;
    d.out_n = (size_t)nreq * c.q_len * hq * c.head_dim;
    d.lse_n = (size_t)nreq * c.q_len * hq;
    CK(cudaMalloc((void **)&d.pool, in.pool.size()));
    CK(cudaMemcpy(d.pool, in.pool.data(), in.pool.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d.table, in.table.size() * 4));
    CK(cudaMemcpy(d.table, in.table.data(), in.table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d.lens, (c.lens.size() + 1) * 4));
    CK(cudaMemcpy(d.lens, c.lens.data(), c.lens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d.q, in.q.size()));
    CK(cudaMemcpy(d.q, in.q.data(), in.q.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d.q_scales, in.q_scales.size() * 4 + 4));
    CK(cudaMemcpy(d.q_scales, in.q_scales.data(), in.q_scales.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d.v_head_scales, in.v_head_scales.size() * 4));
    CK(cudaMemcpy(d.v_head_scales, in.v_head_scales.data(), in.v_head_scales.size() * 4,
                  cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d.out, (d.out_n + kGuard) * 2));
    CK(cudaMalloc((void **)&d.lse, (d.lse_n + kGuard) * 4));
}

static void dev_free(Dev &d)
{
    cudaFree(d.pool);
    cudaFree(d.table);
    cudaFree(d.lens);
    cudaFree(d.q);
    cudaFree(d.q_scales);
    cudaFree(d.v_head_scales);
    cudaFree(d.out);
    cudaFree(d.lse);
}

static tkvk_decode_args make_args(const Case &c, const Inputs &in, const Dev &d)
{
    tkvk_decode_args a;
    memset(&a, 0, sizeof a);
    a.layout = &in.lay;
    a.layer = in.layer;
    a.num_requests = (int)c.lens.size();
    a.num_q_heads = c.hkv * c.group;
    a.q_len = c.q_len;
    a.q_dtype = c.q_dtype;
    a.q = d.q;
    a.q_scales = d.q_scales;
    a.kv_lens = d.lens;
    a.block_table = d.table;
    a.block_table_stride = in.bt_stride;
    a.num_blocks = in.num_blocks;
    a.pool = d.pool;
    a.k_scale = in.k_scale;
    a.v_scale = in.v_scale;
    a.v_head_scales = d.v_head_scales;
    a.sm_scale = in.sm_scale;
    a.out = d.out;
    a.lse = d.lse;
    return a;
}

/* Poison: outputs NaN (0xffff bf16, 0xffffffff f32), guards a known pattern. */
static void poison(const Dev &d)
{
    CK(cudaMemset(d.out, 0xff, d.out_n * 2));
    CK(cudaMemset(d.out + d.out_n, 0x5a, kGuard * 2));
    CK(cudaMemset(d.lse, 0xff, d.lse_n * 4));
    CK(cudaMemset(d.lse + d.lse_n, 0x5a, kGuard * 4));
}

struct Result {
    std::vector<uint16_t> out;
    std::vector<float> lse;
};

static void fetch(const Dev &d, Result &r, bool *guards_ok)
{
    std::vector<uint16_t> o(d.out_n + kGuard);
    std::vector<float> l(d.lse_n + kGuard);
    CK(cudaMemcpy(o.data(), d.out, o.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(l.data(), d.lse, l.size() * 4, cudaMemcpyDeviceToHost));
    *guards_ok = true;
    for (int i = 0; i < kGuard; i++) {
        if (o[d.out_n + i] != 0x5a5a)
            *guards_ok = false;
        uint32_t u;
        memcpy(&u, &l[d.lse_n + i], 4);
        if (u != 0x5a5a5a5au)
            *guards_ok = false;
    }
    o.resize(d.out_n);
    l.resize(d.lse_n);
    r.out = o;
    r.lse = l;
}

/* Compares with the reference; prints one line; returns 1 on pass. */
static int check(const char *what, const Case &c, const Result &r, const std::vector<double> &ref,
                 const std::vector<double> &ref_lse, bool guards_ok)
{
    char name[128];
    case_name(c, name, sizeof name);
    double tol_o = c.kv_dtype == TKVK_DTYPE_BF16 ? 1.2e-2 : 6e-3;
    double tol_l = c.kv_dtype == TKVK_DTYPE_BF16 ? 4e-3 : 2e-3;
    int D = c.head_dim;
    double num = 0.0, den = 0.0, lse_err = 0.0;
    long nan = 0, empty_bad = 0;
    for (size_t row = 0; row < ref_lse.size(); row++) {
        float gl = r.lse[row];
        if (isnan(gl))
            nan++;
        if (ref_lse[row] == -INFINITY) {
            if (!(gl == -INFINITY))
                empty_bad++;
            for (int d = 0; d < D; d++)
                if (r.out[row * D + d] != 0 && r.out[row * D + d] != 0x8000)
                    empty_bad++;
            continue;
        }
        double e = fabs((double)gl - ref_lse[row]);
        if (!(e <= lse_err))
            lse_err = isnan(e) ? INFINITY : (e > lse_err ? e : lse_err);
        for (int d = 0; d < D; d++) {
            float x = tkvk_bf16_to_float(r.out[row * D + d]);
            if (isnan(x))
                nan++;
            double diff = (double)x - ref[row * D + d];
            num += diff * diff;
            den += ref[row * D + d] * ref[row * D + d];
        }
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    int ok = nan == 0 && empty_bad == 0 && guards_ok && rel <= tol_o && lse_err <= tol_l;
    printf("%s %-8s %-48s rel_l2 %.2e (tol %.0e) lse_err %.2e nan %ld empty_bad %ld guards %s\n",
           ok ? "PASS" : "FAIL", what, name, rel, tol_o, lse_err, nan, empty_bad,
           guards_ok ? "ok" : "OVERWRITTEN");
    if (!ok)
        g_failures++;
    return ok;
}

static bool same_bits(const Result &a, const Result &b)
{
    return a.out.size() == b.out.size() &&
           memcmp(a.out.data(), b.out.data(), a.out.size() * 2) == 0 &&
           memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0;
}

static int max_rows_of(const Case &c)
{
    return c.plan_rows ? c.plan_rows : c.group * c.q_len;
}

/* The device's task map of the last plan against the CPU planner's, field by field. */
static void check_plan_map(tkvk_decode_plan *plan, const std::vector<int32_t> &lens, int hkv,
                           cudaStream_t s)
{
    tkvk_decode_map dm, cm;
    int pairs = (int)lens.size() * hkv;
    int grid = tkvk_decode_plan_grid(plan);
    TK(tkvk_decode_map_init(&dm, pairs, grid));
    TK(tkvk_decode_map_init(&cm, pairs, grid));
    TK(tkvk_decode_plan_download(plan, &dm, s));
    TK(tkvk_decode_plan_cpu(lens.data(), (int)lens.size(), hkv, grid,
                            tkvk_decode_plan_min_tiles(plan), tkvk_decode_plan_cta_warps(plan),
                            &cm));
    bool eq = dm.num_tasks == cm.num_tasks && dm.num_bins == cm.num_bins &&
              dm.tiles_per_cta == cm.tiles_per_cta && dm.num_tiles == cm.num_tiles &&
              dm.num_slots == cm.num_slots && dm.bins_per_cta == cm.bins_per_cta &&
              memcmp(dm.tasks, cm.tasks, (size_t)cm.num_tasks * sizeof *cm.tasks) == 0 &&
              memcmp(dm.task_slot, cm.task_slot, (size_t)cm.num_tasks * 4) == 0 &&
              memcmp(dm.bin_first, cm.bin_first, ((size_t)grid + 1) * 4) == 0 &&
              memcmp(dm.pair_first, cm.pair_first, (size_t)pairs * 4) == 0 &&
              memcmp(dm.pair_count, cm.pair_count, (size_t)pairs * 4) == 0 &&
              memcmp(dm.slot_first, cm.slot_first, (size_t)pairs * 4) == 0 &&
              memcmp(dm.slot_count, cm.slot_count, (size_t)pairs * 4) == 0;
    printf("%s plan     device task map == CPU planner (%d pairs, grid %d, %d tiles, %d per "
           "CTA, %d tasks, %d slots, %d bins per CTA)\n",
           eq ? "PASS" : "FAIL", pairs, grid, cm.num_tiles, cm.tiles_per_cta, cm.num_tasks,
           cm.num_slots, cm.bins_per_cta);
    if (!eq)
        g_failures++;
    tkvk_decode_map_free(&dm);
    tkvk_decode_map_free(&cm);
}

/* Plans alone over many pairs: past one scan chunk of the plan kernel (1,024 pairs), and past
 * what its shared memory holds (the per-pair arrays then stay in global memory), with random
 * lengths from 0 to 128K. */
static void run_plan_maps(cudaStream_t s)
{
    static const int shapes[3][2] = {{1500, 2}, {4096, 4}, {20000, 1}}; /* requests, KV heads */
    for (const auto &sh : shapes) {
        std::vector<int32_t> lens(sh[0]);
        for (int32_t &L : lens)
            L = rnd_int(8) == 0 ? 0 : rnd_int(4) == 0 ? rnd_int(131073) : rnd_int(3000);
        lens[rnd_int(sh[0])] = 131072;
        int32_t *d_lens;
        CK(cudaMalloc((void **)&d_lens, lens.size() * sizeof(int32_t)));
        CK(cudaMemcpy(d_lens, lens.data(), lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
        tkvk_decode_plan *plan = NULL;
        TK(tkvk_decode_plan_create(&plan, sh[0], sh[1], 8, 128));
        TK(tkvk_decode_plan_cuda(plan, d_lens, sh[0], s));
        check_plan_map(plan, lens, sh[1], s);
        tkvk_decode_plan_destroy(plan);
        CK(cudaFree(d_lens));
    }
}

/* Dynamic and static on one case, plus determinism and the task map. */
static void run_case(const Case &c, cudaStream_t s, bool check_map)
{
    Inputs in;
    make_inputs(c, in);
    std::vector<double> ref, ref_lse;
    reference(c, in, ref, ref_lse);
    Dev d;
    dev_upload(c, in, d);
    tkvk_decode_args a = make_args(c, in, d);
    tkvk_decode_plan *plan = NULL;
    TK(tkvk_decode_plan_create(&plan, (int)c.lens.size(), c.hkv, max_rows_of(c), c.head_dim));
    int32_t max_len = 0;
    for (int32_t L : c.lens)
        max_len = L > max_len ? L : max_len;

    Result first, again;
    bool g1, g2;
    for (int rep = 0; rep < 3; rep++) {
        poison(d);
        TK(tkvk_decode_plan_cuda(plan, d.lens, (int)c.lens.size(), s));
        TK(tkvk_decode_attend_cuda(plan, &a, s));
        CK(cudaStreamSynchronize(s));
        if (rep == 0) {
            fetch(d, first, &g1);
            check("dynamic", c, first, ref, ref_lse, g1);
        } else {
            fetch(d, again, &g2);
            if (!same_bits(first, again)) {
                char name[128];
                case_name(c, name, sizeof name);
                printf("FAIL repeat   %s: run %d differs from run 0 (a race)\n", name, rep);
                g_failures++;
                break;
            }
        }
    }
    if (check_map)
        check_plan_map(plan, c.lens, c.hkv, s);
    poison(d);
    TK(tkvk_decode_static_cuda(plan, &a, max_len, 0, s));
    CK(cudaStreamSynchronize(s));
    Result st;
    fetch(d, st, &g1);
    check("static", c, st, ref, ref_lse, g1);
    tkvk_decode_plan_destroy(plan);
    dev_free(d);
}

/* A graph of plan + attention + combine, captured once, replayed after the KV lengths (on
 * the device) change: the second replay must match a reference for the new lengths. */
static void run_graph(cudaStream_t s)
{
    Case c = {128, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 2, 8, 2,
              {700, 64, 3000, 1, 0, 129}};
    Inputs in;
    make_inputs(c, in);
    Dev d;
    dev_upload(c, in, d);
    tkvk_decode_args a = make_args(c, in, d);
    tkvk_decode_plan *plan = NULL;
    TK(tkvk_decode_plan_create(&plan, (int)c.lens.size(), c.hkv, max_rows_of(c), c.head_dim));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TK(tkvk_decode_plan_cuda(plan, d.lens, (int)c.lens.size(), s));
    TK(tkvk_decode_attend_cuda(plan, &a, s));
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const std::vector<int32_t> orig = c.lens;
    for (int step = 0; step < 3; step++) {
        if (step > 0) {
            /* new lengths, never past the original ones (the table covers those, and the NaN
             * tails of the original last pages stay out of sight) */
            for (size_t r = 0; r < c.lens.size(); r++)
                c.lens[r] = step == 1 ? orig[r] / 3 : (orig[r] > 0 ? orig[r] - 1 : 0);
            CK(cudaMemcpyAsync(d.lens, c.lens.data(), c.lens.size() * 4, cudaMemcpyHostToDevice,
                               s));
        }
        poison(d);
        CK(cudaGraphLaunch(exec, s));
        CK(cudaStreamSynchronize(s));
        std::vector<double> ref, ref_lse;
        reference(c, in, ref, ref_lse);
        Result r;
        bool g;
        fetch(d, r, &g);
        char what[16];
        snprintf(what, sizeof what, "graph%d", step);
        check(what, c, r, ref, ref_lse, g);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    tkvk_decode_plan_destroy(plan);
    dev_free(d);
}

static void run_merge(cudaStream_t s)
{
    const int rows = 300, D = 128;
    std::vector<uint16_t> oa(rows * D), ob(rows * D), out(rows * D), cpu(rows * D);
    std::vector<float> la(rows), lb(rows), lo(rows), lcpu(rows);
    for (int i = 0; i < rows * D; i++) {
        oa[i] = tkvk_bf16_from_float(rnd_normal());
        ob[i] = tkvk_bf16_from_float(rnd_normal());
    }
    for (int r = 0; r < rows; r++) {
        la[r] = (float)(rnd_normal() * 8);
        lb[r] = (float)(rnd_normal() * 8);
        if (r % 7 == 0)
            la[r] = -INFINITY;
        if (r % 11 == 0)
            lb[r] = -INFINITY;
        if (r % 7 == 0 && la[r] == -INFINITY)
            for (int d = 0; d < D; d++)
                oa[r * D + d] = 0x7fc0; /* weight 0: must not be read */
    }
    uint16_t *d_oa, *d_ob, *d_out;
    float *d_la, *d_lb, *d_lo;
    CK(cudaMalloc((void **)&d_oa, rows * D * 2));
    CK(cudaMalloc((void **)&d_ob, rows * D * 2));
    CK(cudaMalloc((void **)&d_out, rows * D * 2));
    CK(cudaMalloc((void **)&d_la, rows * 4));
    CK(cudaMalloc((void **)&d_lb, rows * 4));
    CK(cudaMalloc((void **)&d_lo, rows * 4));
    CK(cudaMemcpy(d_oa, oa.data(), rows * D * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ob, ob.data(), rows * D * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_la, la.data(), rows * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_lb, lb.data(), rows * 4, cudaMemcpyHostToDevice));
    TK(tkvk_merge_states_cuda(d_oa, d_la, d_ob, d_lb, rows, D, d_out, d_lo, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(out.data(), d_out, rows * D * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lo.data(), d_lo, rows * 4, cudaMemcpyDeviceToHost));
    TK(tkvk_merge_states_cpu(oa.data(), la.data(), ob.data(), lb.data(), rows, D, cpu.data(),
                             lcpu.data()));
    double maxd = 0, maxl = 0;
    long bad = 0;
    for (int i = 0; i < rows * D; i++) {
        float x = tkvk_bf16_to_float(out[i]), y = tkvk_bf16_to_float(cpu[i]);
        if (isnan(x))
            bad++;
        double e = fabs((double)x - y) / (fabs((double)y) + 1e-3);
        maxd = e > maxd ? e : maxd;
    }
    for (int r = 0; r < rows; r++) {
        if (lcpu[r] == -INFINITY) {
            if (lo[r] != -INFINITY)
                bad++;
            continue;
        }
        double e = fabs((double)lo[r] - lcpu[r]);
        maxl = e > maxl ? e : maxl;
    }
    int ok = bad == 0 && maxd <= 8e-3 && maxl <= 1e-5;
    printf("%s merge    GPU vs CPU merge states: max rel %.2e, lse %.2e, bad %ld\n",
           ok ? "PASS" : "FAIL", maxd, maxl, bad);
    if (!ok)
        g_failures++;
    cudaFree(d_oa);
    cudaFree(d_ob);
    cudaFree(d_out);
    cudaFree(d_la);
    cudaFree(d_lb);
    cudaFree(d_lo);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("SKIP gpu_test_decode: no GPU\n");
        return 77;
    }
    const char *seed_env = getenv("TKV_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
    g_rng = seed;
    printf("gpu_test_decode: seed %llu\n", (unsigned long long)seed);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));

    /* Every combination of head dim x KV mode x Q dtype; page size, group and query length
     * cycle so that each of their values meets several of the others. */
    static const int dims[3] = {64, 128, 256};
    static const int pages[4] = {16, 32, 64, 128};
    static const int groups[7] = {1, 2, 3, 4, 8, 12, 16};
    int k = 0;
    for (int di = 0; di < 3; di++)
        for (int mode = 0; mode < 3; mode++)
            for (int qd = 0; qd < 2; qd++, k++) {
                Case c;
                c.head_dim = dims[di];
                c.kv_dtype = mode == 2 ? TKVK_DTYPE_BF16 : TKVK_DTYPE_FP8_E4M3;
                c.scale_mode = mode == 1 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR;
                c.q_dtype = qd ? TKVK_DTYPE_FP8_E4M3 : TKVK_DTYPE_BF16;
                c.page_tokens = pages[(k + di) % 4];
                c.hkv = 1 + k % 3;
                c.group = groups[k % 7];
                c.q_len = 1 + (k * 3) % 8;
                int P = c.page_tokens;
                int extra = 300 + rnd_int(2500);
                c.lens = {0, 1, P - 1, P, P + 1, extra, c.q_len > 1 ? c.q_len - 1 : 2, 64 + rnd_int(200)};
                run_case(c, s, k % 4 == 0);
            }
    /* FP8 Q over FP8 KV with up to 32 rows per pair runs the warp-worker kernel: every head
     * dim x scale mode x page size, rows from 1 to 32 (D = 256 past 16 rows: CTA kernel). */
    static const int gq[8][2] = {{8, 1}, {8, 4}, {16, 1}, {3, 5}, {12, 2}, {1, 8}, {4, 8}, {2, 1}};
    k = 0;
    for (int di = 0; di < 3; di++)
        for (int mode = 0; mode < 2; mode++)
            for (int pi = 0; pi < 4; pi++, k++) {
                int P = pages[pi];
                Case c = {dims[di], P, TKVK_DTYPE_FP8_E4M3,
                          mode ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR,
                          TKVK_DTYPE_FP8_E4M3, 1 + k % 3, gq[k % 8][0], gq[k % 8][1],
                          {P + 1, 0, 1, 31, 32, 33, P - 1, P, 300 + rnd_int(2500),
                           gq[k % 8][1] > 1 ? gq[k % 8][1] - 1 : 2, 64 + rnd_int(200)}};
                run_case(c, s, k % 4 == 0);
            }
    /* The same shapes through the CTA kernel (what the benchmark compares against). */
    tkvk__decode_kernel(TKVK__DEC_CTA);
    for (int i = 0; i < 4; i++) {
        Case c = {i < 2 ? 128 : 64, i % 2 ? 16 : 64, TKVK_DTYPE_FP8_E4M3,
                  i == 3 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3,
                  2, gq[i][0], gq[i][1], {4097, 0, 1, 63, 64, 65, 300 + rnd_int(2500)}};
        run_case(c, s, false);
    }
    /* At most 8 rows through the warp-worker kernel's other layout (rows on the mma's M side,
     * the benchmark's m16 column): head dims x scale modes x pages, rows 8, 8 and 2. */
    tkvk__decode_kernel(TKVK__DEC_WARP_M16);
    static const int gq8[4][2] = {{8, 1}, {1, 8}, {2, 1}, {4, 2}};
    for (int i = 0; i < 4; i++) {
        int P = pages[i];
        Case c = {dims[i % 3], P, TKVK_DTYPE_FP8_E4M3,
                  i % 2 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3,
                  2, gq8[i][0], gq8[i][1], {P + 1, 0, 1, 31, 32, 33, 4097, 300 + rnd_int(2500)}};
        run_case(c, s, false);
    }
    /* 17..32 rows through one warp per worker (both m-tiles in one warp, the benchmark's one
     * column) instead of two: rows 32, 24 and 20. */
    tkvk__decode_kernel(TKVK__DEC_WARP_ONE);
    static const int gq32[3][2] = {{8, 4}, {12, 2}, {4, 5}};
    for (int i = 0; i < 3; i++) {
        int P = pages[i + 1];
        Case c = {i == 2 ? 64 : 128, P, TKVK_DTYPE_FP8_E4M3,
                  i % 2 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3,
                  2, gq32[i][0], gq32[i][1], {P + 1, 0, 1, 31, 32, 33, 4097, 300 + rnd_int(2500)}};
        run_case(c, s, i == 0);
    }
    /* 8..64 rows at head dim 128 (q_len 1..8 of a group of 8 and odd counts) through the
     * warpgroup kernel (TKVK__DEC_WG: every N it pads to, 16-64, and its forms), then the same
     * shapes through the launcher's choice without it: both scale modes, every page size. */
    static const int gqw[7][2] = {{8, 2}, {8, 3}, {8, 4}, {8, 5}, {8, 8}, {3, 7}, {8, 1}};
    for (int which = TKVK__DEC_WG; which >= TKVK__DEC_LEGACY; which--) {
        tkvk__decode_kernel(which);
        for (int i = 0; i < 7; i++) {
            if (which == TKVK__DEC_WG) {
                /* and in its other forms (fewer stages and more CTAs an SM; P.V awaited at
                 * once; no query staging; the running maximum kept within 8 or 0, so that
                 * both of its paths run): 12, 32, 34 and 22 on every shape, the others on
                 * every other shape */
                static const int forms[7] = {12, 32, 34, 22, 2, 3, 13};
                for (int fi = 0; fi < 7; fi++) {
                    const int st = forms[fi];
                    if (fi >= 4 && (i + fi) % 2)
                        continue;
                    tkvk__decode_wg_form(st);
                    int P = pages[(i + st) % 4];
                    Case c = {128, P, TKVK_DTYPE_FP8_E4M3,
                              (i + st) % 2 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR,
                              TKVK_DTYPE_FP8_E4M3, 1 + (i + st) % 3, gqw[i][0], gqw[i][1],
                              {P + 1, 0, 1, 31, 32, 33, 4097, 300 + rnd_int(2500),
                               gqw[i][1] - 1, 64 + rnd_int(200)}};
                    printf("warpgroup kernel, form %d:\n", st);
                    run_case(c, s, false);
                }
                tkvk__decode_wg_form(0);
            }
            int P = pages[i % 4];
            Case c = {128, P, TKVK_DTYPE_FP8_E4M3,
                      i % 2 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR,
                      TKVK_DTYPE_FP8_E4M3, 1 + i % 3, gqw[i][0], gqw[i][1],
                      {P + 1, 0, 1, 31, 32, 33, 4097, 300 + rnd_int(2500), gqw[i][1] - 1,
                       64 + rnd_int(200)}};
            run_case(c, s, i == 0);
        }
    }
    tkvk__decode_kernel(TKVK__DEC_AUTO);
    /* A plan made for 32 rows (two warps per worker) used for steps of 16 and 8 rows (the
     * second warp of each worker has no rows). */
    for (int rows = 16; rows >= 8; rows /= 2) {
        Case c = {128, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 2,
                  8, rows / 8, {4097, 0, 1, 63, 64, 65, 300 + rnd_int(2500)}, 32};
        run_case(c, s, false);
    }
    /* Two warps per bin with the CTA's merge: one request of as many tiles as the grid has
     * warps (SMs x 8) makes, at the 32-row floor of 2 tiles, 4 bins per CTA of 8 warps: every
     * bin is worked by two warps and each CTA's run of bins is merged into one slot. */
    {
        int sms = 0;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        Case c = {128, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 1, 8,
                  4, {sms * 8 * 64}};
        run_case(c, s, true);
    }
    /* The benchmark's shapes, with 128K in the batch. */
    {
        Case c = {128, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 1, 8, 1,
                  {131072, 0, 1, 63, 64, 65, 4096, 4096, 777}};
        run_case(c, s, true);
        c.q_len = 4;
        c.hkv = 2;
        c.lens = {131072, 1, 64, 65, 4096, 2, 3};
        run_case(c, s, true);
    }
    /* Every warps-per-row choice of the combine and its dim slices (the launcher picks them
     * by the row count): 24 pairs x 32 rows, one of them 128K long, and empty and one-tile
     * pairs. {K, slices, head dim}. */
    const int combines[][3] = {{1, 1, 128}, {2, 1, 128}, {4, 1, 128},  {8, 1, 128},
                               {16, 1, 64}, {16, 2, 64}, {16, 4, 128}, {4, 4, 256},
                               {16, 2, 256}};
    for (const auto &cb : combines) {
        tkvk__decode_tune(cb[0] + 100 * cb[1]);
        Case c = {cb[2], 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR,
                  TKVK_DTYPE_FP8_E4M3, 3, 8, 4, {131072, 0, 1, 65, 4096, 3000, 200, 64}};
        printf("combine with %d warps per row, %d slices, head dim %d:\n", cb[0], cb[1], cb[2]);
        run_case(c, s, false);
    }
    tkvk__decode_tune(0);
    /* Largest rows per pair: group 16 x q_len 8 = 128 rows (8 warps per CTA). */
    {
        Case c = {128, 32, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TOKEN_HEAD, TKVK_DTYPE_BF16, 1, 16,
                  8, {5, 1000, 31, 33, 8}};
        run_case(c, s, false);
        c.q_dtype = TKVK_DTYPE_FP8_E4M3; /* the same through the e4m3 Q.K products */
        c.scale_mode = TKVK_SCALE_PER_TENSOR;
        c.page_tokens = 128;
        run_case(c, s, false);
    }
    run_plan_maps(s);
    run_graph(s);
    run_merge(s);
    CK(cudaStreamDestroy(s));
    printf("gpu_test_decode: %s (%d failure%s)\n", g_failures ? "FAIL" : "PASS", g_failures,
           g_failures == 1 ? "" : "s");
    return g_failures ? 1 : 0;
}
