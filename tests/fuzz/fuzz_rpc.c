/* fuzz_rpc.c - every unary tierkv.v1.Cache request, decoded and validated by its real handler
 * (daemon/service.c, through the method table and the tenant gate) against a real store: any
 * bytes get a gRPC status, never a crash, a leak or undefined behaviour; with tenants, a call
 * is refused or acts as its tenant.
 *
 * Input: byte 0 picks the method, byte 1 the caller (0: a daemon without tenants; 1: tenant
 * a's uid; 2: tenant b's uid; 3: a uid that is no tenant; 4: a bearer token), the rest is the
 * request message, run through tkvd_service_dispatch (the one handler table every transport
 * uses). Streaming methods (Verify) are left out: they need a live call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_store.h"
#include "tkvd_config.h"
#include "tkvd_metrics.h"
#include "tkvd_service.h"

static tkv_store *g_store;
static tkvd_config g_cfg_plain, g_cfg_ten;
static tkvd_metrics g_metrics;
static tkvd_service g_plain, g_ten;

static void setup_cfg(tkvd_config *c, bool tenants)
{
    char err[TKVD_ERR_LEN];
    tkvd_config_init(c);
    int rc = tkvd_config_set(c, "run_dir", "/tmp", "fuzz", err, sizeof(err)) |
             tkvd_config_set(c, "l2_blocks", "64", "fuzz", err, sizeof(err)) |
             tkvd_config_set(c, "max_prompt_tokens", "8192", "fuzz", err, sizeof(err)) |
             tkvd_config_set(c, "l3", "off", "fuzz", err, sizeof(err)) |
             tkvd_config_set(c, "foreground", "on", "fuzz", err, sizeof(err));
    if (tenants)
        rc |= tkvd_config_set(c, "tenant.a.uid", "61001", "fuzz", err, sizeof(err)) |
              tkvd_config_set(c, "tenant.b.uid", "61002", "fuzz", err, sizeof(err)) |
              tkvd_config_set(c, "tenant.b.admin", "on", "fuzz", err, sizeof(err)) |
              tkvd_config_set(c, "tenant.t.token_sha256",
                              "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                              "fuzz", err, sizeof(err)); /* sha256("test") */
    rc |= tkvd_config_finish(c, err, sizeof(err));
    if (rc != TKV_OK)
        abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    tkv_log_level = -1;
    setup_cfg(&g_cfg_plain, false);
    setup_cfg(&g_cfg_ten, true);
    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, g_cfg_plain.block_bytes, g_cfg_plain.geometry.block_tokens);
    tkv_store_opts_set_fingerprint(o, g_cfg_plain.fingerprint);
    tkv_store_opts_set_l2_blocks(o, 64);
    tkv_store_opts_set_workers(o, 1);
    /* Short leases: the fuzzer makes millions, and expired ones are reaped. */
    tkv_store_opts_set_lease_ttl_ms(o, 1, 5);
    if (tkv_store_open(o, &g_store) != TKV_OK)
        abort();
    tkv_store_opts_free(o);
    tkvd_metrics_init(&g_metrics);
    tkvd_service *svcs[2] = {&g_plain, &g_ten};
    for (int i = 0; i < 2; i++) {
        memset(svcs[i], 0, sizeof(*svcs[i]));
        svcs[i]->store = g_store;
        svcs[i]->cfg = i ? &g_cfg_ten : &g_cfg_plain;
        svcs[i]->metrics = &g_metrics;
        svcs[i]->version = "fuzz";
        svcs[i]->rates.pcie_gbps = 20;
        svcs[i]->rates.l3_read_gbps = 2;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (n < 2)
        return 0;
    size_t num_methods;
    const tkvd_method *methods = tkvd_service_methods(&num_methods);
    int method = (int)(data[0] % num_methods);
    if (!methods[method].unary)
        return 0;
    unsigned who = data[1] % 5;
    tkvd_service *svc = who == 0 ? &g_plain : &g_ten;
    tkvd_call k;
    memset(&k, 0, sizeof(k));
    k.timeout_ms = 0;
    k.peer.kind = who == 4 ? TKVD_PEER_GRPC_TCP : TKVD_PEER_GRPC_UNIX;
    if (who >= 1 && who <= 3) {
        k.peer.has_cred = true;
        k.peer.uid = k.peer.gid = who == 1 ? 61001 : who == 2 ? 61002 : 61003;
        k.peer.pid = 1;
    } else if (who == 4) {
        snprintf(k.peer.token, sizeof(k.peer.token), "Bearer test");
    }
    uint8_t *rsp = NULL;
    size_t rsp_len = 0;
    tkvd_service_dispatch(svc, &k, method, data + 2, n - 2, &rsp, &rsp_len);
    /* A refusal has a message; an answer is a reply buffer. */
    if (k.code != GRPC_STATUS_OK && !k.msg[0])
        abort();
    if (k.code == GRPC_STATUS_OK && !rsp)
        abort();
    /* With tenants every call but Health acts as a tenant or is refused. */
    if (who && k.code == GRPC_STATUS_OK && !k.tenant &&
        strcmp(methods[method].path, "/tierkv.v1.Cache/Health") != 0)
        abort();
    free(rsp);
    return 0;
}
