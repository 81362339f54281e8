#!/usr/bin/python3
"""Browser test of the dashboard against a real tierkvd under a replayed trace.

Headless Chromium is driven through the DevTools protocol over --remote-debugging-pipe (file
descriptors 3 and 4, NUL-separated JSON), so nothing beyond Debian's python3 is needed.

1. Starts tierkvd (temp data and run dirs, HTTP on port 0 -> the address it publishes in
   <run>/tierkvd.http), checks it bound 127.0.0.1, replays part of the trace with tierkv-replay.
2. Opens /dashboard, waits for the charts, replays more of the trace at a fixed rate while the
   page is live and saves a screenshot (--out/dashboard.png).
3. Once the load stopped and the figures settled, waits for the page's next poll and checks that
   every figure it shows (data-value attributes) equals /api/stats read before and after, that
   the charts hold points, and that the prefix table lists what /api/prefixes ranks first.
4. Checks /metrics with `promtool check metrics` and against /api/stats.
5. Stops the daemon: the open page must say it cannot reach it. Starts it again on the same
   port: the page must reconnect by itself, say the daemon restarted, and show the new figures.

Exit 0 = pass, 1 = fail.
"""
import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request


T0 = time.time()


def log(msg):
    print(f"[browser_test {time.time() - T0:5.1f}s] {msg}", flush=True)


class TestFailure(Exception):
    pass


def fail(msg):
    raise TestFailure(msg)


# ---- DevTools protocol over a pipe ------------------------------------------------------------

