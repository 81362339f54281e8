/* fuzz_trace_bench.c - bench/trace_replay.c's trace parser (Mooncake JSON lines) on
 * arbitrary files, reached by including the source with its main renamed. */
#define main trace_replay_main
#include "../../bench/trace_replay.c"
#undef main

#include <fcntl.h>

#include "fuzz_util.h"

/* The parser reports bad lines on stderr, as it should; muted here so the fuzzer is not
 * bound by the terminal (a crash still leaves its input as an artifact). */
static int g_devnull = -1, g_stderr = -1;
static void mute(bool on)
{
    if (g_devnull < 0) {
        g_devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
        g_stderr = dup(2);
    }
    fflush(stderr);
    dup2(on ? g_devnull : g_stderr, 2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    trace t;
    mute(true);
    if (trace_load(fuzz_as_file(data, n), 4096, &t) == TKV_OK)
        trace_free(&t);
    mute(false);
    return 0;
}
