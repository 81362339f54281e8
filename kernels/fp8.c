/* fp8.c - FP8 e4m3 ("e4m3fn") conversions on the CPU. The device twins in fp8.cuh run the
 * same integer algorithm, so the two agree bit for bit on every float (gpu_test_fp8 checks
 * all 2^32 inputs on an H200 machine). */
#include <math.h>
#include <string.h>

#include "tkv_kernels.h"

uint8_t tkvk_fp8_from_float(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t mag = u & 0x7fffffffu;

    if (mag > 0x7f800000u)
        return 0x7f; /* NaN, whatever its sign or payload */
    if (mag >= 0x43e00000u)
        return (uint8_t)(sign | 0x7eu); /* >= 448 (and infinity) saturates to 448 */
    if (mag < 0x3c800000u) {
        /* Below 2^-6, the smallest normal: e4m3 subnormals are k * 2^-9, k = 0..7 (k = 8 is
         * the smallest normal, code 0x08, so the carry needs no special case). Scaling by 2^9
         * is exact for every float in this range; rintf rounds half to even in the default
         * rounding mode, which is the only one this library runs under. */
        float a;
        memcpy(&a, &mag, sizeof a);
        return (uint8_t)(sign | (uint32_t)rintf(a * 512.0f));
    }
    /* Normal range: keep 3 mantissa bits, rounding to nearest even on the 20 dropped bits.
     * A carry out of the mantissa lands in the exponent, which is what rounding wants.
     * Then rebias the exponent from 127 to 7. */
    mag += 0x7ffffu + ((mag >> 20) & 1u);
    return (uint8_t)(sign | ((mag >> 20) - ((127u - 7u) << 3)));
}

float tkvk_fp8_to_float(uint8_t v)
{
    uint32_t sign = (uint32_t)(v & 0x80u) << 24;
    uint32_t exp = (v >> 3) & 0xfu;
    uint32_t man = v & 0x7u;
    uint32_t u;
    if (exp == 0xfu && man == 0x7u) {
        u = sign | 0x7fc00000u; /* the e4m3fn NaN */
    } else if (exp == 0) {
        float a = (float)man * (1.0f / 512.0f); /* subnormal: man * 2^-9, exact */
        memcpy(&u, &a, sizeof u);
        u |= sign;
    } else {
        u = sign | ((exp + 127u - 7u) << 23) | (man << 20);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
