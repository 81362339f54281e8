/* tkv_kernels.h - the one header for tierkv's kernels.
 *
 * Every entry point exists twice: `tkvk_<op>_cpu()` (plain C, the reference for tests and
 * the daemon's path without a GPU) and `tkvk_<op>_cuda()` (sm_90a; takes a cudaStream_t as
 * `void *stream`; checks its preconditions, launches, checks cudaGetLastError()). The CUDA
 * ones exist only when the library was built with CUDA (TKVK_HAVE_CUDA is then defined by
 * the build, and tkvk_cuda_available() reports whether a device is usable at run time).
 *
 * All functions return TKVK_OK or a negative TKVK_E* code; unsupported shapes are refused
 * with TKVK_EUNSUPPORTED (and tkvk_last_error() says why), never computed wrong.
 *
 * Sections: common (status, dtypes, FP8, paged layout) / fused prologue / decode attention /
 * merge states / block copy.
 */
#ifndef TKV_KERNELS_H
#define TKV_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================
 * Common
 * ========================================================================================== */

enum {
    TKVK_OK = 0,
    TKVK_EINVAL = -1,       /* NULL pointer, negative count, inconsistent sizes */
    TKVK_EUNSUPPORTED = -2, /* a shape outside the supported set (head dim, page size, group) */
    TKVK_ECUDA = -3,        /* a CUDA call failed (message in tkvk_last_error()) */
    TKVK_ENODEV = -4,       /* no usable GPU, or built without CUDA */
};

const char *tkvk_strerror(int err);
/* Thread-local description of the last failure in this thread ("" if none). */
const char *tkvk_last_error(void);

enum { TKVK_DTYPE_FP8_E4M3 = 0, TKVK_DTYPE_BF16 = 1 };
enum { TKVK_SCALE_PER_TENSOR = 0, TKVK_SCALE_PER_TOKEN_HEAD = 1 };

/* ---- FP8 e4m3 (OCP "e4m3fn": no infinities, 0x7f/0xff NaN, max 448) ----
 * float -> e4m3: round to nearest even, saturating to +-448; NaN -> 0x7f.
 * Bit-identical between these CPU functions and the device ones in kernels/fp8.cuh. */
uint8_t tkvk_fp8_from_float(float x);
float tkvk_fp8_to_float(uint8_t v);
#define TKVK_FP8_MAX 448.0f

/* bf16 stored as uint16_t (the upper half of an IEEE float). float -> bf16 rounds to nearest
 * even; NaN stays NaN. */
uint16_t tkvk_bf16_from_float(float x);
float tkvk_bf16_to_float(uint16_t v);

/* ---- the paged KV layout (design brief section 3), described once -----------------------
 * One block (page) = P tokens of every layer, K and V:
 *     block b, layer l at  pool + b * block_stride + l * layer_stride
 *       K  [token][kv_head][dim]   at +0
 *       V  [token][kv_head][dim]   at +v_offset            (v_offset = P * token_stride)
 *       K scales [token][kv_head] float32 at +kscale_offset (per-token-head mode only)
 *     layer_stride = 2 * P * token_stride (+ P * Hkv * 4 for in-page K scales), rounded up
 *     to 16 bytes; block_stride = L * layer_stride.
 * Per-head V scales (per-token-head mode) and per-tensor K/V scales are parameters of the
 * kernels, not stored in pages. Kernels take a tkvk_layout, never assume a fixed shape. */
typedef struct tkvk_layout {
    int num_layers;
    int num_kv_heads;
    int head_dim;       /* 64, 128, 256 */
    int page_tokens;    /* 16, 32, 64, 128 */
    int kv_dtype;       /* TKVK_DTYPE_* */
    int scale_mode;     /* TKVK_SCALE_*; per-token-head requires FP8 */
    size_t elem_bytes;
    size_t token_stride;
    size_t v_offset;
    size_t kscale_offset; /* 0 when there are no in-page scales */
    size_t layer_stride;
    size_t block_stride;
} tkvk_layout;

