/* crash_payload.h - the blocks the crash test's child writes: each is a pure function of its
 * id (length, bytes, key), so the parent can check any block it finds without being told. */
#ifndef CRASH_PAYLOAD_H
#define CRASH_PAYLOAD_H

#include "l3_testutil.h"

#define CRASH_MAX_BLOCK (24 * 1024)
#define CRASH_IDS_PER_ROUND 100000u

enum { CRASH_MSG_DURABLE = 'P', CRASH_MSG_DELETING = 'D' };

/* Rounds cycle through the ways in: the whole store (tkv_store_put + flush, blocks of one
 * fixed size as the store requires), then L3 directly with pread/pwrite, then L3 directly
 * with io_uring (varied sizes, deletes and compactions). */
enum { CRASH_VIA_STORE = 0, CRASH_VIA_L3_PSYNC = 1, CRASH_VIA_L3_URING = 2 };
static inline int crash_round_via(uint64_t round) { return (int)(round % 3); }

static inline size_t crash_len(uint64_t id)
{
    if (crash_round_via(id / CRASH_IDS_PER_ROUND) == CRASH_VIA_STORE)
        return CRASH_MAX_BLOCK;
    return 1000 + (size_t)(tu_mix(id) % 20000);
}

/* First 8 bytes: the id; then random bytes, or compressible ones for every third id. */
static inline void crash_fill(void *dst, uint64_t id)
{
    size_t n = crash_len(id);
    if (id % 3 == 0)
        tu_fill_compressible(dst, n, id);
    else
        tu_fill_random(dst, n, id);
    memcpy(dst, &id, 8);
}

static inline void crash_key(tkv_key *k, uint64_t id) { tu_key(k, 7, id); }

#endif
