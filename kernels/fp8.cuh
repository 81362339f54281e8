/* fp8.cuh - device FP8 e4m3 ("e4m3fn") and bf16 helpers, bit-identical to the CPU functions
 * tkvk_fp8_from_float()/tkvk_fp8_to_float() and tkvk_bf16_*() of tkv_kernels.h.
 *
 * Two encoders:
 *   tkvk_fp8_from_float_exact()  the CPU algorithm (integer ops), written again for the device;
 *   tkvk_fp8x2_from_float2()     Hopper's cvt.rn.satfinite.e4m3x2.f32: two floats per
 *   tkvk_fp8x4_from_float4()     instruction. It rounds to nearest even and saturates to
 *                                +-448 like the CPU one; the only case it may encode
 *                                differently is NaN, which is forced to 0x7f here.
 * gpu_test_fp8 proves the two equal on all 2^32 float inputs, and the exact one equal to the
 * CPU function on all 2^32 inputs, so kernels use the fast one.
 */
#ifndef TKVK_FP8_CUH
#define TKVK_FP8_CUH

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

static __device__ __forceinline__ uint8_t tkvk_fp8_from_float_exact(float x)
{
    uint32_t u = __float_as_uint(x);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u)
        return 0x7f;
    if (mag >= 0x43e00000u)
        return (uint8_t)(sign | 0x7eu);
    if (mag < 0x3c800000u) {
        /* __fmul_rn: never contracted; rintf = round half to even, as on the CPU. */
        return (uint8_t)(sign | (uint32_t)rintf(__fmul_rn(__uint_as_float(mag), 512.0f)));
    }
    mag += 0x7ffffu + ((mag >> 20) & 1u);
    return (uint8_t)(sign | ((mag >> 20) - ((127u - 7u) << 3)));
}

/* NaN must encode as 0x7f whatever its sign. cvt...satfinite turns NaN into one of the two
 * NaN codes, and 0xff (negative NaN) is never the code of a number (the most negative is 0xfe,
 * -448), so clearing bit 7 of every byte equal to 0xff is the whole fix-up: bytes whose low 7
 * bits are all ones get a carry into bit 7 from +1, which marks them, without crossing bytes.
 * One AND, one ADD, one AND-NOT per four codes instead of a compare and select per code. */
static __device__ __forceinline__ uint32_t tkvk_fp8__nan_fix4(uint32_t w)
{
    uint32_t marks = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    return w & ~marks;
}

/* Two floats -> two e4m3 codes, lo in bits 0..7 and hi in bits 8..15. */
static __device__ __forceinline__ uint16_t tkvk_fp8x2_from_float2(float lo, float hi)
{
    uint16_t r;
    /* PTX packs the first source operand into the upper byte. */
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (uint16_t)tkvk_fp8__nan_fix4(r);
}

/* Four floats -> four codes in one 32-bit word, element 0 in the lowest byte (memory order). */
static __device__ __forceinline__ uint32_t tkvk_fp8x4_from_float4(float a, float b, float c,
                                                                  float d)
{
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return tkvk_fp8__nan_fix4((uint32_t)lo | ((uint32_t)hi << 16));
}

static __device__ __forceinline__ float tkvk_fp8_to_float_dev(uint8_t v)
{
    uint32_t sign = (uint32_t)(v & 0x80u) << 24;
    uint32_t exp = (v >> 3) & 0xfu;
    uint32_t man = v & 0x7u;
    if (exp == 0xfu && man == 0x7u)
        return __uint_as_float(sign | 0x7fc00000u);
    if (exp == 0)
        return __uint_as_float(__float_as_uint(__fmul_rn((float)man, 1.0f / 512.0f)) | sign);
    return __uint_as_float(sign | ((exp + 127u - 7u) << 23) | (man << 20));
}

/* Two codes -> two floats through Hopper's cvt to f16x2 (exact: every e4m3 value is an f16
 * value) and f16 -> f32 (exact). Code 0x7f/0xff gives NaN, as the CPU decoder does. */
static __device__ __forceinline__ float2 tkvk_fp8x2_to_float2(uint16_t v)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    return __half22float2(*reinterpret_cast<__half2 *>(&h));
}

/* bf16 <-> float, same rounding (nearest even) as tkvk_bf16_from_float(). For NaN the payload
 * may differ from the CPU's; both stay NaN. */
static __device__ __forceinline__ float tkvk_bf16_to_float_dev(uint16_t v)
{
    return __uint_as_float((uint32_t)v << 16);
}

static __device__ __forceinline__ uint16_t tkvk_bf16_from_float_dev(float x)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/* Two floats -> packed bf16x2 (lo in bits 0..15), one cvt.rn.bf16x2.f32. */
static __device__ __forceinline__ uint32_t tkvk_bf16x2_from_float2(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

#endif