/* Fills *lay; TKVK_EUNSUPPORTED (with the reason) for shapes outside the supported set. */
int tkvk_layout_init(tkvk_layout *lay, int num_layers, int num_kv_heads, int head_dim,
                     int page_tokens, int kv_dtype, int scale_mode);

/* 1 when built with CUDA and a device is usable, else 0. */
int tkvk_cuda_available(void);

/* ============================================================================================
 * Fused prologue (kernels/prologue.c, kernels/prologue.cu)
 * ========================================================================================== */
/* One call = one layer of one forward step: per token, the packed QKV row (BF16) goes through
 *
 *   [RMSNorm of Q and K heads, if norm_mode == BEFORE_ROPE]
 *   RoPE of Q and K heads (NeoX or GPT-J pairing; cos/sin from the table at the token's position)
 *   [RMSNorm of Q and K heads, if norm_mode == AFTER_ROPE]
 *   [normalised Hadamard rotation of every Q and K head, if hadamard]
 *   Q: FP8 with a dynamic per-(token, head) scale, or BF16;  K, V: into the pool's pages
 *
 * in fp32 registers, read once and written once. V heads are only quantised and stored.
 *
 * Arithmetic (the CPU reference and the CUDA kernel do the same float operations in the same
 * order, without fused multiply-adds, so their outputs agree bit for bit):
 *   RMSNorm:  ss = sum of x_i^2, accumulated as D/16 partial sums (partial j sums elements
 *             8j .. 8j+7 then D/2+8j .. D/2+8j+7, in order) combined by the butterfly
 *             p_j += p_(j^m) for m = D/32, .., 2, 1; inv = 1 / sqrtf(ss / D + eps);
 *             y_i = (x_i * inv) * w_i.
 *   RoPE:     pair (a, b) with angle table c = cos[pos][i], s = sin[pos][i]:
 *             a' = a*c - b*s, b' = b*c + a*s. NeoX pairs (i, i + D/2); GPT-J pairs (2i, 2i+1).
 *   Hadamard: the Walsh-Hadamard butterflies for h = 1, 2, 4, .., D/2 ((a, b) -> (a+b, a-b)),
 *             then every element times 1/sqrt(D) (the float nearest to it). Orthonormal and
 *             symmetric: applying it twice gives the input back up to rounding.
 *   Dynamic scale: amax = max |x_i| over the head; scale = max(amax / 448, TKVK_MIN_SCALE);
 *             code_i = fp8(x_i * (1 / scale)). Dequantised: fp8_to_float(code) * scale.
 *   Fixed scale (per-tensor k_scale/v_scale, per-head v_head_scales): code = fp8(x * (1/scale)).
 *
 * Q out: FP8 codes [num_tokens][Hq][D] + q_scale_out [num_tokens][Hq] floats, or BF16
 * [num_tokens][Hq][D] (q_scale_out unused).
 *
 * K/V out: token t goes to slot_mapping[t] = block * P + offset (P = layout->page_tokens):
 * K row at  pool + block*block_stride + layer*layer_stride + offset*token_stride + h*D*elem,
 * V row at  the same + v_offset. In per-token-head mode K's scale goes to the float at
 * + kscale_offset + (offset*Hkv + h)*4 and V uses v_head_scales[h]. slot -1: the token's K/V
 * are not stored (its Q still is). BF16 pools store the values rounded to BF16 (no scale).
 *
 * Tail zero-fill: req_last_slot[r] (num_reqs entries) is the slot of request r's last token
 * after this step, or -1. For every r with last_slot >= 0, rows offset+1 .. P-1 of that page
 * (K, V and in-page K scales, this layer only) are set to zero, so a partially filled last page
 * never holds stale data. Those rows must not be mapped by any token of the same call.
 *
 * Supported: head_dim 64/128/256, page_tokens 16/32/64/128 (both from the layout), Hq a
 * multiple of Hkv with group Hq/Hkv <= 16; anything else is TKVK_EUNSUPPORTED. Positions must
 * lie in [0, max_pos) and slots in [-1, num_blocks * P): the CPU function checks them
 * (TKVK_EINVAL); the CUDA one cannot refuse after launch, so a bad position is clamped into
 * the table and a bad slot is skipped (never written out of bounds); callers validate first.
 *
 * Pointers are host memory for _cpu and device memory for _cuda (the layout is a host struct
 * in both). Pointer alignment for _cuda: qkv, q_out 16 bytes, qkv_stride a multiple of 8,
 * pool 16 bytes. Neither function keeps a pointer after it returns (the CUDA one: after the
 * work on `stream` completes). Thread-safe: no global state besides tkvk_last_error(). */
