/* fuzz_config.c - tierkvd's config file parser and whole-config checks (daemon/config.c,
 * daemon/tenant.c) on arbitrary bytes, through tkvd_config_read (the reader tkvd_config_load
 * uses on a file): every input is accepted or refused with a message, never a crash, a leak
 * or undefined behaviour. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tkv_base.h"
#include "tkvd_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    tkv_log_level = -1; /* refusals are the expected outcome: no log lines */
    tkvd_config c;
    tkvd_config_init(&c);
    char err[TKVD_ERR_LEN];
    err[0] = 0;
    FILE *in = fuzz_as_stream(data, n);
    int rc = tkvd_config_read(&c, in, "fuzz.conf", err, sizeof(err));
    fclose(in);
    if (rc == TKV_OK) {
        rc = tkvd_config_finish(&c, err, sizeof(err));
        if (rc == TKV_OK) {
            static FILE *null; /* opened once: no system calls per input but the parse's */
            if (!null && !(null = fopen("/dev/null", "w")))
                abort();
            tkvd_config_print(&c, null);
        }
    }
    /* A refusal always says why. */
    if (rc != TKV_OK && !err[0])
        abort();
    tkvd_config_free(&c);
    return 0;
}
