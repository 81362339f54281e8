/* dashboard.js - live view of one tierkvd, from /api/stats (every second) and /api/prefixes.
 *
 * Rates are computed here from the differences of two consecutive snapshots, over the
 * daemon's own clock (now_ms), so a slow browser tab does not distort them. A daemon restart
 * shows up as a new start_ms (or counters going down): the baseline is reset instead of
 * drawing a huge negative rate. When the daemon cannot be reached the page says so, keeps its
 * history on screen and keeps retrying.
 */
'use strict';

const kPollMs = 1000;
const kPrefixEvery = 5;        /* polls between /api/prefixes refreshes */
const kFetchTimeoutMs = 3000;
const kHistory = 300;          /* samples kept on the charts (5 minutes at 1 s) */
const kWindowMs = 5000;        /* rates, hit rates and percentiles are over this sliding window:
                                  a 1 s interval often holds no lookup at all, which would draw
                                  a gap, and a handful of lookups makes a noisy percentile */
const kTiers = ['l1', 'l2', 'l3'];
const kTierColor = { all: '#222222', l1: '#7b3294', l2: '#1b7837', l3: '#2166ac' };

const state = {
  prev: null,          /* last snapshot */
  recent: [],          /* snapshots of the last kWindowMs (since the last restart) */
  samples: 0,
  polls: 0,
  lastOkMs: 0,
  failures: 0,
  charts: {},
};

/* ---- formatting ---------------------------------------------------------------------------- */

function fmtPct(x) { return x == null ? '–' : (100 * x).toFixed(1) + '%'; }
function fmtInt(x) { return x == null ? '–' : Math.round(x).toLocaleString('en-US'); }
function fmtUs(x) { return x == null ? '–' : x < 100 ? x.toFixed(1) : Math.round(x).toLocaleString('en-US'); }
function fmtBytes(x) {
  if (x == null) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return (i ? x.toFixed(1) : String(x)) + ' ' + units[i];
}
function fmtDuration(s) {
  if (s == null) return '–';
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}
function fmtClock(ms) { return new Date(ms).toISOString().substring(11, 19); }

/* Writes a figure: the formatted text, and the raw value in data-value. */
function setFig(id, raw, text) {
  const el = document.getElementById(id);
  if (!el) return;
  el.dataset.value = raw == null ? '' : String(raw);
  el.textContent = text;
}

function setStatus(kind, text) {
  const el = document.getElementById('conn-status');
  el.className = 'conn ' + kind;
  el.dataset.state = kind;
  el.textContent = text;
}

/* ---- charts ------------------------------------------------------------------------------- */

function lineChart(id, datasets, yOpts, extraScales) {
  const scales = Object.assign({
    x: { ticks: { maxTicksLimit: 5, maxRotation: 0 } },
    y: Object.assign({ beginAtZero: true }, yOpts || {}),
  }, extraScales || {});
  return new Chart(document.getElementById(id), {
    type: 'line',
    data: { labels: [], datasets: datasets.map(d => Object.assign({
      data: [], borderWidth: 1.5, pointRadius: 0, tension: 0.2, spanGaps: false,
      backgroundColor: d.borderColor,
    }, d)) },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false,
      interaction: { mode: 'index', intersect: false },
      plugins: { legend: { labels: { boxWidth: 12 } } },
      scales,
    },
  });
}