enum { TKVK_ROPE_NEOX = 0, TKVK_ROPE_GPTJ = 1 };
enum { TKVK_NORM_OFF = 0, TKVK_NORM_BEFORE_ROPE = 1, TKVK_NORM_AFTER_ROPE = 2 };
#define TKVK_MIN_SCALE 1.0e-12f

typedef struct tkvk_prologue_params {
    /* input */
    const uint16_t *qkv;        /* bf16 [num_tokens][qkv_stride]: Hq Q heads, Hkv K, Hkv V */
    size_t qkv_stride;          /* elements between token rows; 0 = packed (Hq + 2 Hkv) * D */
    int num_tokens;             /* >= 0 */
    int num_q_heads;            /* Hq; Hkv and D come from the layout */
    const int32_t *positions;   /* [num_tokens] */
    const float *rope_cos;      /* [max_pos][D/2] */
    const float *rope_sin;      /* [max_pos][D/2] */
    int max_pos;                /* >= 1 */
    int rope_style;             /* TKVK_ROPE_* */
    int norm_mode;              /* TKVK_NORM_* */
    float norm_eps;             /* > 0 when norm_mode != OFF */
    const float *q_norm_weight; /* [D], when norm_mode != OFF */
    const float *k_norm_weight; /* [D], when norm_mode != OFF */
    int hadamard;               /* 0 or 1 */
    /* Q out */
    int q_dtype;                /* TKVK_DTYPE_FP8_E4M3 or TKVK_DTYPE_BF16 */
    void *q_out;                /* [num_tokens][Hq][D] */
    float *q_scale_out;         /* [num_tokens][Hq], FP8 Q only */
    /* K/V out */
    const tkvk_layout *layout;
    int layer;                  /* 0 .. num_layers-1 */
    void *pool;                 /* block 0 at pool */
    int64_t num_blocks;         /* blocks in the pool (bounds the slots) */
    const int64_t *slot_mapping;/* [num_tokens]: block * P + offset, or -1 */
    float k_scale, v_scale;     /* FP8 per-tensor mode; > 0 */
    const float *v_head_scales; /* [Hkv], FP8 per-token-head mode; > 0 */
    /* tail zero-fill */
    int num_reqs;               /* >= 0 */
    const int64_t *req_last_slot; /* [num_reqs], or NULL when num_reqs == 0 */
} tkvk_prologue_params;

/* Defaults: everything zero/NULL except norm_eps 1e-6, k_scale = v_scale = 1, NeoX, norm off,
 * FP8 Q. */
void tkvk_prologue_params_init(tkvk_prologue_params *p);

int tkvk_prologue_cpu(const tkvk_prologue_params *p);
int tkvk_prologue_cuda(const tkvk_prologue_params *p, void *stream);

/* The 1/sqrt(D) factor of the Hadamard rotation, as the float both implementations use. */
float tkvk_hadamard_scale(int head_dim);

/* ============================================================================================
 * Decode attention: plan / dynamic split / combine / merge states (kernels/decode.c, the CPU
 * references; kernels/decode*.cu, the GPU: decode_dev.cuh lists the files). The static
 * split-KV baseline the benchmark compares against is in dev/decode/decode_static.h.
 * ========================================================================================== */
