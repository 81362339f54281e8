/* gpu.c - the L1 pool in HBM and its copy engine (see tkvd_gpu.h).
 *
 * L1 offsets as clients see them are chunk * chunk_bytes + index_in_chunk * block_bytes:
 * chunks are separate cudaMalloc allocations (CUDA IPC exports whole allocations by their
 * base pointer), sized in 2 MiB multiples so the mapping granularity wastes nothing on the
 * importer's side.
 */
#include "tkvd_gpu.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"

#ifdef TKVK_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "tkv_kernels.h"

#define kChunkAlign (2ull << 20)
/* One allocation as long as the device grants it: kernels address a pool by one base
 * pointer and block ids, so a single chunk lets a block table mix any blocks. */
#define kMaxChunkBytes (1ull << 40)
#define kNumStreams 8

struct tkvd_gpu {
    int device;
    size_t block_bytes;
    uint64_t num_blocks, blocks_per_chunk, chunk_bytes;
    uint32_t num_chunks;
    char *chunks[TKV_ATTACH_MAX_CHUNKS];
    cudaIpcMemHandle_t handles[TKV_ATTACH_MAX_CHUNKS];
    char pci_bus_id[32];
    char *l2_base;
    uint64_t l2_bytes;
    size_t l2_stride;   /* registration chunks hold whole slots */
    uint64_t *l2_regions; /* bytes of each L2 region (a memfd mapping each), back to back */
    unsigned num_l2_regions;
    uint64_t l2_probe_bytes; /* the first region's: the rate probe stays in one registration */
    bool l2_pinned;
    double h2d_gbps;

    pthread_mutex_t mu; /* guards the stream pool */
    pthread_cond_t cv;
    cudaStream_t streams[kNumStreams];
    bool busy[kNumStreams];
};

