/* tkv_csum.h - the per-block payload checksum (internal).
 *
 * A 64-bit non-cryptographic hash, ~1 byte/cycle per lane with four independent lanes, so a
 * 4 MiB block costs well under a millisecond. Each lane step (xor in a word, multiply by an odd
 * constant, fold the high half down) is a bijection of the lane for a fixed input word, so a
 * change confined to one word can never cancel inside its lane; lanes and length are mixed at
 * the end. It guards against torn writes, bit rot and stray writes into pool slots, not
 * against an adversary (keys are SHA-256 for that).
 */
#ifndef TKV_CSUM_H
#define TKV_CSUM_H

#include <stddef.h>
#include <stdint.h>

uint64_t tkv_csum64(const void *data, size_t len);

/* Copies len bytes src -> dst (not overlapping) and returns tkv_csum64(src, len): one read
 * of the source instead of two, for the put path. */
uint64_t tkv_csum64_copy(void *dst, const void *src, size_t len);

/* The same sum taken piecewise, for bytes that arrive in parts (a value read from a socket is
 * summed right after each read, while it is still in cache):
 *   tkv_csum64_state st; tkv_csum64_begin(&st);
 *   p += tkv_csum64_update(&st, p, n);   (any number of times)
 *   sum = tkv_csum64_end(&st, p, rest);
 * update takes the largest multiple of 32 bytes of what it is given and returns how many it
 * took; the caller hands the rest in again (with what follows) or to end, which takes any
 * length. The result equals tkv_csum64 of all the bytes in order. */
typedef struct tkv_csum64_state {
    uint64_t lane[4];
    uint64_t bytes; /* taken so far */
} tkv_csum64_state;

void tkv_csum64_begin(tkv_csum64_state *st);
size_t tkv_csum64_update(tkv_csum64_state *st, const void *data, size_t len);
uint64_t tkv_csum64_end(tkv_csum64_state *st, const void *rest, size_t len);

#endif