/* One decode step: every request has the same number q_len of new query tokens (1..8; MTP
 * and speculative verify), already counted in its kv_len. Query token t of a request with
 * kv_len L sees the KV positions p < L - q_len + t + 1 (causal within the new tokens); a row
 * that sees no position (L = 0, or L < q_len) gets O = 0 and LSE = -inf.
 *
 * Scores are s = sm_scale * q.k with q, k, v dequantised:
 *   FP8 Q:   q = q8 * q_scales[request][t][q_head]
 *   FP8 KV, per-tensor:      k = k8 * k_scale,                       v = v8 * v_scale
 *   FP8 KV, per-token-head:  k = k8 * (in-page scale of token, head), v = v8 * v_head_scales[head]
 *   BF16 KV: scales unused.
 * LSE is base 2: lse = log2(sum_p 2^(s_p * log2(e))), so O and LSE of two disjoint key sets
 * merge with tkvk_merge_states_*().
 *
 * Every pointer is host memory for the _cpu functions and device memory for the _cuda ones.
 * The inputs are read only; out/lse are written whole (every element, also for empty rows). */
typedef struct tkvk_decode_args {
    const tkvk_layout *layout; /* host struct in both cases */
    int layer;                 /* 0 .. layout->num_layers-1 */
    int num_requests;          /* >= 0 */
    int num_q_heads;           /* Hq; Hq / Hkv (the GQA group) in 1..16 */
    int q_len;                 /* 1..8 */
    int q_dtype;               /* TKVK_DTYPE_BF16 or TKVK_DTYPE_FP8_E4M3 */
    const void *q;             /* [num_requests][q_len][Hq][head_dim] */
    const float *q_scales;     /* [num_requests][q_len][Hq]; FP8 Q only */
    const int32_t *kv_lens;    /* [num_requests]; 0 .. block_table_stride * page_tokens */
    const int32_t *block_table;/* [num_requests][block_table_stride] block ids in the pool */
    int block_table_stride;    /* >= 1 */
    int num_blocks;            /* ids must lie in [0, num_blocks) */
    const void *pool;          /* the paged pool, block 0 at pool */
    float k_scale, v_scale;    /* per-tensor FP8 mode */
    const float *v_head_scales;/* [Hkv]; per-token-head FP8 mode */
    float sm_scale;            /* softmax scale, usually 1/sqrt(head_dim) */
    void *out;                 /* bf16 [num_requests][q_len][Hq][head_dim] */
    float *lse;                /* [num_requests][q_len][Hq] base 2; NULL: not written */
} tkvk_decode_args;

/* Tiles: every (request, KV head) pair is cut into tiles of this many tokens. */
#define TKVK_DECODE_TILE_TOKENS 64

/* One work descriptor of the task map: tiles [tile_begin, tile_end) of one (request, KV head). */
typedef struct tkvk_decode_task {
    int32_t request;
    int32_t kv_head;
    int32_t tile_begin;
    int32_t tile_end;
} tkvk_decode_task;

/* The task map of one step (host form; the device keeps the same arrays in the plan).
 * The tiles of all pairs, in (request, head) order, form one sequence of num_tiles tiles; it
 * is cut into bins of tiles_per_cta tiles; every (pair, bin) intersection is one task, so
 * the tasks of bin i are tasks[bin_first[i] .. bin_first[i+1]) and those of pair p are
 * tasks[pair_first[p] .. pair_first[p] + pair_count[p]). tiles_per_cta =
 * max(ceil(num_tiles / grid), min_tiles_per_cta): the floor keeps small batches from being cut
 * into pieces whose merge costs more than it saves.
 *
 * Slots: where the warp-worker kernel leaves each task's partial result. Its ceil(grid /
 * cta_warps) CTAs of cta_warps warps share the bins in order, the first num_bins % CTAs of
 * them one bin more than the others (so that few bins still reach every SM; bins_per_cta is
 * the most a CTA takes). When every CTA takes 4 or more, a run of consecutive bins of one CTA
 * that lie whole inside one pair (one task each) is merged in the CTA into one slot; every
 * other task has a slot of its own. A pair's slots are slot_first[p] .. + slot_count[p], task
 * i's is task_slot[i]. With one warp per CTA the slots are the task indices. */
