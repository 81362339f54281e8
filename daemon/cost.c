/* cost.c - the cost check (see tkvd_cost.h). */
#include "tkvd_cost.h"

#include <math.h>

static double ms_for(double bytes, double gbps)
{
    if (bytes == 0)
        return 0;
    return gbps > 0 ? bytes / (gbps * 1e9) * 1e3 : INFINITY;
}

tkvd_cost tkvd_cost_estimate(const tkvd_rates *r, const tkv_block_loc *locs, size_t n, int tier,
                             size_t block_bytes)
{
    tkvd_cost c = {.pcie_gbps = r->pcie_gbps, .l3_read_gbps = r->l3_read_gbps};
    for (size_t i = 0; i < n; i++) {
        const tkv_block_loc *l = &locs[i];
        if (tier == TKV_TIER_L1 ? l->in_l1 : (l->in_l1 || l->in_l2))
            c.in_tier++;
        else if (l->in_l2)
            c.from_l2++;
        else
            c.from_l3++;
    }
    double bb = (double)block_bytes;
    c.restore_ms = ms_for(c.from_l3 * bb, r->l3_read_gbps);
    if (tier == TKV_TIER_L1)
        c.restore_ms += ms_for((c.from_l2 + c.from_l3) * bb, r->pcie_gbps);
    return c;
}
