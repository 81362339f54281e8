/* tkvd_cost.h - the cost check: is bringing a cached prefix to where the engine needs it
 * faster than recomputing it? Pure arithmetic over block locations and measured rates.
 */
#ifndef TKVD_COST_H
#define TKVD_COST_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_store.h"

typedef struct tkvd_rates {
    double pcie_gbps;     /* host -> GPU copy rate measured at start (0: no GPU tier) */
    double l3_read_gbps;  /* local-store read rate (config estimate, refined by measurement) */
} tkvd_rates;

typedef struct tkvd_cost {
    double restore_ms;    /* +inf when a block cannot get there (a rate is 0) */
    uint32_t in_tier, from_l2, from_l3;
    double pcie_gbps, l3_read_gbps;
} tkvd_cost;

/* Estimate for having the n blocks of locs in tier (TKV_TIER_L1 or TKV_TIER_L2): blocks only
 * in L3 are read (l3 rate) and, for L1, all blocks not in L1 cross PCIe (pcie rate). The two
 * stages are added, not overlapped, so the estimate errs towards recomputing. */
tkvd_cost tkvd_cost_estimate(const tkvd_rates *r, const tkv_block_loc *locs, size_t n, int tier,
                             size_t block_bytes);

#endif