function makeCharts() {
  const pct = { min: 0, max: 100, ticks: { callback: v => v + '%' } };
  state.charts.hit = lineChart('chart-hit-rate', [
    { label: 'all tiers', borderColor: kTierColor.all },
    { label: 'L1 (GPU)', borderColor: kTierColor.l1 },
    { label: 'L2 (host)', borderColor: kTierColor.l2 },
    { label: 'L3 (disk)', borderColor: kTierColor.l3 },
  ], pct);
  state.charts.saved = lineChart('chart-tokens-saved', [
    { label: 'tokens/s saved', borderColor: '#1b7837', backgroundColor: 'rgba(27,120,55,0.15)', fill: true },
  ]);
  state.charts.occupancy = new Chart(document.getElementById('chart-occupancy'), {
    type: 'bar',
    data: { labels: ['L1 (GPU)', 'L2 (host)', 'L3 (disk)'], datasets: [
      { label: 'resident', data: [0, 0, 0], backgroundColor: '#2166ac' },
      { label: 'capacity', data: [0, 0, 0], backgroundColor: '#d1e5f0' },
    ] },
    /* Horizontal bars on a log axis: L2 is often 100x smaller than L3 and must stay visible;
     * an absent tier (0 bytes) or an unlimited capacity (0) shows no bar. */
    options: {
      indexAxis: 'y', animation: false, responsive: true, maintainAspectRatio: false,
      plugins: { tooltip: { callbacks: { label: c => c.dataset.label + ': ' + fmtBytes(c.raw) } } },
      scales: { x: { type: 'logarithmic', min: 1 << 20,
                     /* ticks at powers of 4 bytes (1 MiB, 4 MiB, ..., 1 GiB, ...), readable */
                     afterBuildTicks: axis => {
                       const ticks = [];
                       for (let v = 1 << 20; v <= axis.max * 1.001; v *= 4) ticks.push({ value: v });
                       axis.ticks = ticks;
                     },
                     ticks: { maxRotation: 0, callback: v => fmtBytes(v) } } },
    },
  });
  state.charts.moves = lineChart('chart-moves', [
    { label: 'promotions/s', borderColor: '#1b7837', yAxisID: 'y' },
    { label: 'demotions/s', borderColor: '#b2182b', yAxisID: 'y' },
    { label: 'promoted bytes/s', borderColor: '#5aae61', borderDash: [4, 3], yAxisID: 'y2' },
    { label: 'demoted bytes/s', borderColor: '#ef8a62', borderDash: [4, 3], yAxisID: 'y2' },
  ], { title: { display: true, text: 'blocks/s' } }, {
    y2: { position: 'right', beginAtZero: true, grid: { drawOnChartArea: false },
          ticks: { callback: v => fmtBytes(v) + '/s' } },
  });
  state.charts.latency = lineChart('chart-latency', [
    { label: 'p50', borderColor: '#4393c3' },
    { label: 'p90', borderColor: '#f4a582' },
    { label: 'p99', borderColor: '#b2182b' },
  ], { type: 'logarithmic', min: 1, beginAtZero: false, title: { display: true, text: 'µs (log)' },
       ticks: { callback: v => [1, 10, 100, 1000, 10000, 100000].includes(v) ? fmtInt(v) : '' } });
  state.charts.faults = lineChart('chart-faults', [
    { label: 'checksum failures', borderColor: '#b2182b', stepped: true },
    { label: 'I/O errors', borderColor: '#762a83', stepped: true },
  ], { ticks: { precision: 0 } });
}

function pushPoint(chart, label, values) {
  chart.data.labels.push(label);
  chart.data.datasets.forEach((d, i) => d.data.push(values[i]));
  if (chart.data.labels.length > kHistory) {
    chart.data.labels.shift();
    chart.data.datasets.forEach(d => d.data.shift());
  }
}

/* A gap in every line chart, e.g. while the daemon was unreachable or restarted. */
function pushGap(label) {
  for (const k of ['hit', 'saved', 'moves', 'latency'])
    pushPoint(state.charts[k], label, state.charts[k].data.datasets.map(() => null));
}

/* ---- derived figures ---------------------------------------------------------------------- */

function tier(s, name) { return s.tiers.find(t => t.tier === name) || {}; }

/* Percentile of the lookups that happened between two snapshots, from the histogram bucket
 * differences, interpolated inside the bucket exactly as the daemon does for its totals. */
function intervalQuantile(prev, cur, q) {
  const b0 = prev.lookup_latency_us.buckets, b1 = cur.lookup_latency_us.buckets;
  const counts = b1.map((b, i) => b.count - (b0[i] ? b0[i].count : 0));
  const total = counts.reduce((a, c) => a + c, 0);
  if (total <= 0) return null;
  const rank = q * total;
  let seen = 0;
  for (let i = 0; i < counts.length; i++) {
    if (counts[i] > 0 && seen + counts[i] >= rank) {
      const lo = i ? b1[i - 1].le : 0, hi = b1[i].le;
      if (hi == null) return lo;
      return lo + (hi - lo) * ((rank - seen) / counts[i]);
    }
    seen += counts[i];
  }
  return null;
}

function isRestart(prev, cur) {
  return cur.start_ms !== prev.start_ms || cur.lookups < prev.lookups ||
         cur.rpcs < prev.rpcs || cur.now_ms < prev.now_ms;
}

/* ---- rendering ---------------------------------------------------------------------------- */

