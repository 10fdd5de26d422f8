// prefixgate dashboard: polls the cache stats API and draws it. No libraries, no external
// requests (the server's Content-Security-Policy forbids them anyway). Every number is written
// with textContent (agent and tenant labels come from clients: never parsed as HTML) and carries
// its exact value in data-value for tests and scrapers.
"use strict";

(() => {
  // Relative on purpose: the page also works under a prefix (a router mounting it elsewhere).
  const STATS_URL = "v1/cache/stats";
  const POLL_MS = 1500;
  const MAX_RETRY_MS = 8000;
  const REQUEST_TIMEOUT_MS = 5000;
  const HISTORY_LENGTH = 120; // samples kept for the charts: 3 minutes at POLL_MS
  const MIN_CHART_SPAN_MS = 60000; // the chart never spans less, so a fresh page isn't stretched
  const MAX_POOL_CELLS = 4096; // larger pools: one cell stands for several pages
  const KEY_STORAGE = "prefixgate.dashboard.key";
  const OTHER_LABEL = "__other__"; // the server folds the agents beyond its listing limit here
  const SVG_NS = "http://www.w3.org/2000/svg";

  const byTestId = (id) => document.querySelector(`[data-testid="${id}"]`);
  const samples = []; // {t, requests, query, hit, rate}, oldest first
  let apiKey = initialKey();
  let lastStats = null;
  let updates = 0;
  let failures = 0;
  let timer = null;

  // ── formatting ────────────────────────────────────────────────────────────
  const intFormat = new Intl.NumberFormat("en-US");
  const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
  const fmtInt = (v) => (isNumber(v) ? intFormat.format(v) : "—");
  const fmtPct = (r) => (isNumber(r) ? `${(r * 100).toFixed(1)}%` : "—");
  const fmtText = (v) => (v === undefined || v === null || v === "" ? "—" : String(v));
  function fmtCompact(v) {
    if (!isNumber(v)) return "—";
    const units = [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [size, unit] of units) {
      if (Math.abs(v) >= size) return `${(v / size).toFixed(v >= 10 * size ? 0 : 1)}${unit}`;
    }
    return v.toFixed(v >= 10 || Number.isInteger(v) ? 0 : 1);
  }

  /** Show `text` in the element with data-testid `id`, and its exact value in data-value. */
  function show(id, value, text) {
    const el = byTestId(id);
    el.dataset.value = value === undefined || value === null ? "" : String(value);
    el.textContent = text;
  }

  // ── API key: ?key=..., else this tab's session storage, else the form ───────
  function storage() {
    // Storage throws in some contexts (file:// pages, disabled cookies): then the key lives in
    // memory only, which is a degraded mode, not an error.
    try {
      return window.sessionStorage;
    } catch (err) {
      console.warn("dashboard: session storage unavailable:", err);
      return null;
    }
  }

  function initialKey() {
    const url = new URL(window.location.href);
    const fromUrl = url.searchParams.get("key");
    if (fromUrl) {
      // Keep the key out of the address bar, the history and any screenshot.
      url.searchParams.delete("key");
      window.history.replaceState(null, "", url.pathname + url.search + url.hash);
      storage()?.setItem(KEY_STORAGE, fromUrl);
      return fromUrl;
    }
    return storage()?.getItem(KEY_STORAGE) || "";
  }

  function setKey(key) {
    apiKey = key;
    if (key) storage()?.setItem(KEY_STORAGE, key);
    else storage()?.removeItem(KEY_STORAGE);
    byTestId("key-toggle").textContent = key ? "API key ✓" : "API key";
  }

  function showKeyForm(open) {
    byTestId("key-form").classList.toggle("hidden", !open);
    byTestId("key-toggle").setAttribute("aria-expanded", String(open));
    if (open) byTestId("key-input").focus();
  }

  // ── polling ───────────────────────────────────────────────────────────────
  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function errorMessage(response) {
    const body = await response.text();
    try {
      const parsed = JSON.parse(body);
      // The gateway's OpenAI-style envelope: {"error": {"message", "type", "code"}}.
      if (parsed && parsed.error && parsed.error.message) return parsed.error.message;
    } catch (err) {
      if (!(err instanceof SyntaxError)) throw err; // not JSON: show the text itself
    }
    return body.slice(0, 200) || response.statusText;
  }

  async function poll() {
    timer = null;
    const controller = new AbortController();
    const timeout = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
    try {
      const headers = { Accept: "application/json" };
      if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
      const response = await fetch(STATS_URL, {
        headers,
        cache: "no-store",
        signal: controller.signal,
      });
      if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
      const stats = await response.json();
      if (!stats || typeof stats !== "object" || !stats.global) {
        throw new Error("the answer is not a cache stats object");
      }
      render(stats);
      onSuccess();
    } catch (err) {
      onFailure(err);
    } finally {
      clearTimeout(timeout);
      schedule();
    }
  }

  function pollNow() {
    if (timer !== null) clearTimeout(timer);
    failures = 0;
    poll();
  }

  // Back off while failing (1.5, 3, 6, 8, 8, ... s) but never give up.
  const retryDelay = () => Math.min(POLL_MS * 2 ** (failures - 1), MAX_RETRY_MS);

  function schedule() {
    if (timer !== null) clearTimeout(timer);
    timer = setTimeout(poll, failures === 0 ? POLL_MS : retryDelay());
  }

  function setStatus(state, text) {
    const pill = byTestId("status");
    pill.dataset.state = state;
    pill.querySelector(".pill-text").textContent = text;
  }

  function onSuccess() {
    failures = 0;
    updates += 1;
    show("updates", updates, String(updates));
    show("updated-at", Date.now(), new Date().toLocaleTimeString("en-GB"));
    byTestId("error-banner").classList.add("hidden");
    document.body.classList.remove("stale");
    setStatus("live", "live");
  }

  function onFailure(err) {
    failures += 1;
    let kind = "network";
    let title = "Cannot reach the gateway";
    let detail = err && err.message ? err.message : String(err);
    if (err instanceof HttpError) {
      if (err.status === 401 || err.status === 403) {
        kind = "auth";
        title = apiKey ? "The API key was refused" : "This gateway needs an API key";
        showKeyForm(true);
      } else {
        kind = "http";
        title = `The stats API answered HTTP ${err.status}`;
      }
      detail = `${err.status}: ${err.message}`;
    } else if (err && err.name === "AbortError") {
      title = `The gateway did not answer within ${REQUEST_TIMEOUT_MS / 1000} s`;
      detail = "";
    } else if (!(err instanceof TypeError)) {
      // Not a network failure: a bug in this page or a malformed answer. Keep it findable.
      console.error("dashboard:", err);
      kind = "render";
      title = "Could not show the stats";
    }
    const banner = byTestId("error-banner");
    banner.dataset.kind = kind;
    banner.classList.remove("hidden");
    byTestId("error-title").textContent = title;
    byTestId("error-detail").textContent = detail;
    show("error-attempts", failures, String(failures));
    show("retry-seconds", retryDelay() / 1000, String(retryDelay() / 1000));
    if (lastStats !== null) document.body.classList.add("stale");
    setStatus(kind === "auth" ? "auth" : "error", kind === "auth" ? "key needed" : "offline · retrying");
  }

  // ── rendering ─────────────────────────────────────────────────────────────
  function render(s) {
    const g = s.global;
    const engine = s.engine || {};
    show("model", s.model, fmtText(s.model));

    show("global-hit-rate", g.hit_rate, fmtPct(g.hit_rate));
    show("global-hit-tokens", g.hit_tokens, fmtInt(g.hit_tokens));
    show("global-query-tokens", g.query_tokens, fmtInt(g.query_tokens));
    show("global-tokens-saved", g.tokens_saved, fmtInt(g.tokens_saved));
    show("global-requests", g.requests, fmtInt(g.requests));
    byTestId("global-hit-meter").style.width = `${clamp01(g.hit_rate) * 100}%`;

    show("engine-running", engine.num_running, fmtInt(engine.num_running));
    show("engine-waiting", engine.num_waiting, fmtInt(engine.num_waiting));
    show("engine-max-waiting", engine.max_waiting, fmtInt(engine.max_waiting));
    show("engine-backend", engine.kernel_backend, fmtText(engine.kernel_backend));
    show("engine-device", engine.device, fmtText(engine.device));
    show("engine-prefill", engine.prefill_tokens_computed, fmtInt(engine.prefill_tokens_computed));
    show("engine-decode", engine.decode_tokens, fmtInt(engine.decode_tokens));
    show("engine-preemptions", engine.num_preemptions, fmtInt(engine.num_preemptions));
    show("engine-page-size", s.page_size, fmtInt(s.page_size));

    show("kv-usage", s.kv_cache_usage, fmtPct(s.kv_cache_usage));
    byTestId("kv-meter").style.width = `${clamp01(s.kv_cache_usage) * 100}%`;
    show("fragmentation", s.fragmentation, fmtPct(s.fragmentation));
    show("num-sequences", s.num_sequences, fmtInt(s.num_sequences));
    show("pages-total", s.num_pages, fmtInt(s.num_pages));
    show("page-size", s.page_size, fmtInt(s.page_size));
    show("pages-used", s.pages_used, fmtInt(s.pages_used));
    show("pages-pinned", s.pages_pinned, fmtInt(s.pages_pinned));
    show("pages-cached", s.pages_cached_free, fmtInt(s.pages_cached_free));
    show("pages-free", s.pages_free, fmtInt(s.pages_free));
    show("evictions", s.evictions, fmtInt(s.evictions));
    show("cow-copies", s.cow_copies, fmtInt(s.cow_copies));
    show("pages-retained", s.pages_retained, fmtInt(s.pages_retained));
    show("retention-hits", g.retention_hits, fmtInt(g.retention_hits));
    show("retention-hit-tokens", g.retention_hit_tokens, fmtInt(g.retention_hit_tokens));
    show("retained-evicted", s.retained_evicted, fmtInt(s.retained_evicted));
    show("retention-expiries", s.retention_expiries, fmtInt(s.retention_expiries));

    lastStats = s;
    record(g);
    drawHitChart();
    drawSavedSpark();
    drawPool(s);
    renderHitTable("agent", s.per_agent, "agents");
    renderHitTable("tenant", s.per_tenant, "tenants", s.retained_per_tenant || {});
    renderPrefixes(s.top_prefixes || []);
    renderRetention(s.retention_policy);
  }

  const clamp01 = (v) => (isNumber(v) ? Math.min(1, Math.max(0, v)) : 0);

  function record(g) {
    const previous = samples[samples.length - 1];
    // Counters only grow; a drop means the gateway restarted: old history no longer adds up.
    if (previous && (g.query_tokens < previous.query || g.requests < previous.requests)) {
      samples.length = 0;
    }
    const last = samples[samples.length - 1];
    const dQuery = last ? g.query_tokens - last.query : 0;
    const sample = {
      t: Date.now(),
      requests: g.requests,
      query: g.query_tokens,
      hit: g.hit_tokens,
      cumulative: g.hit_rate,
      // Hit rate of just the prompt tokens that arrived since the previous poll.
      interval: last && dQuery > 0 ? (g.hit_tokens - last.hit) / dQuery : null,
      savedPerSecond: last ? ((g.hit_tokens - last.hit) * 1000) / Math.max(1, Date.now() - last.t) : null,
    };
    samples.push(sample);
    if (samples.length > HISTORY_LENGTH) samples.shift();
  }

  function svgElement(tag, attrs, parent) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
    parent.appendChild(el);
    return el;
  }

  function drawHitChart() {
    const svg = byTestId("hit-chart");
    svg.replaceChildren();
    const width = Math.max(320, Math.round(svg.clientWidth || 640));
    const height = Math.max(180, Math.round(svg.clientHeight || 220));
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const pad = { left: 40, right: 58, top: 10, bottom: 24 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const now = samples.length ? samples[samples.length - 1].t : Date.now();
    const span = Math.max(MIN_CHART_SPAN_MS, now - (samples.length ? samples[0].t : now));
    const x = (t) => pad.left + plotW * (1 - (now - t) / span);
    const y = (rate) => pad.top + plotH * (1 - clamp01(rate));

    for (const level of [0, 0.25, 0.5, 0.75, 1]) {
      svgElement("line", { class: "gridline", x1: pad.left, x2: pad.left + plotW, y1: y(level), y2: y(level) }, svg);
      svgElement("text", { class: "axis-label", x: pad.left - 8, y: y(level) + 4, "text-anchor": "end" }, svg)
        .textContent = `${level * 100}%`;
    }
    const seconds = Math.round(span / 1000);
    for (const [fraction, anchor] of [[0, "start"], [0.5, "middle"], [1, "end"]]) {
      const label = fraction === 1 ? "now" : `−${Math.round(seconds * (1 - fraction))} s`;
      svgElement("text", {
        class: "axis-label", x: pad.left + plotW * fraction, y: height - 6, "text-anchor": anchor,
      }, svg).textContent = label;
    }

    const barWidth = Math.max(2, (plotW * POLL_MS) / span - 1);
    let traffic = 0;
    samples.forEach((sample, i) => {
      if (sample.interval === null) return;
      traffic += 1;
      const top = y(sample.interval);
      svgElement("rect", {
        class: i === samples.length - 1 ? "bar latest" : "bar",
        x: x(sample.t) - barWidth, y: top, width: barWidth, height: Math.max(1, pad.top + plotH - top), rx: 1,
      }, svg);
    });

    if (samples.length) {
      const d = samples.map((s, i) => `${i ? "L" : "M"}${x(s.t).toFixed(1)},${y(s.cumulative).toFixed(1)}`);
      svgElement("path", { class: "cumulative", d: d.join(" ") }, svg);
      const latest = samples[samples.length - 1];
      svgElement("circle", { class: "cumulative-dot", cx: x(latest.t), cy: y(latest.cumulative), r: 3.5 }, svg);
      svgElement("text", {
        class: "axis-label", x: x(latest.t) + 8, y: y(latest.cumulative) + 4,
      }, svg).textContent = fmtPct(latest.cumulative);
    }
    byTestId("chart-note").textContent = samples.length === 0
      ? "waiting for data…"
      : traffic === 0
        ? `no new prompt tokens in the last ${seconds} s (bars appear with traffic)`
        : `${traffic} interval${traffic === 1 ? "" : "s"} with traffic in the last ${seconds} s`;
  }

  function drawSavedSpark() {
    const svg = byTestId("saved-spark");
    svg.replaceChildren();
    const latest = samples[samples.length - 1];
    show("saved-rate", latest ? latest.savedPerSecond : null,
      latest && latest.savedPerSecond ? `+${fmtCompact(latest.savedPerSecond)} tok/s` : "idle");
    if (samples.length < 2) return;
    const first = samples[0].hit;
    const range = Math.max(1, latest.hit - first);
    const t0 = samples[0].t;
    const tSpan = Math.max(1, latest.t - t0);
    const points = samples.map((s) => [((s.t - t0) / tSpan) * 200, 34 - ((s.hit - first) / range) * 30]);
    const line = points.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join(" ");
    svgElement("path", { class: "area", d: `${line} L200,36 L0,36 Z` }, svg);
    svgElement("path", { class: "line", d: line }, svg);
  }

  /** Split `cells` among `counts` in proportion (largest remainder); a state that has pages
   * keeps at least one cell, so a few pinned pages never vanish from a large pool's picture. */
  function apportion(counts, cells) {
    const total = counts.reduce((a, b) => a + b, 0);
    if (total === 0) return counts.map(() => 0);
    const quotas = counts.map((c) => (c * cells) / total);
    const out = quotas.map(Math.floor);
    let left = cells - out.reduce((a, b) => a + b, 0);
    const order = quotas.map((q, i) => [q - Math.floor(q), i]).sort((a, b) => b[0] - a[0]);
    for (const [, i] of order) {
      if (left === 0) break;
      out[i] += 1;
      left -= 1;
    }
    counts.forEach((c, i) => {
      if (c > 0 && out[i] === 0) {
        const donor = out.indexOf(Math.max(...out));
        out[donor] -= 1;
        out[i] = 1;
      }
    });
    return out;
  }

  function drawPool(s) {
    const canvas = byTestId("pool-grid");
    const total = s.num_pages;
    if (!isNumber(total) || total <= 0) return;
    const pinned = s.pages_pinned;
    const states = [
      ["pinned", pinned],
      ["used", Math.max(0, s.pages_used - pinned)], // pinned pages are also in use
      ["cached", s.pages_cached_free],
      ["free", s.pages_free],
    ];
    const pagesPerCell = Math.max(1, Math.ceil(total / MAX_POOL_CELLS));
    const cells = Math.ceil(total / pagesPerCell);
    const cellCounts = apportion(states.map(([, n]) => n), cells);
    canvas.dataset.cells = String(cells);
    canvas.dataset.pagesPerCell = String(pagesPerCell);
    canvas.dataset.cellCounts = cellCounts.join(",");
    byTestId("pool-scale").textContent = pagesPerCell > 1 ? `· 1 cell = ${pagesPerCell} pages` : "· 1 cell = 1 page";

    // The biggest cell (up to 22 px) for which the whole pool fits 240 px of height.
    const width = Math.max(120, canvas.clientWidth);
    const maxHeight = 240;
    let size = 22;
    let gap = 3;
    let columns = 1;
    for (; size > 2; size -= 1) {
      gap = size >= 12 ? 3 : size >= 6 ? 2 : 1;
      columns = Math.max(1, Math.floor((width + gap) / (size + gap)));
      if (Math.ceil(cells / columns) * (size + gap) - gap <= maxHeight) break;
    }
    const rows = Math.ceil(cells / columns);
    const height = rows * (size + gap) - gap;
    canvas.style.height = `${height}px`;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    const css = getComputedStyle(document.documentElement);
    let cell = 0;
    states.forEach(([name], i) => {
      ctx.fillStyle = css.getPropertyValue(`--${name}`).trim();
      for (let k = 0; k < cellCounts[i]; k += 1, cell += 1) {
        const cx = (cell % columns) * (size + gap);
        const cy = Math.floor(cell / columns) * (size + gap);
        ctx.beginPath();
        ctx.roundRect(cx, cy, size, size, size >= 8 ? 2 : 0);
        ctx.fill();
      }
    });
  }

  function cellWith(parent, className, testId, value, text) {
    const td = document.createElement("td");
    if (className) td.className = className;
    if (testId) {
      td.dataset.testid = testId;
      td.dataset.value = value === undefined || value === null ? "" : String(value);
    }
    td.textContent = text;
    parent.appendChild(td);
    return td;
  }

  function barCell(parent, className, testId, fraction, value, text) {
    const td = document.createElement("td");
    const bar = document.createElement("div");
    bar.className = `ratebar ${className}`;
    const track = document.createElement("div");
    track.className = "track";
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = `${clamp01(fraction) * 100}%`;
    track.appendChild(fill);
    const label = document.createElement("span");
    label.className = "label";
    label.dataset.testid = testId;
    label.dataset.value = String(value);
    label.textContent = text;
    bar.append(track, label);
    td.appendChild(bar);
    parent.appendChild(td);
  }

  function renderHitTable(kind, entries, plural, retained) {
    const rows = Object.entries(entries || {}).sort(([a, x], [b, y]) => {
      if ((a === OTHER_LABEL) !== (b === OTHER_LABEL)) return a === OTHER_LABEL ? 1 : -1;
      return y.query_tokens - x.query_tokens || (a < b ? -1 : a > b ? 1 : 0);
    });
    const trs = rows.map(([name, h]) => {
      const tr = document.createElement("tr");
      tr.dataset.testid = `${kind}-row`;
      tr.dataset.key = name;
      const other = name === OTHER_LABEL;
      cellWith(tr, other ? "name other" : "name", `${kind}-name`, name,
        other ? `other ${plural} (${fmtInt(h.num_agents)})` : name);
      cellWith(tr, "num", `${kind}-requests`, h.requests, fmtInt(h.requests));
      cellWith(tr, "num", `${kind}-query-tokens`, h.query_tokens, fmtInt(h.query_tokens));
      cellWith(tr, "num", `${kind}-tokens-saved`, h.tokens_saved, fmtInt(h.tokens_saved));
      cellWith(tr, "num", `${kind}-retention-hits`, h.retention_hit_tokens,
        fmtInt(h.retention_hit_tokens));
      barCell(tr, "", `${kind}-hit-rate`, h.hit_rate, h.hit_rate, fmtPct(h.hit_rate));
      if (retained) {
        const pages = retained[name] || 0;
        cellWith(tr, "num", `${kind}-pages-retained`, pages, fmtInt(pages));
      }
      return tr;
    });
    byTestId(`${kind}-rows`).replaceChildren(...trs);
    byTestId(`${kind}-empty`).classList.toggle("hidden", trs.length > 0);
    show(`${kind}-count`, trs.length, String(trs.length));
  }

  const fmtSeconds = (v) => (isNumber(v) ? `${v.toFixed(v >= 10 ? 0 : 1)} s` : "—");

  /** The learned retention TTLs, one row per (tenant, agent): tenants see only their own. */
  function renderRetention(policy) {
    if (!policy) return; // an older gateway, or a router's fleet view
    show("retention-margin", policy.margin, String(policy.margin));
    show("retention-quantile-level", policy.quantile, String(Math.round(policy.quantile * 100)));
    show("retention-min-observations", policy.min_observations, fmtInt(policy.min_observations));
    show("retention-prior", policy.prior_s, fmtText(policy.prior_s));
    show("retention-learn", policy.learn, policy.learn ? "on" : "off");
    const perToken = policy.recompute_s_per_token;
    show("recompute-per-token", perToken,
      isNumber(perToken) ? `${(perToken * 1e6).toFixed(0)} µs${policy.recompute_samples ? "" : " (default)"}` : "—");
    const trs = [];
    for (const [tenant, agents] of Object.entries(policy.agents || {}).sort(([x], [y]) => (x < y ? -1 : x > y ? 1 : 0))) {
      for (const [agent, a] of Object.entries(agents).sort(([x, p], [y, q]) => q.pauses - p.pauses || (x < y ? -1 : 1))) {
        const tr = document.createElement("tr");
        tr.dataset.testid = "retention-row";
        tr.dataset.key = `${tenant}/${agent}`;
        cellWith(tr, "name", "retention-tenant", tenant, tenant);
        cellWith(tr, "name", "retention-agent", agent, agent);
        cellWith(tr, "num", "retention-pauses", a.pauses, fmtInt(a.pauses));
        cellWith(tr, "num", "retention-pause-quantile", a.pause_quantile_s, fmtSeconds(a.pause_quantile_s));
        cellWith(tr, "num", "retention-ttl", a.ttl_s, fmtSeconds(a.ttl_s));
        cellWith(tr, "", "retention-source", a.source, a.source);
        trs.push(tr);
      }
    }
    byTestId("retention-rows").replaceChildren(...trs);
    byTestId("retention-empty").classList.toggle("hidden", trs.length > 0);
  }

  function renderPrefixes(prefixes) {
    const most = Math.max(1, ...prefixes.map((p) => p.num_sharers));
    const trs = prefixes.map((p) => {
      const tr = document.createElement("tr");
      tr.dataset.testid = "prefix-row";
      // No text when the server withholds previews (a tenant key, or --stats-previews off).
      const text = typeof p.text === "string" ? p.text : "(preview hidden)";
      cellWith(tr, "prefix-text", "prefix-text", text, text);
      cellWith(tr, "num", "prefix-tokens", p.num_tokens, fmtInt(p.num_tokens));
      barCell(tr, "sharers", "prefix-sharers", p.num_sharers / most, p.num_sharers, fmtInt(p.num_sharers));
      return tr;
    });
    byTestId("prefix-rows").replaceChildren(...trs);
    byTestId("prefix-empty").classList.toggle("hidden", trs.length > 0);
  }

  // ── wiring ────────────────────────────────────────────────────────────────
  byTestId("poll-seconds").textContent = String(POLL_MS / 1000);
  setKey(apiKey);
  byTestId("key-toggle").addEventListener("click", () => {
    showKeyForm(byTestId("key-form").classList.contains("hidden"));
  });
  byTestId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setKey(byTestId("key-input").value.trim());
    byTestId("key-input").value = "";
    showKeyForm(false);
    pollNow();
  });
  byTestId("key-clear").addEventListener("click", () => {
    setKey("");
    byTestId("key-input").value = "";
  });
  window.addEventListener("resize", () => {
    if (lastStats === null) return;
    drawPool(lastStats);
    drawHitChart();
  });
  poll();
})();