typedef struct tkvk_decode_map {
    int num_pairs, grid, num_bins, num_tiles, num_tasks, tiles_per_cta;
    int bins_per_cta, num_slots;
    tkvk_decode_task *tasks; /* capacity num_pairs + grid */
    int32_t *task_slot;      /* capacity num_pairs + grid */
    int32_t *bin_first;      /* [grid + 1] */
    int32_t *pair_first;     /* [num_pairs] */
    int32_t *pair_count;     /* [num_pairs] */
    int32_t *slot_first;     /* [num_pairs] */
    int32_t *slot_count;     /* [num_pairs] */
} tkvk_decode_map;

/* Allocates the arrays of *map for up to num_pairs pairs and a grid of `grid` CTAs;
 * TKVK_EINVAL when a count is < 1 or the allocation fails. Free with tkvk_decode_map_free()
 * (also safe on a zeroed or already freed map). */
int tkvk_decode_map_init(tkvk_decode_map *map, int num_pairs, int grid);
void tkvk_decode_map_free(tkvk_decode_map *map);

/* The planner, on the host (the same map as the device plan kernel; tests compare them).
 * cta_warps >= 1 (see the slots above; 1 for the CTA kernel). */
int tkvk_decode_plan_cpu(const int32_t *kv_lens, int num_requests, int num_kv_heads, int grid,
                         int min_tiles_per_cta, int cta_warps, tkvk_decode_map *map);

/* Reference decode attention: plain float math, one pass per (request, KV head). */
int tkvk_decode_cpu(const tkvk_decode_args *a);

/* The same result through the split path: plan (grid, floor), partial O + LSE per task,
 * combine. Tests use it to check the split/merge arithmetic on the CPU. */
int tkvk_decode_split_cpu(const tkvk_decode_args *a, int grid, int min_tiles_per_cta);

/* Merge two (O, LSE) sets of the same rows: O bf16 [num_rows][head_dim], LSE base 2
 * [num_rows]. A set whose LSE is -inf (no keys) contributes nothing; two -inf give O = 0,
 * LSE = -inf. out/out_lse may alias either input. */
int tkvk_merge_states_cpu(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                          const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                          float *out_lse);

/* ---- GPU: the plan handle ---------------------------------------------------------------
 * A tkvk_decode_plan owns the device task map and the partial-result workspace for steps of
 * up to max_requests requests with num_kv_heads KV heads, max_rows query rows per
 * (request, KV head) (= group * q_len) and head_dim. Its grid is sized to the device
 * (SM count x resident CTAs). One plan serves one stream at a time (not thread-safe); the
 * task map written by tkvk_decode_plan_cuda() is reused by every layer of the step. */
typedef struct tkvk_decode_plan tkvk_decode_plan;

int tkvk_decode_plan_create(tkvk_decode_plan **out, int max_requests, int num_kv_heads,
                            int max_rows, int head_dim);
void tkvk_decode_plan_destroy(tkvk_decode_plan *plan);
/* The persistent grid (workers: one warp each in the warp-worker kernel, one CTA each in the
 * CTA kernel), the warps per CTA (the warp-worker kernel's, else 1) and the floor (tiles per
 * worker) the plan kernel uses. With 17..32 rows, a step whose bins fill at most half the
 * grid has each bin worked by two warps, rows 0..15 and 16.. (the task map is the same). */
int tkvk_decode_plan_grid(const tkvk_decode_plan *plan);
int tkvk_decode_plan_cta_warps(const tkvk_decode_plan *plan);
int tkvk_decode_plan_min_tiles(const tkvk_decode_plan *plan);
/* Overrides the floor (>= 1); the default is ceil(rows / 16) tiles (64 tokens each) per worker
 * for the warp-worker kernel, 4 for the CTA kernel. */
