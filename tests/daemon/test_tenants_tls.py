#!/usr/bin/python3
"""test_tenants_tls.py - tenants of TCP peers on the real tierkvd: with tls_client_ca the TLS
handshake refuses a client without a certificate, or with one the CA did not sign (even one
that copies a tenant's subject); a verified certificate's subject names its tenant; a bearer
token (`authorization: Bearer ...`, configured as its SHA-256) names another, and a wrong one is
PERMISSION_DENIED. Certificates are made at test time with the openssl CLI (exit 77 without).

usage: test_tenants_tls.py PATH-TO-TIERKVD PROTO-DIR
"""
import hashlib
import os
import shutil
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd_harness import SKIP, Harness, check, expect_status, grpc, main_wrapper, payload  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def run():
    if not shutil.which("openssl"):
        print("skipped: no openssl CLI to make test certificates")
        sys.exit(SKIP)
    h = Harness(sys.argv[1], sys.argv[2])
    pb = h.pb
    t = h.top
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=tierkv-test-ca", "-keyout",
            f"{t}/ca.key", "-out", f"{t}/ca.pem")
    ext = f"{t}/san.ext"
    open(ext, "w").write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, subj in (("server", "/CN=localhost"), ("client", "/CN=team-c/O=tierkv-test")):
        openssl("req", *ec, "-subj", subj, "-keyout", f"{t}/{name}.key", "-out", f"{t}/{name}.csr")
        openssl("x509", "-req", "-in", f"{t}/{name}.csr", "-CA", f"{t}/ca.pem", "-CAkey",
                f"{t}/ca.key", "-CAcreateserial", "-days", "1", "-extfile", ext, "-out",
                f"{t}/{name}.pem")
    # a certificate with the same subject that the CA never signed
    openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=team-c/O=tierkv-test", "-keyout",
            f"{t}/rogue.key", "-out", f"{t}/rogue.pem")

    token_d = "d-secret-token-0123456789"
    conf = f"{t}/tenants.conf"
    with open(conf, "w") as f:
        f.write('tenant.c.tls_subject = "O=tierkv-test,CN=team-c"\n'
                f"tenant.d.token_sha256 = {hashlib.sha256(token_d.encode()).hexdigest()}\n"
                "tenant.ops.uid = 0\n")
    port = free_port()
    d = h.daemon("mtls", ["--config", conf, "--grpc-tcp", f"127.0.0.1:{port}",
                          "--tls-cert", f"{t}/server.pem", "--tls-key", f"{t}/server.key",
                          "--tls-client-ca", f"{t}/ca.pem", "--no-http"]).start()
    ca = open(f"{t}/ca.pem", "rb").read()
    opts = [("grpc.ssl_target_name_override", "localhost")]

    def channel(cert=None, key=None):
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=open(key, "rb").read() if key else None,
            certificate_chain=open(cert, "rb").read() if cert else None)
        return grpc.secure_channel(f"127.0.0.1:{port}", creds, options=opts)

    fp = d.stub.Stats(pb.StatsRequest(), timeout=5).geometry.fingerprint
    bb = d.stub.Stats(pb.StatsRequest(), timeout=5).geometry.block_bytes
    P = 64
    tokens = [(11 * i + 5) % 40000 for i in range(2 * P)]

    def scope(ns=""):
        return pb.BlockScope(namespace=ns, fingerprint=fp)

    with channel(f"{t}/client.pem", f"{t}/client.key") as ch:
        s = h.pbg.CacheStub(ch)
        r = s.Put(pb.PutRequest(scope=scope(), tokens=tokens, blocks=[payload(5, i, bb) for i in range(2)]),
                  timeout=10)
        check(r.num_stored == 2, f"tenant c put: {r}")
        r = s.Lookup(pb.LookupRequest(scope=scope("c"), tokens=tokens), timeout=5)
        check(r.num_hit_blocks == 2, f"tenant c lookup: {r}")
        expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope("d"), tokens=tokens), timeout=5),
                      grpc.StatusCode.PERMISSION_DENIED, "tenant 'c'", "tenant c names d")
        # the token takes precedence over the certificate: tenant d sees nothing of c's
        md = [("authorization", f"Bearer {token_d}")]
        r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=5, metadata=md)
        check(r.num_hit_blocks == 0, f"tenant d saw tenant c's prefix: {r}")
        expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=5,
                                       metadata=[("authorization", "Bearer wrong")]),
                      grpc.StatusCode.PERMISSION_DENIED, "bearer token matches none", "wrong token")
    print("verified certificate -> tenant c; bearer token -> tenant d; wrong token refused")

    for what, cert, key in (("no client certificate", None, None),
                            ("a certificate the CA did not sign", f"{t}/rogue.pem", f"{t}/rogue.key")):
        with channel(cert, key) as ch:
            try:
                h.pbg.CacheStub(ch).Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=3)
                check(False, f"a client with {what} was served")
            except grpc.RpcError as e:
                check(e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
                      f"{what}: {e.code()} {e.details()}")
        print(f"  ok  refused in the handshake: {what}")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    main_wrapper(run)
