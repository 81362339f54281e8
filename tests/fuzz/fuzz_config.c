/* fuzz_config.c - tierkvd's config file parser and whole-config checks (daemon/config.c,
 * daemon/tenant.c) on arbitrary files: every input is accepted or refused with a message,
 * never a crash, a leak or undefined behaviour. */
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
    int rc = tkvd_config_load(&c, fuzz_as_file(data, n), err, sizeof(err));
    if (rc == TKV_OK) {
        rc = tkvd_config_finish(&c, err, sizeof(err));
        if (rc == TKV_OK) {
            FILE *f = fopen("/dev/null", "w");
            tkvd_config_print(&c, f);
            fclose(f);
        }
    }
    /* A refusal always says why. */
    if (rc != TKV_OK && !err[0])
        abort();
    tkvd_config_free(&c);
    return 0;
}
