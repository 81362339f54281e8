#!/bin/sh
# abi_check.sh - libkvclient's ABI is what kvclient.h says and nothing more:
#   1. the shared object exports only kvc_* (nm -D; plus its version node);
#   2. kvclient.h compiles alone, with no include path but client/, as C11 (pedantic) and C++;
#   3. an install puts kvclient.h and no other header into include/, and a program built
#      against the installed header and library alone links and runs.
#
#   usage: abi_check.sh BUILD_DIR SOURCE_DIR CC "EXTRA_FLAGS"   (EXTRA_FLAGS: the sanitizers)
set -u
build=$1 src=$2 cc=$3 extra=${4:-}
lib=$build/client/libkvclient.so
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-abi.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

# ---- 1. exports -----------------------------------------------------------------------------
nm -D --defined-only "$lib" > "$tmp/syms" || { echo "FAIL nm on $lib"; exit 1; }
# a line is "ADDRESS TYPE NAME[@@VERSION]"; the version script's node (type A, KVCLIENT_*) is
# not code
awk '{ n = $3; sub(/@.*/, "", n) } !($2 == "A" && n ~ /^KVCLIENT_/) && n !~ /^kvc_/' \
    "$tmp/syms" > "$tmp/foreign"
if [ -s "$tmp/foreign" ]; then
    fail "libkvclient.so exports names outside kvc_*:"
    head -20 "$tmp/foreign"
fi
for s in kvc_connect kvc_store kvc_store_params_init kvc_attend kvc_attend_args_init \
         kvc_plan_create kvc_pool_layout kvc_merge kvc_get_scatter kvc_put_gather; do
    grep -Eq " $s(@|\$)" "$tmp/syms" || fail "libkvclient.so does not export $s"
done
n=$(grep -c ' kvc_' "$tmp/syms")
echo "exports: $n kvc_* symbols, $(wc -l < "$tmp/foreign") others"

# ---- 2. the header alone --------------------------------------------------------------------
cat > "$tmp/alone.c" <<'C'
#include "kvclient.h"
/* every engine-side type is complete (or an opaque handle) from this header alone */
int main(void)
{
    kvc_store_params p;
    kvc_attend_args a;
    kvc_layout l;
    kvc_plan *plan = 0;
    kvc_iov v[2] = {{0, 0}, {0, KVC_IOV_MAX}};
    (void)p; (void)a; (void)l; (void)plan; (void)v;
    return KVC_DTYPE_BF16 + KVC_ROPE_GPTJ + KVC_NORM_AFTER_ROPE + KVC_SCALE_PER_TOKEN_HEAD - 5;
}
C
$cc -std=c11 -pedantic -Wall -Wextra -Werror -I"$src/client" -c "$tmp/alone.c" \
    -o "$tmp/alone.o" || fail "kvclient.h does not compile alone as C11"
if command -v c++ > /dev/null 2>&1; then
    c++ -std=c++17 -Wall -Wextra -Werror -I"$src/client" -x c++ -fsyntax-only "$tmp/alone.c" ||
        fail "kvclient.h does not compile as C++"
fi

# ---- 3. installed: one header, and a program built against it ---------------------------------
cmake --install "$build" --prefix "$tmp/inst" > "$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; fail "cmake --install"; }
hdrs=$(cd "$tmp/inst/include" 2>/dev/null && find . -type f | sort | tr '\n' ' ')
[ "$hdrs" = "./kvclient.h " ] || fail "installed headers are '$hdrs', not kvclient.h alone"
ilib=$(find "$tmp/inst" -name libkvclient.so | head -1)
cat > "$tmp/engine.c" <<'C'
#include <stdio.h>
#include <string.h>
#include <kvclient.h>
#define CHECK(c) do { if (!(c)) { printf("FAIL %s (%s)\n", #c, kvc_last_error()); return 1; } } while (0)
int main(void)
{
    kvc_store_params p;
    CHECK(kvc_store_params_init(&p, sizeof p) == KVC_OK);
    CHECK(p.struct_size == sizeof p && p.k_scale == 1.0f && p.norm_eps > 0);
    CHECK(kvc_store_params_init(&p, sizeof p - 8) == KVC_EINVAL);
    kvc_attend_args a;
    CHECK(kvc_attend_args_init(&a, sizeof a) == KVC_OK && a.q_len == 1);
    CHECK(kvc_store(NULL, KVC_TIER_L2, &p, NULL) == KVC_EINVAL);
    CHECK(kvc_attend(NULL, KVC_TIER_L2, &a, NULL, NULL) == KVC_EINVAL);
    CHECK(kvc_plan_create(NULL, 1, 1, 1, NULL) == KVC_EINVAL);
    kvc_iov v = {0, 0};
    CHECK(kvc_get_scatter(NULL, NULL, 0, 1, &v, 1) == KVC_EINVAL);
    CHECK(kvc_put_gather(NULL, NULL, 0, 0, &v, 1, 1, NULL) == KVC_EINVAL);
    CHECK(strcmp(kvc_strerror(KVC_OK), "ok") == 0);
    return 0;
}
C
if [ -n "$ilib" ]; then
    ldir=$(dirname "$ilib")
    # shellcheck disable=SC2086 # extra holds several flags
    if $cc -std=c11 -Wall -Wextra -Werror $extra -I"$tmp/inst/include" "$tmp/engine.c" \
           -L"$ldir" -lkvclient -Wl,-rpath,"$ldir" -o "$tmp/engine"; then
        "$tmp/engine" || fail "a program against the installed libkvclient"
    else
        fail "a program does not build against the installed header and library"
    fi
else
    fail "no libkvclient.so in the install tree"
fi

[ "$fails" -eq 0 ] && echo "abi: ok" && exit 0
exit 1