class Browser:
    def __init__(self, chromium, profile, log_path):
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def fds():  # Chromium reads commands on fd 3 and writes replies on fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "--window-size=1400,1300", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.session = None

    def call(self, method, params=None, session=True, timeout=30):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" not in self._buf:
                if time.time() > deadline:
                    fail(f"DevTools: no answer to {method}")
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    fail("DevTools pipe closed (chromium died?)")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    fail(f"DevTools {method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True})
        if "exceptionDetails" in r:
            fail(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def page(self):
        """What the page shows: figures (data-value), status, body data, chart points, rows."""
        return self.eval("""(() => {
          const figs = {};
          document.querySelectorAll('[id^="fig-"]').forEach(e => figs[e.id] = e.dataset.value);
          const st = document.getElementById('conn-status');
          if (!st || !document.body)  /* not loaded yet */
            return { figs, status: null, statusText: '', body: {}, points: {}, rows: [] };
          const points = {};
          document.querySelectorAll('canvas').forEach(c => points[c.id] = +(c.dataset.points || 0));
          return { figs, status: st.dataset.state, statusText: st.textContent,
                   body: Object.assign({}, document.body.dataset), points,
                   rows: [...document.querySelectorAll('#prefixes tbody tr[data-id]')].map(r => r.dataset.id) };
        })()""")

    def wait_for(self, what, pred, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            p = self.page()
            if pred(p):
                return p
            time.sleep(0.2)
        fail(f"timed out waiting for {what}; page: {json.dumps(p)[:1500]}")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=5)
        except TestFailure:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
        self._log.close()


# ---- the daemon and the load -----------------------------------------------------------------

def http_get(base, path, timeout=10):
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def stats(base):
    return json.loads(http_get(base, "/api/stats")[2])


def strip_clock(s):
    s = dict(s)
    for k in ("now_ms", "uptime_s", "leases_active", "leases_expired"):
        s.pop(k, None)
    return s


def stable_stats(base, tries=60):
    """Waits until two reads 300 ms apart agree on every counter (write-backs drained)."""
    a = stats(base)
    for _ in range(tries):
        time.sleep(0.3)
        b = stats(base)
        if strip_clock(a) == strip_clock(b):
            return b
        a = b
    fail("the daemon's figures did not settle after the load stopped")


def expected_figures(s):
    """Figure id -> the /api/stats value the page must show for it."""
    tier = {t["tier"]: t for t in s["tiers"]}
    lat = s["lookup_latency_us"]
    e = {
        "fig-hit-rate": s["hit_rate"], "fig-tokens-saved": s["prefill_tokens_saved"],
        "fig-query-tokens": s["query_tokens"], "fig-lookups": s["lookups"],
        "fig-hit-blocks": s["hit_blocks"], "fig-miss-blocks": s["miss_blocks"],
        "fig-p50": lat["p50"], "fig-p90": lat["p90"], "fig-p99": lat["p99"],
        "fig-promotions": s["promotions"], "fig-demotions": s["demotions"],
        "fig-evictions": s["evictions"], "fig-checksum-failures": s["checksum_failures"],
        "fig-io-errors": s["io_errors"], "fig-puts": s["puts"], "fig-gets": s["gets"],
        "fig-rpcs": s["rpcs"], "fig-clients": s["clients_connected"],
    }
    for t in ("l1", "l2", "l3"):
        e[f"fig-hit-rate-{t}"] = tier[t]["hit_rate"]
    for t in ("l2", "l3"):
        e[f"fig-blocks-{t}"] = tier[t]["blocks"]
        e[f"fig-bytes-{t}"] = tier[t]["bytes"]
        e[f"fig-capacity-{t}"] = tier[t]["capacity_blocks"]
    return e


def compare(figs, s):
    bad = []
    for ident, want in expected_figures(s).items():
        got = figs.get(ident)
        if got is None or got == "":
            bad.append(f"{ident}: not shown (want {want})")
        elif abs(float(got) - float(want)) > 1e-9 * max(1.0, abs(float(want))):
            bad.append(f"{ident}: page {got} != /api/stats {want}")
    return bad


class Daemon:
    def __init__(self, args, tmp):
        self.args = args
        self.data, self.run = os.path.join(tmp, "data"), os.path.join(tmp, "run")
        os.makedirs(self.data)
        os.makedirs(self.run)
        self.proc = None

    def start(self, port):
        http_file = os.path.join(self.run, "tierkvd.http")
        if os.path.exists(http_file):
            os.unlink(http_file)
        cmd = [self.args.tierkvd, "--foreground", "--data-dir", self.data, "--run-dir", self.run,
               "--http-port", str(port)]
        logf = open(os.path.join(self.args.out, "tierkvd.log"), "a")
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                fail(f"tierkvd exited {self.proc.returncode} at start; see {logf.name}")
            if os.path.exists(http_file):
                addr = open(http_file).read().strip()
                try:
                    if addr:
                        stats("http://" + addr)
                        return addr
                except OSError:
                    pass
            time.sleep(0.1)
        fail("tierkvd did not publish its HTTP address within 30 s")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            fail("tierkvd did not stop within 60 s of SIGTERM")
        self.proc = None
        if rc != 0:
            fail(f"tierkvd exited {rc} after SIGTERM")

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def replay(self, requests, rate=0, background=False):
        cmd = [self.args.replay, "--socket", os.path.join(self.run, "tierkv.sock"),
               "--trace", self.args.trace, "--requests", str(requests)]
        if rate:
            cmd += ["--rate", str(rate)]
        out = open(os.path.join(self.args.out, "replay.log"), "a")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        if background:
            return p
        if p.wait(timeout=180) != 0:
            fail(f"tierkv-replay exited {p.returncode}; see {out.name}")
        return None


# ---- the test --------------------------------------------------------------------------------

def run(args, tmp):
    d = Daemon(args, tmp)
    browser = None
    try:
        addr = d.start(0)
        host, port = addr.rsplit(":", 1)
        if host != "127.0.0.1":
            fail(f"the HTTP side bound {host}, not 127.0.0.1, by default")
        base = "http://" + addr
        url = base + "/dashboard"
        log(f"tierkvd up, dashboard at {url}")
        d.replay(args.requests)
        log(f"replayed {args.requests} requests")

        # --- the page, live under load, and its screenshot ---------------------------------
        browser = Browser(args.chromium, os.path.join(tmp, "chromium"),
                          os.path.join(args.out, "chromium.log"))
        browser.open(url)
        browser.wait_for("the page to draw its charts",
                         lambda p: p["body"].get("ready") == "1" and p["status"] == "live")
        bg = d.replay(args.requests, rate=args.rate, background=True)
        time.sleep(args.live_s)
        shot = os.path.join(args.out, "dashboard.png")
        browser.screenshot(shot)
        if os.path.getsize(shot) < 10000:
            fail("the screenshot is empty")
        log(f"screenshot: {shot}")
        if bg.wait(timeout=180) != 0:
            fail("background tierkv-replay failed; see replay.log")

        # --- figures on the page == /api/stats --------------------------------------------
        before = stable_stats(base)
        log("load stopped, figures settled")
        if before["lookups"] == 0 or before["hit_blocks"] == 0:
            fail(f"the replay produced no hits: {before}")
        p = browser.wait_for("a poll after the load stopped",
                             lambda p: int(p["body"].get("nowMs", "0")) > before["now_ms"] and
                             int(p["body"].get("prefixesNowMs", "0")) > before["now_ms"],
                             timeout=20)
        after = stats(base)
        if strip_clock(before) != strip_clock(after):
            fail("the figures moved while the page was read although the load had stopped")
        bad = compare(p["figs"], after)
        if bad:
            fail("page and /api/stats disagree:\n  " + "\n  ".join(bad))
        for chart in ("chart-hit-rate", "chart-tokens-saved", "chart-moves", "chart-latency"):
            if p["points"].get(chart, 0) < 3:
                fail(f"{chart} holds too few points: {p['points']}")
        top = json.loads(http_get(base, "/api/prefixes?top=20")[2])
        want_rows = [x["id"] for x in top["prefixes"]]
        if not want_rows or p["rows"] != want_rows:
            fail(f"prefix table {p['rows'][:5]} != /api/prefixes {want_rows[:5]}")
        log(f"page == /api/stats on {len(expected_figures(after))} figures: hit rate "
            f"{after['hit_rate']:.4f}, {after['lookups']} lookups, "
            f"{after['prefill_tokens_saved']} tokens saved; {len(p['rows'])} prefix rows; "
            f"chart points {p['points']}")

        # --- /metrics through Prometheus's parser ------------------------------------------
        status, ctype, body = http_get(base, "/metrics")
        if status != 200 or not ctype.startswith("text/plain; version=0.0.4"):
            fail(f"/metrics: {status} {ctype}")
        r = subprocess.run([args.promtool, "check", "metrics"], input=body.encode(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            fail("promtool check metrics: " + r.stdout.decode())
        samples = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        if samples["tierkv_lookups_total"] != after["lookups"]:
            fail("tierkv_lookups_total != /api/stats lookups")
        hits = sum(samples[f'tierkv_lookup_hit_blocks_total{{tier="{t}"}}'] for t in ("l1", "l2", "l3"))
        if hits != after["hit_blocks"]:
            fail(f"/metrics per-tier hit blocks sum to {hits}, /api/stats says {after['hit_blocks']}")
        log(f"promtool check metrics: clean ({len(samples)} samples)")

        # --- daemon gone, then back: the open page follows ---------------------------------
        d.stop()
        p = browser.wait_for("the page to say the daemon is unreachable",
                             lambda p: p["status"] == "down", timeout=15)
        if "cannot reach tierkvd" not in p["statusText"]:
            fail(f"unreachable daemon shown as {p['statusText']!r}")
        log(f"daemon stopped -> page: {p['statusText']!r}")
        d.start(int(port))
        p = browser.wait_for("the page to reconnect",
                             lambda p: p["status"] == "live" and "restarted" in p["statusText"],
                             timeout=20)
        again = stable_stats(base)
        p = browser.wait_for("a poll after the restart",
                             lambda p: int(p["body"].get("nowMs", "0")) > again["now_ms"], timeout=20)
        bad = compare(p["figs"], stats(base))
        if bad:
            fail("after the restart the page and /api/stats disagree:\n  " + "\n  ".join(bad))
        log(f"daemon restarted -> page: {p['statusText']!r}; figures match again")
        d.stop()
    finally:
        if browser:
            browser.close()
        d.kill()


def main():
    ap = argparse.ArgumentParser()
    for a in ("tierkvd", "replay", "chromium", "promtool", "trace", "out"):
        ap.add_argument("--" + a, required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=15)
    ap.add_argument("--live-s", type=float, default=4)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for f in ("tierkvd.log", "replay.log"):
        open(os.path.join(args.out, f), "w").close()
    tmp = tempfile.mkdtemp(prefix="tkv-dash-")
    try:
        run(args, tmp)
    except TestFailure as e:
        log(f"FAIL: {e}")
        for f in ("tierkvd.log", "replay.log"):
            path = os.path.join(args.out, f)
            tail = open(path, errors="replace").read()[-1500:]
            if tail:
                log(f"--- tail of {path}:\n{tail}")
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
