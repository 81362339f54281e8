/* decode_warp.cu - the warp-worker kernel of decode attention, the fast path (FP8 Q over FP8
 * KV, up to 32 rows a pair): every warp drains its own bin through a two-stage ring of 32-token
 * chunks; a CTA's warps whose bins share a slot merge their partials at the end. Its arithmetic
 * is a policy: WarpMathT (at most 8 rows, on the mma's N side) or WarpMathM16 (one or two
 * m-tiles). docs/design.md, decode, "Warp-worker kernel". */
#include "decode_warp.cuh"

namespace tkvk_dec {

AttendVariant dec_warp_variant(int head_dim, int rows, int which)
{
    return warp_variant_of<false>(head_dim, rows, which);
}

} /* namespace tkvk_dec */