static int cuda_fail(const char *what, cudaError_t e)
{
    TKV_LOG(TKV_LOG_WARN, "gpu: %s: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? TKV_ENOMEM : TKV_EUNSUPPORTED;
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* One pinned copy of 256 MiB up: the rate the cost check quotes. */
static double probe_h2d(tkvd_gpu *g)
{
    uint64_t bytes = g->l2_probe_bytes < (256ull << 20) ? g->l2_probe_bytes : (256ull << 20);
    uint64_t l1 = (uint64_t)g->num_blocks * g->block_bytes;
    if (bytes > g->chunk_bytes)
        bytes = g->chunk_bytes;
    if (bytes == 0 || l1 == 0)
        return 0;
    cudaEvent_t a, b;
    float ms = 0;
    if (cudaEventCreate(&a) != cudaSuccess)
        return 0;
    if (cudaEventCreate(&b) != cudaSuccess) {
        cudaEventDestroy(a);
        return 0;
    }
    cudaMemcpyAsync(g->chunks[0], g->l2_base, bytes, cudaMemcpyHostToDevice, g->streams[0]);
    cudaEventRecord(a, g->streams[0]);
    cudaMemcpyAsync(g->chunks[0], g->l2_base, bytes, cudaMemcpyHostToDevice, g->streams[0]);
    cudaEventRecord(b, g->streams[0]);
    if (cudaEventSynchronize(b) == cudaSuccess)
        cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms > 0 ? (double)bytes / 1e9 / (ms / 1e3) : 0;
}

int tkvd_gpu_open(int ordinal, uint64_t num_blocks, size_t block_bytes, tkvd_gpu **out)
{
    *out = NULL;
    if (num_blocks == 0 || block_bytes == 0)
        return TKV_EINVAL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        TKV_LOG(TKV_LOG_INFO, "gpu: no usable GPU (%s): L1 off",
                e != cudaSuccess ? cudaGetErrorString(e) : "no device");
        return TKV_EUNSUPPORTED;
    }
    if (ordinal < 0 || ordinal >= count) {
        TKV_LOG(TKV_LOG_ERROR, "gpu: device %d does not exist (%d present)", ordinal, count);
        return TKV_EINVAL;
    }
    tkvd_gpu *g = tkv_xcalloc(1, sizeof(*g));
    int rc = TKV_OK;
    g->device = ordinal;
    g->block_bytes = block_bytes;
    g->num_blocks = num_blocks;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if ((e = cudaSetDevice(ordinal)) != cudaSuccess) {
        rc = cuda_fail("cudaSetDevice", e);
        goto fail;
    }
    cudaDeviceGetPCIBusId(g->pci_bus_id, sizeof(g->pci_bus_id), ordinal);

    /* Chunk: the largest 2 MiB multiple under kMaxChunkBytes that holds whole blocks, but no
     * larger than the pool needs. */
    uint64_t per_chunk = kMaxChunkBytes / block_bytes;
    if (per_chunk == 0) {
        rc = TKV_EINVAL;
        goto fail;
    }
    if (per_chunk > num_blocks)
        per_chunk = num_blocks;
    g->num_chunks = (uint32_t)((num_blocks + per_chunk - 1) / per_chunk);
    if (g->num_chunks > TKV_ATTACH_MAX_CHUNKS) {
        TKV_LOG(TKV_LOG_ERROR, "gpu: %llu L1 blocks need more than %d chunks",
                (unsigned long long)num_blocks, TKV_ATTACH_MAX_CHUNKS);
        rc = TKV_EINVAL;
        goto fail;
    }
    g->blocks_per_chunk = per_chunk;
    g->chunk_bytes = round_up(per_chunk * block_bytes, kChunkAlign);
    for (uint32_t i = 0; i < g->num_chunks; i++) {
        if ((e = cudaMalloc((void **)&g->chunks[i], g->chunk_bytes)) != cudaSuccess) {
            rc = cuda_fail("cudaMalloc(L1 chunk)", e);
            goto fail;
        }
        if ((e = cudaIpcGetMemHandle(&g->handles[i], g->chunks[i])) != cudaSuccess) {
            rc = cuda_fail("cudaIpcGetMemHandle", e);
            goto fail;
        }
    }
    for (int i = 0; i < kNumStreams; i++)
        if ((e = cudaStreamCreateWithFlags(&g->streams[i], cudaStreamNonBlocking)) != cudaSuccess) {
            rc = cuda_fail("cudaStreamCreate", e);
            goto fail;
        }
    TKV_LOG(TKV_LOG_INFO, "gpu: L1 pool %llu blocks in %u chunk(s) of %llu MiB on %s",
            (unsigned long long)num_blocks, g->num_chunks,
            (unsigned long long)(g->chunk_bytes >> 20), g->pci_bus_id);
    *out = g;
    return TKV_OK;
fail:
    tkvd_gpu_close(g);
    return rc;
}

/* Unregisters the first n regions of the L2 pool. */
static void unpin_regions(tkvd_gpu *g, unsigned n)
{
    uint64_t off = 0;
    for (unsigned r = 0; r < n; r++) {
        if (g->l2_regions[r])
            tkvk_host_unregister(g->l2_base + off, g->l2_regions[r], g->l2_stride);
        off += g->l2_regions[r];
    }
}

int tkvd_gpu_pin_l2(tkvd_gpu *g, void *l2_base, uint64_t l2_bytes, const uint64_t *region_bytes,
                    unsigned num_regions, size_t slot_stride)
{
    if (!g || !l2_base || l2_bytes == 0 || g->l2_pinned || !region_bytes || !num_regions)
        return TKV_EINVAL;
    uint64_t sum = 0;
    for (unsigned r = 0; r < num_regions; r++)
        sum += region_bytes[r];
    if (sum != l2_bytes)
        return TKV_EINVAL;
    cudaSetDevice(g->device);
    g->l2_base = l2_base;
    g->l2_stride = slot_stride;
    g->l2_regions = malloc(num_regions * sizeof(*g->l2_regions));
    if (!g->l2_regions)
        return TKV_ENOMEM;
    memcpy(g->l2_regions, region_bytes, num_regions * sizeof(*g->l2_regions));
    g->l2_probe_bytes = 0;
    uint64_t off = 0;
    for (unsigned r = 0; r < num_regions; r++) {
        if (region_bytes[r] && tkvk_host_register(g->l2_base + off, region_bytes[r],
                                                  slot_stride) != TKVK_OK) {
            TKV_LOG(TKV_LOG_WARN, "gpu: pinning L2 region %u: %s", r, tkvk_last_error());
            unpin_regions(g, r);
            free(g->l2_regions);
            g->l2_regions = NULL;
            return TKV_EUNSUPPORTED;
        }
        if (!g->l2_probe_bytes)
            g->l2_probe_bytes = region_bytes[r];
        off += region_bytes[r];
    }
    g->num_l2_regions = num_regions;
    g->l2_bytes = l2_bytes;
    g->l2_pinned = true;
    g->h2d_gbps = probe_h2d(g);
    TKV_LOG(TKV_LOG_INFO, "gpu: L2 pinned (%llu MiB); host-to-device %.1f GB/s",
            (unsigned long long)(l2_bytes >> 20), g->h2d_gbps);
    return TKV_OK;
}

void tkvd_gpu_close(tkvd_gpu *g)
{
    if (!g)
        return;
    if (g->l2_pinned)
        unpin_regions(g, g->num_l2_regions);
    free(g->l2_regions);
    for (int i = 0; i < kNumStreams; i++)
        if (g->streams[i])
            cudaStreamDestroy(g->streams[i]);
    for (uint32_t i = 0; i < g->num_chunks; i++)
        if (g->chunks[i])
            cudaFree(g->chunks[i]);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

uint64_t tkvd_gpu_l1_blocks(const tkvd_gpu *g) { return g ? g->num_blocks : 0; }
double tkvd_gpu_h2d_gbps(const tkvd_gpu *g) { return g ? g->h2d_gbps : 0; }

void tkvd_gpu_attach_info(const tkvd_gpu *g, tkv_attach_gpu *out)
{
    memset(out, 0, sizeof(*out));
    out->magic = TKV_ATTACH_MAGIC;
    out->num_chunks = g->num_chunks;
    out->chunk_bytes = g->chunk_bytes;
    out->l1_bytes = (uint64_t)g->num_chunks * g->chunk_bytes;
    memcpy(out->pci_bus_id, g->pci_bus_id, sizeof(out->pci_bus_id));
    for (uint32_t i = 0; i < g->num_chunks; i++)
        memcpy(out->handles[i], &g->handles[i], sizeof(g->handles[i]));
}

/* ---- the store's backend ---------------------------------------------------------------- */

static uint64_t l1_offset(void *ctx, uint64_t slot)
{
    const tkvd_gpu *g = ctx;
    return (slot / g->blocks_per_chunk) * g->chunk_bytes +
           (slot % g->blocks_per_chunk) * g->block_bytes;
}

static int take_stream(tkvd_gpu *g)
{
    pthread_mutex_lock(&g->mu);
    for (;;) {
        for (int i = 0; i < kNumStreams; i++)
            if (!g->busy[i]) {
                g->busy[i] = true;
                pthread_mutex_unlock(&g->mu);
                return i;
            }
        pthread_cond_wait(&g->cv, &g->mu);
    }
}

static void give_stream(tkvd_gpu *g, int i)
{
    pthread_mutex_lock(&g->mu);
    g->busy[i] = false;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Blocks of one batch may span chunks, so the copy is issued per chunk run: each run is one
 * batched DMA call from the L2 base into that chunk's base (or back). */
static int move(tkvd_gpu *g, bool up, const uint64_t *l1_slots, const uint64_t *l2_offsets,
                size_t n)
{
    if (n == 0)
        return TKV_OK;
    if (!g->l2_pinned)
        return TKV_EIO;
    int si = take_stream(g);
    int rc = TKV_OK;
    cudaSetDevice(g->device);
    uint64_t *l1_off = tkv_xmalloc(n * sizeof(uint64_t));
    size_t i = 0;
    while (i < n && rc == TKV_OK) {
        uint64_t chunk = l1_slots[i] / g->blocks_per_chunk;
        size_t j = i;
        for (; j < n && l1_slots[j] / g->blocks_per_chunk == chunk; j++)
            l1_off[j] = (l1_slots[j] % g->blocks_per_chunk) * g->block_bytes;
        int krc = up ? tkvk_blockcopy_cuda(g->chunks[chunk], g->l2_base, l1_off + i,
                                           l2_offsets + i, j - i, g->block_bytes,
                                           TKVK_COPY_DMA, g->streams[si])
                     : tkvk_blockcopy_cuda(g->l2_base, g->chunks[chunk], l2_offsets + i,
                                           l1_off + i, j - i, g->block_bytes, TKVK_COPY_DMA,
                                           g->streams[si]);
        if (krc != TKVK_OK) {
            TKV_LOG(TKV_LOG_ERROR, "gpu: %s copy: %s", up ? "promotion" : "demotion",
                    tkvk_last_error());
            rc = TKV_EIO;
        }
        i = j;
    }
    cudaError_t e = cudaStreamSynchronize(g->streams[si]);
    if (e != cudaSuccess && rc == TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "gpu: copy: %s", cudaGetErrorString(e));
        rc = TKV_EIO;
    }
    free(l1_off);
    give_stream(g, si);
    return rc;
}

static int l1_promote(void *ctx, const uint64_t *l1_slots, const uint64_t *l2_offsets, size_t n)
{
    return move(ctx, true, l1_slots, l2_offsets, n);
}

static int l1_demote(void *ctx, const uint64_t *l2_offsets, const uint64_t *l1_slots, size_t n)
{
    return move(ctx, false, l1_slots, l2_offsets, n);
}

const tkv_l1_ops tkvd_gpu_l1_ops = {
    .offset = l1_offset,
    .promote = l1_promote,
    .demote = l1_demote,
};

#else /* no CUDA in this build */

struct tkvd_gpu {
    int unused;
};

int tkvd_gpu_open(int ordinal, uint64_t num_blocks, size_t block_bytes, tkvd_gpu **out)
{
    *out = NULL;
    TKV_LOG(TKV_LOG_INFO, "gpu: built without CUDA: L1 off");
    return TKV_EUNSUPPORTED;
}

int tkvd_gpu_pin_l2(tkvd_gpu *g, void *l2_base, uint64_t l2_bytes, const uint64_t *region_bytes,
                    unsigned num_regions, size_t slot_stride)
{
    return TKV_EUNSUPPORTED;
}
void tkvd_gpu_close(tkvd_gpu *g) { free(g); }
uint64_t tkvd_gpu_l1_blocks(const tkvd_gpu *g) { return 0; }
double tkvd_gpu_h2d_gbps(const tkvd_gpu *g) { return 0; }
void tkvd_gpu_attach_info(const tkvd_gpu *g, tkv_attach_gpu *out) { memset(out, 0, sizeof(*out)); }

static uint64_t l1_offset(void *ctx, uint64_t slot) { return TKV_NO_OFFSET; }
static int l1_copy(void *ctx, const uint64_t *a, const uint64_t *b, size_t n)
{
    return TKV_EUNSUPPORTED;
}
const tkv_l1_ops tkvd_gpu_l1_ops = {.offset = l1_offset, .promote = l1_copy, .demote = l1_copy};

#endif