function renderFigures(s) {
  setFig('fig-hit-rate', s.hit_rate, fmtPct(s.hit_rate));
  for (const t of kTiers) {
    const ts = tier(s, t);
    setFig('fig-hit-rate-' + t, ts.hit_rate, fmtPct(ts.hit_rate));
  }
  setFig('fig-tokens-saved', s.prefill_tokens_saved, fmtInt(s.prefill_tokens_saved));
  setFig('fig-query-tokens', s.query_tokens, fmtInt(s.query_tokens));
  setFig('fig-lookups', s.lookups, fmtInt(s.lookups));
  setFig('fig-hit-blocks', s.hit_blocks, fmtInt(s.hit_blocks));
  setFig('fig-miss-blocks', s.miss_blocks, fmtInt(s.miss_blocks));
  const lat = s.lookup_latency_us;
  setFig('fig-p50', lat.p50, fmtUs(lat.p50));
  setFig('fig-p90', lat.p90, fmtUs(lat.p90));
  setFig('fig-p99', lat.p99, fmtUs(lat.p99));
  for (const t of ['l2', 'l3']) {
    const ts = tier(s, t);
    setFig('fig-bytes-' + t, ts.bytes, fmtBytes(ts.bytes));
    setFig('fig-blocks-' + t, ts.blocks, fmtInt(ts.blocks));
    setFig('fig-capacity-' + t, ts.capacity_blocks,
           ts.capacity_blocks ? fmtInt(ts.capacity_blocks) : 'unlimited');
  }
  setFig('fig-promotions', s.promotions, fmtInt(s.promotions));
  setFig('fig-demotions', s.demotions, fmtInt(s.demotions));
  setFig('fig-evictions', s.evictions, fmtInt(s.evictions));
  setFig('fig-checksum-failures', s.checksum_failures, fmtInt(s.checksum_failures));
  setFig('fig-io-errors', s.io_errors, fmtInt(s.io_errors));
  document.getElementById('tile-faults').classList.toggle('alert',
    s.checksum_failures > 0 || s.io_errors > 0 || s.l3_readonly);
  setFig('fig-l3-mode', s.l3_readonly ? 1 : 0,
         'L3 ' + (s.l3_readonly ? 'READ-ONLY' : 'writable') + ' · I/O ' + s.l3_io_mode);
  setFig('fig-clients', s.clients_connected, fmtInt(s.clients_connected));
  setFig('fig-leases', s.leases_active, fmtInt(s.leases_active));
  setFig('fig-puts', s.puts, fmtInt(s.puts));
  setFig('fig-gets', s.gets, fmtInt(s.gets));
  setFig('fig-rpcs', s.rpcs, fmtInt(s.rpcs));
  setFig('fig-uptime', s.uptime_s, fmtDuration(s.uptime_s));
  const g = s.geometry;
  document.getElementById('meta').textContent =
    `${g.model_id || 'model ?'} · ${g.num_layers}×${g.num_kv_heads}×${g.head_dim} ${g.dtype} · ` +
    `${g.block_tokens} tokens/block (${fmtBytes(g.block_bytes)}) · policy ${s.policy} · v${s.version}`;
}

/* The oldest snapshot at most kWindowMs older than s (null when there is none). */
function windowBase(s) {
  state.recent = state.recent.filter(x => s.now_ms - x.now_ms <= kWindowMs && x.now_ms < s.now_ms);
  return state.recent.length ? state.recent[0] : null;
}

function renderCharts(prev, s) {
  const label = fmtClock(s.now_ms);
  const c = state.charts;
  c.occupancy.data.datasets[0].data = kTiers.map(t => tier(s, t).bytes || null);
  c.occupancy.data.datasets[1].data = kTiers.map(t => tier(s, t).capacity_bytes || null);
  c.faults.data.labels.push(label);
  c.faults.data.datasets[0].data.push(s.checksum_failures);
  c.faults.data.datasets[1].data.push(s.io_errors);
  if (c.faults.data.labels.length > kHistory) {
    c.faults.data.labels.shift();
    c.faults.data.datasets.forEach(d => d.data.shift());
  }
  if (prev && s.now_ms > prev.now_ms) {
    prev = windowBase(s) || prev;
    const dt = (s.now_ms - prev.now_ms) / 1000;
    const dBlocks = s.lookup_blocks - prev.lookup_blocks;
    const rate = (a, b) => dBlocks > 0 ? 100 * (a - b) / dBlocks : null;
    pushPoint(c.hit, label, [rate(s.hit_blocks, prev.hit_blocks)].concat(
      kTiers.map(t => rate(tier(s, t).hit_blocks, tier(prev, t).hit_blocks))));
    pushPoint(c.saved, label, [(s.prefill_tokens_saved - prev.prefill_tokens_saved) / dt]);
    pushPoint(c.moves, label, [
      (s.promotions - prev.promotions) / dt, (s.demotions - prev.demotions) / dt,
      (s.promotion_bytes - prev.promotion_bytes) / dt, (s.demotion_bytes - prev.demotion_bytes) / dt]);
    pushPoint(c.latency, label, [0.5, 0.9, 0.99].map(q => intervalQuantile(prev, s, q)));
  }
  state.recent.push(s);
  for (const k in c) {
    c[k].update('none');
    /* how many points each chart holds, for tests and for a glance in the inspector */
    c[k].canvas.dataset.points = String(c[k].data.labels.length);
  }
}

