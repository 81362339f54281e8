/* fuzz_trace_client.c - the trace parser of tkv-replay (client/tkv_replay.c) on arbitrary
 * bytes (the stream reader its file loader uses), reached by including the source with its
 * main renamed. */
#define main tkv_replay_main
#include "../../client/tkv_replay.c"
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
    memset(&t, 0, sizeof(t));
    trace_read(in, "fuzz", 4096, &t);
    trace_free(&t); /* on a refusal too: the tool exits then, the harness goes on */
    mute(err);
    fclose(in);
    return 0;
}
