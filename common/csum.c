/* csum.c - the block checksum (see tkv_csum.h). */
#include "tkv_csum.h"

#include <string.h>

#define K_LANE 0xD6E8FEB86659FD93ull   /* odd: multiplication is invertible mod 2^64 */
#define K_MIX1 0xBF58476D1CE4E5B9ull
#define K_MIX2 0x94D049BB133111EBull

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only matter for cross-host L3; same host here */
    return v;
}

static inline uint64_t lane_step(uint64_t acc, uint64_t v)
{
    acc ^= v;
    acc *= K_LANE;
    return acc ^ (acc >> 32);
}

static inline uint64_t fmix(uint64_t x)
{
    x ^= x >> 30;
    x *= K_MIX1;
    x ^= x >> 27;
    x *= K_MIX2;
    return x ^ (x >> 31);
}

static uint64_t finish(uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, const uint8_t *p,
                       size_t n, size_t len);

#define SEED0 0x243F6A8885A308D3ull
#define SEED1 0x13198A2E03707344ull
#define SEED2 0xA4093822299F31D0ull
#define SEED3 0x082EFA98EC4E6C89ull

/* The 32-byte steps over p[0..n - n % 32); returns the bytes taken. */
static inline size_t absorb(uint64_t *a, const uint8_t *p, size_t n)
{
    uint64_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    size_t left = n;
    while (left >= 32) {
        a0 = lane_step(a0, load64(p));
        a1 = lane_step(a1, load64(p + 8));
        a2 = lane_step(a2, load64(p + 16));
        a3 = lane_step(a3, load64(p + 24));
        p += 32;
        left -= 32;
    }
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
    return n - left;
}

uint64_t tkv_csum64(const void *data, size_t len)
{
    uint64_t a[4] = {SEED0, SEED1, SEED2, SEED3};
    size_t took = absorb(a, data, len);
    return finish(a[0], a[1], a[2], a[3], (const uint8_t *)data + took, len - took, len);
}

void tkv_csum64_begin(tkv_csum64_state *st)
{
    st->lane[0] = SEED0;
    st->lane[1] = SEED1;
    st->lane[2] = SEED2;
    st->lane[3] = SEED3;
    st->bytes = 0;
}

size_t tkv_csum64_update(tkv_csum64_state *st, const void *data, size_t len)
{
    size_t took = absorb(st->lane, data, len);
    st->bytes += took;
    return took;
}

uint64_t tkv_csum64_end(tkv_csum64_state *st, const void *rest, size_t len)
{
    size_t took = absorb(st->lane, rest, len);
    uint64_t total = st->bytes + len;
    return finish(st->lane[0], st->lane[1], st->lane[2], st->lane[3],
                  (const uint8_t *)rest + took, len - took, (size_t)total);
}

uint64_t tkv_csum64_copy(void *dst, const void *src, size_t len)
{
    const uint8_t *p = src;
    uint8_t *d = dst;
    uint64_t a0 = SEED0, a1 = SEED1, a2 = SEED2, a3 = SEED3;
    size_t n = len;
    while (n >= 32) {
        uint64_t v0 = load64(p), v1 = load64(p + 8), v2 = load64(p + 16), v3 = load64(p + 24);
        memcpy(d, &v0, 8);
        memcpy(d + 8, &v1, 8);
        memcpy(d + 16, &v2, 8);
        memcpy(d + 24, &v3, 8);
        a0 = lane_step(a0, v0);
        a1 = lane_step(a1, v1);
        a2 = lane_step(a2, v2);
        a3 = lane_step(a3, v3);
        p += 32;
        d += 32;
        n -= 32;
    }
    memcpy(d, p, n);
    return finish(a0, a1, a2, a3, p, n, len);
}

/* The < 32-byte tail and the final mix, shared by both entry points. */
static uint64_t finish(uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, const uint8_t *p,
                       size_t n, size_t len)
{
    while (n >= 8) {
        a0 = lane_step(a0, load64(p));
        p += 8;
        n -= 8;
    }
    if (n) {
        uint8_t tail[8] = {0};
        memcpy(tail, p, n);
        a1 = lane_step(a1, load64(tail) ^ ((uint64_t)n << 56));
    }
    uint64_t h = fmix(a0) ^ fmix(a1 + 0x9E3779B97F4A7C15ull);
    h = fmix(h ^ fmix(a2) ^ (fmix(a3) << 1 | fmix(a3) >> 63));
    return fmix(h ^ (uint64_t)len);
}
