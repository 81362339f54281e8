/* tkvd_gpu.h - the daemon's GPU tier, device side: the L1 pool in HBM (exported to attached
 * engines by CUDA IPC), the L2 pool pinned for DMA, and the copy engine that moves blocks
 * between them for the store (tkv_l1_ops).
 *
 * Built always; without CUDA, or on a host without a usable GPU, tkvd_gpu_open answers
 * TKV_EUNSUPPORTED and the daemon serves L2 + L3 only.
 * Thread safety: the ops may be called from many store workers at once; each call takes its
 * own stream from a small pool, so concurrent promotions overlap on the copy engines.
 */
#ifndef TKVD_GPU_H
#define TKVD_GPU_H

#include <stdint.h>

#include "tkv_attach.h"
#include "tkv_store.h"

typedef struct tkvd_gpu tkvd_gpu;

/* The most L1 regions (the store's, tkv_store_l1_region_at: region 0 and one per tenant). */
#define TKVD_GPU_MAX_REGIONS 128

/* Opens device `ordinal` for L1 blocks of block_bytes (no memory yet: the store decides the
 * regions, tkvd_gpu_alloc_l1). Errors: TKV_EUNSUPPORTED (no CUDA or no device), TKV_EINVAL.
 * Logs why. */
int tkvd_gpu_open(int ordinal, size_t block_bytes, tkvd_gpu **out);
/* Allocates the L1 pool: one cudaMalloc allocation per region (its slots [first_slot[r],
 * first_slot[r] + num_slots[r]), back to back from 0 as the store lays them out), of a 2 MiB
 * multiple holding whole blocks; an empty region has none. Each is exported on its own, so a
 * client that opens one region's handle reaches no other region's bytes. Once, before the
 * first copy. TKV_ENOMEM (HBM short, nothing kept), TKV_EINVAL (a layout not back to back). */
int tkvd_gpu_alloc_l1(tkvd_gpu *g, const uint64_t *first_slot, const uint64_t *num_slots,
                      unsigned num_regions);
/* Pins the L2 pool [l2_base, l2_base + l2_bytes) for DMA: its num_regions regions of
 * region_bytes[r] each (0 allowed; they add up to l2_bytes), back to back, one memfd mapping
 * each, are registered one by one, each in chunks of whole slots of slot_stride bytes (one
 * copy may not span two registrations; a slot never spans two regions). Measures the
 * host-to-device rate. Must precede the first copy: the store is opened with the L1 ops
 * before its L2 pool exists, and no copy runs before the daemon serves. */
int tkvd_gpu_pin_l2(tkvd_gpu *g, void *l2_base, uint64_t l2_bytes, const uint64_t *region_bytes,
                    unsigned num_regions, size_t slot_stride);
/* Unpins L2 and frees L1; every copy must have returned. NULL is ignored. */
void tkvd_gpu_close(tkvd_gpu *g);

uint64_t tkvd_gpu_l1_blocks(const tkvd_gpu *g);
/* Regions after tkvd_gpu_alloc_l1 (0 before): region r's pool offset (what the store's
 * offsets count from: subtract it to get an offset within the region) and its bytes (0 when
 * empty). TKV_EINVAL for a bad r. */
unsigned tkvd_gpu_num_regions(const tkvd_gpu *g);
int tkvd_gpu_region(const tkvd_gpu *g, unsigned r, uint64_t *base, uint64_t *bytes);
/* The attach-socket message that lets a client map region r of the L1 pool, and only it: one
 * chunk, that region's handle and size. TKV_EINVAL (out zeroed) for an empty or bad region. */
int tkvd_gpu_attach_info(const tkvd_gpu *g, unsigned r, tkv_attach_gpu *out);
/* Host-to-device rate measured at open with one pinned copy (GB/s), for the cost check. */
double tkvd_gpu_h2d_gbps(const tkvd_gpu *g);

/* The store backend; its ctx is the tkvd_gpu. */
extern const tkv_l1_ops tkvd_gpu_l1_ops;

#endif
