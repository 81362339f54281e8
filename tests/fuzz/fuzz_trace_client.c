/* fuzz_trace_client.c - the trace parser of tkv-replay (client/tkv_replay.c) on arbitrary
 * files, reached by including the source with its main renamed. */
#define main tkv_replay_main
#include "../../client/tkv_replay.c"
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
    memset(&t, 0, sizeof(t));
    trace_load(fuzz_as_file(data, n), 4096, &t);
    trace_free(&t); /* on a refusal too: the tool exits then, the harness goes on */
    mute(false);
    return 0;
}
