/* fuzz_trace_bench.c - the bench's trace parser (bench/trace_load.c, Mooncake JSON lines) on
 * arbitrary bytes, through the stream reader its file loader uses. */
#define main trace_replay_main
#include "../../bench/trace_replay.c"
#undef main

#include "fuzz_util.h"

/* The parser reports bad lines on stderr, as it should; here its stderr is /dev/null, by
 * swapping the stream it writes to (no system call per input). Sanitizer reports and
 * libFuzzer's own output go to descriptor 2 and libFuzzer's stream, which are untouched. */
static FILE *mute(FILE *to)
{
    static FILE *null;
    if (!null && !(null = fopen("/dev/null", "w")))
        abort();
    FILE *was = stderr;
    stderr = to ? to : null;
    return was;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    trace t;
    FILE *in = fuzz_as_stream(data, n), *err = mute(NULL);
    if (trace_read(in, "fuzz", 4096, &t) == TKV_OK)
        trace_free(&t);
    mute(err);
    fclose(in);
    return 0;
}
