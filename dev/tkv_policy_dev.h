/* tkv_policy_dev.h - policies under study, not registered in the store (dev/README.md). */
#ifndef TKV_POLICY_DEV_H
#define TKV_POLICY_DEV_H

#include "tkv_policy.h"

/* "tierkv": prefix-aware rules (recency plus earned life, dead suffixes, learned admission of
 * first turns, ghost history); dev/policy_tierkv.c. The store's default before hazard. */
extern const tkv_policy_ops tkv_policy_tierkv;

#endif
