/* gpu.c - the L1 pool in HBM and its copy engine (see tkvd_gpu.h).
 *
 * The pool is one cudaMalloc allocation per L1 region (the store's; one per tenant, region 0
 * for blocks of no tenant or tenants without one): CUDA IPC exports a whole allocation by its
 * base pointer, so a client given one region's handle can reach that region's bytes and no
 * others. Sizes are 2 MiB multiples, so the mapping granularity wastes nothing on the
 * importer's side. Pool offsets (what the store hands out) are base[r] + index_in_region *
 * block_bytes, with base[r] the sum of the sizes of the regions before r; a client is told
 * offsets relative to its region (the daemon subtracts base[r]).
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
#define kNumStreams 8

typedef struct l1_region {
    uint64_t first_slot, num_slots;
    uint64_t base;            /* pool offset of its first byte */
    uint64_t bytes;           /* its allocation's size (0: an empty region, no allocation) */
    char *ptr;
    cudaIpcMemHandle_t handle;
} l1_region;

struct tkvd_gpu {
    int device;
    size_t block_bytes;
    uint64_t num_blocks;
    unsigned num_regions;
    l1_region regions[TKVD_GPU_MAX_REGIONS];
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

/* One pinned copy of 256 MiB up: the rate the cost check quotes (into the largest region). */
static double probe_h2d(tkvd_gpu *g)
{
    const l1_region *big = NULL;
    for (unsigned r = 0; r < g->num_regions; r++)
        if (g->regions[r].bytes && (!big || g->regions[r].bytes > big->bytes))
            big = &g->regions[r];
    uint64_t bytes = g->l2_probe_bytes < (256ull << 20) ? g->l2_probe_bytes : (256ull << 20);
    if (!big)
        return 0;
    if (bytes > big->bytes)
        bytes = big->bytes;
    if (bytes == 0)
        return 0;
    cudaEvent_t a, b;
    float ms = 0;
    if (cudaEventCreate(&a) != cudaSuccess)
        return 0;
    if (cudaEventCreate(&b) != cudaSuccess) {
        cudaEventDestroy(a);
        return 0;
    }
    cudaMemcpyAsync(big->ptr, g->l2_base, bytes, cudaMemcpyHostToDevice, g->streams[0]);
    cudaEventRecord(a, g->streams[0]);
    cudaMemcpyAsync(big->ptr, g->l2_base, bytes, cudaMemcpyHostToDevice, g->streams[0]);
    cudaEventRecord(b, g->streams[0]);
    if (cudaEventSynchronize(b) == cudaSuccess)
        cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms > 0 ? (double)bytes / 1e9 / (ms / 1e3) : 0;
}

int tkvd_gpu_open(int ordinal, size_t block_bytes, tkvd_gpu **out)
{
    *out = NULL;
    if (block_bytes == 0)
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
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if ((e = cudaSetDevice(ordinal)) != cudaSuccess) {
        rc = cuda_fail("cudaSetDevice", e);
        goto fail;
    }
    cudaDeviceGetPCIBusId(g->pci_bus_id, sizeof(g->pci_bus_id), ordinal);
    for (int i = 0; i < kNumStreams; i++)
        if ((e = cudaStreamCreateWithFlags(&g->streams[i], cudaStreamNonBlocking)) != cudaSuccess) {
            rc = cuda_fail("cudaStreamCreate", e);
            goto fail;
        }
    *out = g;
    return TKV_OK;
fail:
    tkvd_gpu_close(g);
    return rc;
}

int tkvd_gpu_alloc_l1(tkvd_gpu *g, const uint64_t *first_slot, const uint64_t *num_slots,
                      unsigned num_regions)
{
    if (!g || g->num_regions || !first_slot || !num_slots || num_regions == 0 ||
        num_regions > TKVD_GPU_MAX_REGIONS)
        return TKV_EINVAL;
    uint64_t next_slot = 0, base = 0;
    for (unsigned r = 0; r < num_regions; r++) { /* back to back, as the store lays them out */
        if (first_slot[r] != next_slot || num_slots[r] > (1ull << 40) / g->block_bytes)
            return TKV_EINVAL;
        next_slot += num_slots[r];
    }
    cudaSetDevice(g->device);
    int rc = TKV_OK;
    for (unsigned r = 0; r < num_regions; r++) {
        l1_region *R = &g->regions[r];
        R->first_slot = first_slot[r];
        R->num_slots = num_slots[r];
        R->base = base;
        R->bytes = round_up(num_slots[r] * g->block_bytes, kChunkAlign);
        g->num_regions = r + 1; /* what close frees */
        if (!R->bytes)
            continue;
        cudaError_t e = cudaMalloc((void **)&R->ptr, R->bytes);
        if (e != cudaSuccess) {
            R->ptr = NULL;
            rc = cuda_fail("cudaMalloc(L1 region)", e);
            goto fail;
        }
        if ((e = cudaIpcGetMemHandle(&R->handle, R->ptr)) != cudaSuccess) {
            rc = cuda_fail("cudaIpcGetMemHandle", e);
            goto fail;
        }
        base += R->bytes;
    }
    g->num_blocks = next_slot;
    TKV_LOG(TKV_LOG_INFO, "gpu: L1 pool %llu blocks in %u region(s), %llu MiB, on %s",
            (unsigned long long)g->num_blocks, num_regions, (unsigned long long)(base >> 20),
            g->pci_bus_id);
    return TKV_OK;
fail:
    for (unsigned r = 0; r < g->num_regions; r++) {
        if (g->regions[r].ptr)
            cudaFree(g->regions[r].ptr);
        memset(&g->regions[r], 0, sizeof(g->regions[r]));
    }
    g->num_regions = 0;
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
    for (unsigned r = 0; r < g->num_regions; r++)
        if (g->regions[r].ptr)
            cudaFree(g->regions[r].ptr);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

uint64_t tkvd_gpu_l1_blocks(const tkvd_gpu *g) { return g ? g->num_blocks : 0; }
double tkvd_gpu_h2d_gbps(const tkvd_gpu *g) { return g ? g->h2d_gbps : 0; }

unsigned tkvd_gpu_num_regions(const tkvd_gpu *g) { return g ? g->num_regions : 0; }

int tkvd_gpu_region(const tkvd_gpu *g, unsigned r, uint64_t *base, uint64_t *bytes)
{
    if (!g || r >= g->num_regions)
        return TKV_EINVAL;
    if (base)
        *base = g->regions[r].base;
    if (bytes)
        *bytes = g->regions[r].bytes;
    return TKV_OK;
}

int tkvd_gpu_attach_info(const tkvd_gpu *g, unsigned r, tkv_attach_gpu *out)
{
    memset(out, 0, sizeof(*out));
    if (!g || r >= g->num_regions || !g->regions[r].bytes)
        return TKV_EINVAL;
    const l1_region *R = &g->regions[r];
    out->magic = TKV_ATTACH_MAGIC;
    out->num_chunks = 1;
    out->chunk_bytes = R->bytes;
    out->l1_bytes = R->bytes;
    memcpy(out->pci_bus_id, g->pci_bus_id, sizeof(out->pci_bus_id));
    memcpy(out->handles[0], &R->handle, sizeof(R->handle));
    return TKV_OK;
}

/* ---- the store's backend ---------------------------------------------------------------- */

/* The region holding slot (the store never names a slot outside every region). */
static const l1_region *region_of_slot(const tkvd_gpu *g, uint64_t slot)
{
    for (unsigned r = 0; r < g->num_regions; r++) {
        const l1_region *R = &g->regions[r];
        if (slot >= R->first_slot && slot - R->first_slot < R->num_slots)
            return R;
    }
    TKV_ASSERT(!"L1 slot outside every region");
    return NULL;
}

static uint64_t l1_offset(void *ctx, uint64_t slot)
{
    const tkvd_gpu *g = ctx;
    const l1_region *R = region_of_slot(g, slot);
    return R->base + (slot - R->first_slot) * g->block_bytes;
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

/* Blocks of one batch may span regions (a lease of blocks of no tenant and of its own), so the
 * copy is issued per region run: each run is one batched DMA call from the L2 base into that
 * region's allocation (or back). */
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
        const l1_region *R = region_of_slot(g, l1_slots[i]);
        size_t j = i;
        for (; j < n && l1_slots[j] >= R->first_slot && l1_slots[j] - R->first_slot < R->num_slots;
             j++)
            l1_off[j] = (l1_slots[j] - R->first_slot) * g->block_bytes;
        int krc = up ? tkvk_blockcopy_cuda(R->ptr, g->l2_base, l1_off + i,
                                           l2_offsets + i, j - i, g->block_bytes,
                                           TKVK_COPY_DMA, g->streams[si])
                     : tkvk_blockcopy_cuda(g->l2_base, R->ptr, l2_offsets + i,
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

int tkvd_gpu_open(int ordinal, size_t block_bytes, tkvd_gpu **out)
{
    *out = NULL;
    TKV_LOG(TKV_LOG_INFO, "gpu: built without CUDA: L1 off");
    return TKV_EUNSUPPORTED;
}

int tkvd_gpu_alloc_l1(tkvd_gpu *g, const uint64_t *first_slot, const uint64_t *num_slots,
                      unsigned num_regions)
{
    return TKV_EUNSUPPORTED;
}
unsigned tkvd_gpu_num_regions(const tkvd_gpu *g) { return 0; }
int tkvd_gpu_region(const tkvd_gpu *g, unsigned r, uint64_t *base, uint64_t *bytes)
{
    return TKV_EINVAL;
}

int tkvd_gpu_pin_l2(tkvd_gpu *g, void *l2_base, uint64_t l2_bytes, const uint64_t *region_bytes,
                    unsigned num_regions, size_t slot_stride)
{
    return TKV_EUNSUPPORTED;
}
void tkvd_gpu_close(tkvd_gpu *g) { free(g); }
uint64_t tkvd_gpu_l1_blocks(const tkvd_gpu *g) { return 0; }
double tkvd_gpu_h2d_gbps(const tkvd_gpu *g) { return 0; }
int tkvd_gpu_attach_info(const tkvd_gpu *g, unsigned r, tkv_attach_gpu *out)
{
    memset(out, 0, sizeof(*out));
    return TKV_EINVAL;
}

static uint64_t l1_offset(void *ctx, uint64_t slot) { return TKV_NO_OFFSET; }
static int l1_copy(void *ctx, const uint64_t *a, const uint64_t *b, size_t n)
{
    return TKV_EUNSUPPORTED;
}
const tkv_l1_ops tkvd_gpu_l1_ops = {.offset = l1_offset, .promote = l1_copy, .demote = l1_copy};

#endif
