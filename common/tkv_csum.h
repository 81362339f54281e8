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

#endif