int tkvk_decode_plan_set_min_tiles(tkvk_decode_plan *plan, int min_tiles_per_cta);

/* Plan kernel: reads kv_lens (device) and writes the task map on the device; no host round
 * trip, capturable in a CUDA graph. num_requests <= max_requests. */
int tkvk_decode_plan_cuda(tkvk_decode_plan *plan, const int32_t *kv_lens, int num_requests,
                          void *stream);
/* Copies the device task map into *map (synchronises the stream), for tests. */
int tkvk_decode_plan_download(tkvk_decode_plan *plan, tkvk_decode_map *map, void *stream);

/* Persistent attention over the task map + combine into a->out / a->lse. a->kv_lens and
 * a->num_requests must be those given to the last tkvk_decode_plan_cuda() on this stream.
 * Block ids outside [0, num_blocks) are not dereferenced: their tokens read as zeros (the
 * GPU cannot refuse them after launch; the daemon validates tables before). */
int tkvk_decode_attend_cuda(tkvk_decode_plan *plan, const tkvk_decode_args *a, void *stream);

/* tkvk_merge_states_cpu() on the device. */
int tkvk_merge_states_cuda(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                           const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                           float *out_lse, void *stream);

/* ============================================================================================
 * Block copy for tier moves (kernels/blockcopy.c, kernels/blockcopy.cu)
 * ========================================================================================== */
/* Copies num_blocks scattered blocks: dst_base + dst_offsets[i] <- src_base + src_offsets[i],
 * block_bytes each (a tier move is one contiguous copy per block). Blocks must not overlap.
 * Offsets are host arrays. Returns TKVK_EINVAL for NULL bases/offsets with num_blocks > 0. */
int tkvk_blockcopy_cpu(void *dst_base, const void *src_base, const uint64_t *dst_offsets,
                       const uint64_t *src_offsets, size_t num_blocks, size_t block_bytes);

/* The same between device memory and pinned host memory, in either direction, on `stream`
 * (asynchronous: the copy is done when the stream reaches this point).
 *   DMA:    the copy engines, one batched call (cudaMemcpyBatchAsync). Offsets are host arrays
 *           and may be reused as soon as the call returns. Best for large blocks (>= 256 KiB):
 *           it runs at the PCIe copy rate and leaves the SMs free.
 *   KERNEL: a gather/scatter kernel reading/writing mapped pinned memory over PCIe; offsets
 *           must be readable by the device (device memory or pinned host memory) until the
 *           copy completes. Best for many small blocks, where per-copy set-up dominates.
 *   AUTO:   DMA for block_bytes >= 256 KiB, else KERNEL (offsets then as for KERNEL). */
enum { TKVK_COPY_AUTO = 0, TKVK_COPY_DMA = 1, TKVK_COPY_KERNEL = 2 };
int tkvk_blockcopy_cuda(void *dst_base, const void *src_base, const uint64_t *dst_offsets,
                        const uint64_t *src_offsets, size_t num_blocks, size_t block_bytes,
                        int method, void *stream);

/* Pins [p, p + bytes) for DMA (cudaHostRegister, mapped + portable) in chunks of about 1 GiB,
 * so pools of hundreds of GiB register; on failure nothing stays registered. One copy must not
 * span two registrations (the driver refuses it), so each chunk is a whole number of
 * unit_bytes (the pool's slot stride; 0 = no constraint): a block never straddles chunks.
 * tkvk_host_unregister undoes it (same p, bytes and unit). TKVK_ENODEV without CUDA. */
int tkvk_host_register(void *p, size_t bytes, size_t unit_bytes);
int tkvk_host_unregister(void *p, size_t bytes, size_t unit_bytes);

#ifdef __cplusplus
}
#endif
#endif
