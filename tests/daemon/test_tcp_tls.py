#!/usr/bin/python3
"""test_tcp_tls.py - tierkvd's optional TCP listener with TLS: a client that trusts the
daemon's certificate is served over TCP; a plaintext client on the same port is not; the UNIX
socket keeps serving beside it. The certificate is made at test time with the openssl CLI
(exit 77 = skipped where it is missing).

usage: test_tcp_tls.py PATH-TO-TIERKVD PROTO-DIR
"""
import os
import shutil
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd_harness import SKIP, Harness, check, grpc, main_wrapper  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run():
    if not shutil.which("openssl"):
        print("skipped: no openssl CLI to make a test certificate")
        sys.exit(SKIP)
    h = Harness(sys.argv[1], sys.argv[2])
    pb = h.pb
    cert, key = os.path.join(h.top, "cert.pem"), os.path.join(h.top, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    port = free_port()
    d = h.daemon("tls", ["--grpc-tcp", f"127.0.0.1:{port}", "--tls-cert", cert, "--tls-key", key,
                         "--no-http"]).start()

    creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
    with grpc.secure_channel(f"127.0.0.1:{port}", creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        r = h.pbg.CacheStub(ch).Health(pb.HealthRequest(), timeout=10)
        check(r.status == "serving", f"TLS health: {r}")
        st = h.pbg.CacheStub(ch).Stats(pb.StatsRequest(), timeout=10)
        check(len(st.geometry.fingerprint) == 32, "TLS stats: no fingerprint")
    print(f"TLS on 127.0.0.1:{port} ok")

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            h.pbg.CacheStub(ch).Health(pb.HealthRequest(), timeout=3)
            check(False, "a plaintext client was served on the TLS port")
        except grpc.RpcError as e:
            check(e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
                  f"plaintext on TLS port: {e.code()}")
    print("plaintext client refused on the TLS port")

    check(d.stub.Health(pb.HealthRequest(), timeout=5).status == "serving", "UNIX socket stopped")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    main_wrapper(run)
