/* decode_cta.cu - the CTA kernel of decode attention: a CTA streams its bin of 64-token tiles
 * (or one static split) through a cp.async pipeline, its warps taking m-tiles of the rows or
 * splitting a tile's tokens. Every shape the warp-worker kernel does not take: BF16 Q or KV,
 * more than 32 rows. docs/design.md, decode, "CTA kernel". */
#include "decode_cta.cuh"

namespace tkvk_dec {

AttendVariant dec_cta_variant(int head_dim, bool fp8, bool q8, bool wide)
{
    return cta_variant<false>(head_dim, fp8, q8, wide);
}

} /* namespace tkvk_dec */
