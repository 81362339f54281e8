/* tier_bench - tier moves between host memory (L2) and HBM (L1), on an H200 machine.
 *
 * In one run:
 *   - the PCIe ceiling: one large cudaMemcpy each way between pinned host memory and HBM;
 *   - promotion (L2 -> L1) and demotion (L1 -> L2) of 1,000 scattered blocks of 4 MiB and of
 *     64 KiB, with both copy engines of tkvk_blockcopy_cuda (DMA batch and gather kernel);
 *   - the time to bring a 32K-token prefix of a 32-layer, 8-KV-head, head-dim-128 FP8 model
 *     (512 blocks of 64 tokens, 4 MiB each) into L1 from L2, and from L3 (the project's store
 *     on the local disk, O_DIRECT reads overlapped with the host-to-device copies).
 * The host pool is a memfd mapping registered in chunks, as the daemon's L2 pool is.
 * Prints a table; --json prints one object.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_kernels.h"
#include "tkv_l3.h"

#define CK(call)                                                                             \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "tier_bench: %s: %s (%s:%d)\n", #call, cudaGetErrorString(e_),   \
                    __FILE__, __LINE__);                                                     \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)
#define KK(call)                                                                             \
    do {                                                                                     \
        int r_ = (call);                                                                     \
        if (r_ != TKVK_OK) {                                                                 \
            fprintf(stderr, "tier_bench: %s: %s\n", #call, tkvk_last_error());               \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

enum { kReps = 7, kNumBlocks = 1000, kPrefixBlocks = 512 };
static const size_t kBigBlock = 4u << 20, kSmallBlock = 64u << 10;

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof(float), cmp_f);
    return v[n / 2];
}

/* Host memory the way L2 has it: a shared memfd mapping, pinned in chunks. */
static void *host_pool(size_t bytes, size_t unit)
{
    int fd = memfd_create("tier_bench", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        perror("memfd");
        exit(1);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    KK(tkvk_host_register(p, bytes, unit));
    return p;
}

static void free_host_pool(void *p, size_t bytes, size_t unit)
{
    tkvk_host_unregister(p, bytes, unit);
    munmap(p, bytes);
}

static void fill_random(void *p, size_t bytes, uint64_t seed)
{
    uint64_t *w = p, x = seed | 1;
    for (size_t i = 0; i < bytes / 8; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        w[i] = x;
    }
}

/* Random distinct slots out of num_slots (scattered, in random order). */
static void scatter_offsets(uint64_t *off, size_t n, size_t num_slots, size_t block_bytes,
                            uint64_t seed)
{
    size_t *perm = tkv_xmalloc(num_slots * sizeof(size_t));
    for (size_t i = 0; i < num_slots; i++)
        perm[i] = i;
    uint64_t x = seed | 1;
    for (size_t i = num_slots - 1; i > 0; i--) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        size_t j = (size_t)(x % (i + 1));
        size_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    for (size_t i = 0; i < n; i++)
        off[i] = (uint64_t)perm[i] * block_bytes;
    free(perm);
}

static float time_copy(cudaStream_t st, void *dst, const void *src, const uint64_t *doff,
                       const uint64_t *soff, size_t n, size_t bb, int method)
{
    cudaEvent_t a, b;
    float t[kReps];
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    KK(tkvk_blockcopy_cuda(dst, src, doff, soff, n, bb, method, st)); /* warm-up */
    for (int r = 0; r < kReps; r++) {
        CK(cudaEventRecord(a, st));
        KK(tkvk_blockcopy_cuda(dst, src, doff, soff, n, bb, method, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t[r], a, b));
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return median(t, kReps);
}

typedef struct move_result {
    double promote_gbps[3], demote_gbps[3]; /* indexed by TKVK_COPY_DMA / _KERNEL */
    int bit_exact;
} move_result;

/* 1,000 scattered blocks each way, both engines, and a bit-exact check of one round trip. */
static move_result bench_moves(cudaStream_t st, size_t bb)
{
    move_result r = {{0}, {0}, 1};
    size_t slots = 2 * kNumBlocks, bytes = slots * bb;
    char *host = host_pool(bytes, bb), *dev;
    CK(cudaMalloc((void **)&dev, bytes));
    fill_random(host, bytes, 42 + bb);
    uint64_t *hoff, *doff; /* pinned, so the gather kernel can read them */
    CK(cudaHostAlloc((void **)&hoff, kNumBlocks * sizeof(uint64_t), cudaHostAllocMapped));
    CK(cudaHostAlloc((void **)&doff, kNumBlocks * sizeof(uint64_t), cudaHostAllocMapped));
    scatter_offsets(hoff, kNumBlocks, slots, bb, 7);
    scatter_offsets(doff, kNumBlocks, slots, bb, 11);
    double gb = (double)kNumBlocks * (double)bb / 1e9;
    for (int m = TKVK_COPY_DMA; m <= TKVK_COPY_KERNEL; m++) {
        float up = time_copy(st, dev, host, doff, hoff, kNumBlocks, bb, m);
        float down = time_copy(st, host, dev, hoff, doff, kNumBlocks, bb, m);
        r.promote_gbps[m] = gb / (up / 1e3);
        r.demote_gbps[m] = gb / (down / 1e3);
    }
    /* Round trip check: promote, scribble on host, demote, compare with a saved copy. */
    char *saved = tkv_xmalloc(kNumBlocks * bb);
    for (size_t i = 0; i < kNumBlocks; i++)
        memcpy(saved + i * bb, host + hoff[i], bb);
    KK(tkvk_blockcopy_cuda(dev, host, doff, hoff, kNumBlocks, bb, TKVK_COPY_AUTO, st));
    CK(cudaStreamSynchronize(st));
    for (size_t i = 0; i < kNumBlocks; i++)
        memset(host + hoff[i], 0x5a, bb);
    KK(tkvk_blockcopy_cuda(host, dev, hoff, doff, kNumBlocks, bb, TKVK_COPY_AUTO, st));
    CK(cudaStreamSynchronize(st));
    for (size_t i = 0; i < kNumBlocks && r.bit_exact; i++)
        r.bit_exact = memcmp(saved + i * bb, host + hoff[i], bb) == 0;
    free(saved);
    CK(cudaFreeHost(hoff));
    CK(cudaFreeHost(doff));
    CK(cudaFree(dev));
    free_host_pool(host, bytes, bb);
    return r;
}

/* A 32K-token prefix (512 x 4 MiB) from L3 into L1: read batches of blocks with O_DIRECT into
 * one of two pinned staging areas while the previous batch is copied up. */
static double restore_from_l3(cudaStream_t st, const char *dir, char *dev, const uint64_t *doff)
{
    enum { kBatch = 32 };
    tkv_l3_opts *o = tkv_l3_opts_new();
    uint8_t fp[32];
    memset(fp, 0xb7, sizeof(fp));
    tkv_l3_opts_set_fingerprint(o, fp);
    tkv_l3_opts_set_zstd_level(o, 0); /* FP8 KV does not compress: measure the I/O path */
    tkv_l3_opts_set_max_block_bytes(o, kBigBlock);
    tkv_l3_opts_set_queue_depth(o, 64);
    tkv_l3 *l3 = NULL;
    int rc = tkv_l3_open(dir, o, &l3);
    tkv_l3_opts_free(o);
    if (rc != TKV_OK) {
        fprintf(stderr, "tier_bench: l3 open %s: %s\n", dir, tkv_strerror(rc));
        return -1;
    }
    size_t staging_bytes = 2 * kBatch * kBigBlock;
    char *staging = host_pool(staging_bytes, kBigBlock);
    tkv_key keys[kPrefixBlocks];
    uint32_t tokens[64] = {0};
    tkv_l3_put_req put[kBatch];
    for (int b0 = 0; b0 < kPrefixBlocks; b0 += kBatch) {
        for (int i = 0; i < kBatch; i++) {
            memset(&keys[b0 + i], 0, sizeof(tkv_key));
            memcpy(keys[b0 + i].b, &(uint32_t){(uint32_t)(b0 + i + 1)}, 4);
            fill_random(staging + (size_t)i * kBigBlock, kBigBlock, (uint64_t)(b0 + i) * 977);
            put[i] = (tkv_l3_put_req){.key = keys[b0 + i], .payload = staging + (size_t)i * kBigBlock,
                                      .len = kBigBlock, .tokens = tokens, .num_tokens = 64};
            if (b0 + i > 0)
                put[i].parent = keys[b0 + i - 1];
        }
        if (tkv_l3_put_batch(l3, put, kBatch) != TKV_OK) {
            fprintf(stderr, "tier_bench: l3 put failed\n");
            tkv_l3_close(l3);
            free_host_pool(staging, staging_bytes, kBigBlock);
            return -1;
        }
    }
    uint64_t soff[kBatch];
    for (int i = 0; i < kBatch; i++)
        soff[i] = (uint64_t)i * kBigBlock;
    float t[3];
    for (int rep = 0; rep < 3; rep++) {
        cudaEvent_t done[2];
        CK(cudaEventCreate(&done[0]));
        CK(cudaEventCreate(&done[1]));
        uint64_t t0 = tkv_now_ns();
        for (int b0 = 0, k = 0; b0 < kPrefixBlocks; b0 += kBatch, k ^= 1) {
            char *area = staging + (size_t)k * kBatch * kBigBlock;
            if (b0 >= 2 * kBatch)
                CK(cudaEventSynchronize(done[k])); /* its previous copy must have left */
            tkv_l3_get_req get[kBatch];
            for (int i = 0; i < kBatch; i++)
                get[i] = (tkv_l3_get_req){.key = keys[b0 + i], .dst = area + (size_t)i * kBigBlock,
                                          .cap = kBigBlock};
            if (tkv_l3_get_batch(l3, get, kBatch) != TKV_OK) {
                fprintf(stderr, "tier_bench: l3 get failed\n");
                exit(1);
            }
            KK(tkvk_blockcopy_cuda(dev, area, doff + b0, soff, kBatch, kBigBlock,
                                   TKVK_COPY_DMA, st));
            CK(cudaEventRecord(done[k], st));
        }
        CK(cudaStreamSynchronize(st));
        t[rep] = (float)((double)(tkv_now_ns() - t0) / 1e6);
        CK(cudaEventDestroy(done[0]));
        CK(cudaEventDestroy(done[1]));
    }
    tkv_l3_close(l3);
    free_host_pool(staging, staging_bytes, kBigBlock);
    return median(t, 3);
}

int main(int argc, char **argv)
{
    int json = 0;
    const char *l3dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (strcmp(argv[i], "--l3-dir") == 0 && i + 1 < argc)
            l3dir = argv[++i];
        else {
            fprintf(stderr, "usage: tier_bench [--json] [--l3-dir DIR]\n");
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "tier_bench: no GPU\n");
        return 77;
    }
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    /* ---- PCIe ceiling: one large copy each way ---- */
    size_t big = (size_t)4 << 30;
    /* The ceiling: one allocation pinned as a whole (a registered pool is pinned in chunks,
     * and one copy may not span two of them). */
    char *host, *dev;
    CK(cudaHostAlloc((void **)&host, big, cudaHostAllocDefault));
    CK(cudaMalloc((void **)&dev, big));
    fill_random(host, big, 3);
    float up[kReps], down[kReps];
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int r = 0; r < kReps; r++) {
        CK(cudaEventRecord(a, st));
        CK(cudaMemcpyAsync(dev, host, big, cudaMemcpyHostToDevice, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&up[r], a, b));
        CK(cudaEventRecord(a, st));
        CK(cudaMemcpyAsync(host, dev, big, cudaMemcpyDeviceToHost, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&down[r], a, b));
    }
    double h2d = (double)big / 1e9 / (median(up, kReps) / 1e3);
    double d2h = (double)big / 1e9 / (median(down, kReps) / 1e3);
    CK(cudaFree(dev));
    CK(cudaFreeHost(host));

    /* ---- scattered moves ---- */
    move_result m4 = bench_moves(st, kBigBlock);
    move_result m64 = bench_moves(st, kSmallBlock);

    /* ---- 32K-token prefix restore ---- */
    char *l1;
    size_t l1_bytes = 2 * kPrefixBlocks * kBigBlock;
    CK(cudaMalloc((void **)&l1, l1_bytes));
    uint64_t *doff, *hoff;
    CK(cudaHostAlloc((void **)&doff, kPrefixBlocks * sizeof(uint64_t), cudaHostAllocMapped));
    hoff = tkv_xmalloc(kPrefixBlocks * sizeof(uint64_t));
    scatter_offsets(doff, kPrefixBlocks, 2 * kPrefixBlocks, kBigBlock, 5);
    size_t l2_bytes = 2 * kPrefixBlocks * kBigBlock;
    char *l2 = host_pool(l2_bytes, kBigBlock);
    fill_random(l2, l2_bytes, 9);
    scatter_offsets(hoff, kPrefixBlocks, 2 * kPrefixBlocks, kBigBlock, 13);
    float l2ms = time_copy(st, l1, l2, doff, hoff, kPrefixBlocks, kBigBlock, TKVK_COPY_DMA);
    free_host_pool(l2, l2_bytes, kBigBlock);
    char tmpl[] = "/tmp/tier_bench.XXXXXX";
    const char *dir = l3dir;
    if (!dir)
        dir = mkdtemp(tmpl);
    double l3ms = dir ? restore_from_l3(st, dir, l1, doff) : -1;
    if (!l3dir && dir) {
        char cmd[256];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "tier_bench: could not remove %s\n", dir);
    }
    free(hoff);
    CK(cudaFreeHost(doff));
    CK(cudaFree(l1));

    double pcie = h2d < d2h ? h2d : d2h;
    double promote = m4.promote_gbps[TKVK_COPY_DMA] > m4.promote_gbps[TKVK_COPY_KERNEL]
                         ? m4.promote_gbps[TKVK_COPY_DMA] : m4.promote_gbps[TKVK_COPY_KERNEL];
    double demote = m4.demote_gbps[TKVK_COPY_DMA] > m4.demote_gbps[TKVK_COPY_KERNEL]
                        ? m4.demote_gbps[TKVK_COPY_DMA] : m4.demote_gbps[TKVK_COPY_KERNEL];
    if (json) {
        printf("{\"pcie_gbps\": %.2f, \"pcie_h2d_gbps\": %.2f, \"pcie_d2h_gbps\": %.2f, "
               "\"promote_gbps\": %.2f, \"demote_gbps\": %.2f, "
               "\"promote_ratio_pcie\": %.3f, \"demote_ratio_pcie\": %.3f, "
               "\"promote_4m_dma_gbps\": %.2f, \"promote_4m_kernel_gbps\": %.2f, "
               "\"demote_4m_dma_gbps\": %.2f, \"demote_4m_kernel_gbps\": %.2f, "
               "\"promote_64k_dma_gbps\": %.2f, \"promote_64k_kernel_gbps\": %.2f, "
               "\"demote_64k_dma_gbps\": %.2f, \"demote_64k_kernel_gbps\": %.2f, "
               "\"bit_exact\": %s, \"restore_32k_l2_ms\": %.2f, \"restore_32k_l3_ms\": %.2f}\n",
               pcie, h2d, d2h, promote, demote, promote / h2d, demote / d2h,
               m4.promote_gbps[1], m4.promote_gbps[2], m4.demote_gbps[1], m4.demote_gbps[2],
               m64.promote_gbps[1], m64.promote_gbps[2], m64.demote_gbps[1],
               m64.demote_gbps[2], m4.bit_exact && m64.bit_exact ? "true" : "false", l2ms,
               l3ms);
    }
    {
        FILE *t = json ? stderr : stdout; /* with --json the table still goes to the log */
        fprintf(t, "PCIe ceiling (one 4 GiB cudaMemcpy): H2D %.1f GB/s, D2H %.1f GB/s\n", h2d, d2h);
        fprintf(t, "%-28s %10s %10s %10s %10s\n", "1000 scattered blocks", "up DMA", "up kernel",
               "down DMA", "down kernel");
        fprintf(t, "%-28s %10.1f %10.1f %10.1f %10.1f  GB/s\n", "4 MiB blocks", m4.promote_gbps[1],
               m4.promote_gbps[2], m4.demote_gbps[1], m4.demote_gbps[2]);
        fprintf(t, "%-28s %10.1f %10.1f %10.1f %10.1f  GB/s\n", "64 KiB blocks",
               m64.promote_gbps[1], m64.promote_gbps[2], m64.demote_gbps[1],
               m64.demote_gbps[2]);
        fprintf(t, "best 4 MiB: promote %.2fx, demote %.2fx of the PCIe copy rate; round trip %s\n",
               promote / h2d, demote / d2h, m4.bit_exact && m64.bit_exact ? "bit-exact" : "CORRUPT");
        fprintf(t, "32K-token prefix (512 x 4 MiB) into L1: from L2 %.1f ms, from L3 %.1f ms\n", l2ms,
               l3ms);
    }
    CK(cudaStreamDestroy(st));
    return m4.bit_exact && m64.bit_exact ? 0 : 1;
}