function renderPrefixes(p) {
  const tbody = document.querySelector('#prefixes tbody');
  const rows = p.prefixes.map(x => {
    const tr = document.createElement('tr');
    tr.dataset.id = x.id;
    const kind = x.kind === 'branch' ? `branch (${x.children})` : x.kind;
    const cells = [x.id, x.root, kind, fmtInt(x.depth), fmtInt(x.tokens), fmtInt(x.blocks),
                   fmtInt(x.hits), fmtInt(x.tokens_saved), x.tier.toUpperCase(),
                   `${fmtInt(x.in_l2)} / ${fmtInt(x.in_l3)}`,
                   x.last_access_ms ? fmtClock(x.last_access_ms) : '–'];
    cells.forEach((v, i) => {
      const td = document.createElement('td');
      td.textContent = v;
      if (i < 2) td.className = 'mono';
      tr.appendChild(td);
    });
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement('tr');
    tr.innerHTML = '<td colspan="11" class="empty">no cached prefixes yet</td>';
    rows.push(tr);
  }
  tbody.replaceChildren(...rows);
  document.getElementById('prefixes-meta').textContent =
    `(${fmtInt(p.num_prefixes)} prefixes, ${fmtInt(p.num_tips)} tips, over ${fmtInt(p.num_blocks)} ` +
    `cached blocks; ranked by ${p.by.replace('_', ' ')})`;
}

/* ---- polling ------------------------------------------------------------------------------ */

async function fetchJson(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), kFetchTimeoutMs);
  try {
    const r = await fetch(path, { cache: 'no-store', signal: ctl.signal });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return await r.json();
  } finally {
    clearTimeout(timer);
  }
}

async function poll() {
  let s;
  try {
    s = await fetchJson('/api/stats');
  } catch (e) {
    state.failures++;
    if (state.failures === 1 && state.prev) pushGap(fmtClock(Date.now()));
    const ago = state.lastOkMs ? ` (last data ${Math.round((Date.now() - state.lastOkMs) / 1000)} s ago)` : '';
    setStatus('down', `cannot reach tierkvd at ${location.host} — retrying every ${kPollMs / 1000} s${ago}`);
    return;
  }
  let prev = state.prev;
  if (prev && isRestart(prev, s)) {
    pushGap(fmtClock(s.now_ms));
    prev = null;
    state.recent = [];
    state.restartedAt = s.start_ms;
  }
  renderFigures(s);
  renderCharts(prev, s);
  state.prev = s;
  state.samples++;
  state.failures = 0;
  state.lastOkMs = Date.now();
  document.body.dataset.samples = String(state.samples);
  document.body.dataset.nowMs = String(s.now_ms);
  const restarted = state.restartedAt ? ` · daemon restarted at ${fmtClock(state.restartedAt)}` : '';
  setStatus('live', `live · updated ${fmtClock(s.now_ms)} UTC${restarted}`);
  if (state.polls % kPrefixEvery === 0 || state.prefixesFailed) {
    try {
      renderPrefixes(await fetchJson('/api/prefixes?top=20'));
      state.prefixesFailed = false;
      document.body.dataset.prefixes = '1';
      document.body.dataset.prefixesNowMs = String(s.now_ms);
    } catch (e) {
      state.prefixesFailed = true;
    }
  }
  if (state.samples >= 2 && document.body.dataset.prefixes === '1') document.body.dataset.ready = '1';
}

async function loop() {
  await poll();
  state.polls++;
  setTimeout(loop, kPollMs);
}

if (typeof Chart === 'undefined') {
  setStatus('down', 'Chart.js failed to load from this daemon');
} else {
  makeCharts();
  loop();
}
