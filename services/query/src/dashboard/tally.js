// The dashboard's shared script: fetching the API (with the bearer tokens the user
// gave — tally-query's, and the dequeue brokers' for the jobs console — kept for
// this tab only), formatting, and hand-written SVG charts.
"use strict";

const tally = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  // Where each token is kept, by the error code that asks for it.
  const TOKENS = { unauthorized: "tally.token", broker_unauthorized: "tally.broker-token" };

  const $ = (selector, root = document) => root.querySelector(selector);

  /// An element with attributes and children (strings become text).
  function el(tag, attrs = {}, ...children) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  class ApiError extends Error {
    constructor(status, code, message) { super(message); this.status = status; this.code = code; }
  }

  /// JSON from the API; a JSON error becomes an ApiError with its message.
  async function api(path, options = {}) {
    const headers = { ...(options.headers || {}) };
    const token = sessionStorage.getItem(TOKENS.unauthorized);
    if (token) headers.Authorization = `Bearer ${token}`;
    const brokerToken = sessionStorage.getItem(TOKENS.broker_unauthorized);
    if (brokerToken && path.startsWith("/v1/jobs")) headers["X-Broker-Authorization"] = `Bearer ${brokerToken}`;
    if (options.body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, { method: options.method || "GET", headers,
      body: options.body === undefined ? undefined : JSON.stringify(options.body) });
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    if (!response.ok) {
      const error = body && body.error;
      throw new ApiError(response.status, error ? error.code : "http_" + response.status,
        error ? error.message : `${response.status} ${response.statusText}`);
    }
    return body;
  }

  /// A form asking, after a 401 (`error`), for the token it names: tally-query's
  /// or the dequeue brokers'.
  function askToken(box, error, then) {
    const broker = error.code === "broker_unauthorized";
    box.className = "message info";
    box.replaceChildren(
      `${broker ? "The dequeue brokers' API" : "The read API"} needs a bearer token. `,
      el("input", { id: "token", type: "password", placeholder: broker ? "broker token" : "token", size: 24 }),
      " ",
      el("button", { id: "save-token", class: "primary", onclick: () => {
        sessionStorage.setItem(broker ? TOKENS.broker_unauthorized : TOKENS.unauthorized, $("#token").value);
        box.className = "hidden";
        box.replaceChildren(); // the pages pause their refresh while the form is there
        then();
      } }, "use token"));
  }

  const enc = encodeURIComponent;
  const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const two = (n) => String(n).padStart(2, "0");
  const time = (ms) => { const d = new Date(ms); return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`; };
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
  const day = (d) => `${MONTHS[d.getMonth()]} ${d.getDate()}`;

  /// A local-time label for a tick, as detailed as the span needs.
  function tickLabel(ms, span) {
    const d = new Date(ms);
    if (span > 3 * 86400e3) return day(d);
    const hm = `${two(d.getHours())}:${two(d.getMinutes())}`;
    return d.getHours() === 0 && d.getMinutes() === 0 && span > 6 * 3600e3 ? day(d) : hm;
  }

  /// Round tick values covering [min, max].
  function niceTicks(min, max, count) {
    if (min === max) { max = min + 1; }
    const raw = (max - min) / count;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
    const ticks = [];
    for (let v = Math.floor(min / step) * step; v <= max + step * 1e-9; v += step) ticks.push(Math.round(v * 1e9) / 1e9);
    if (ticks[ticks.length - 1] < max) ticks.push(ticks[ticks.length - 1] + step);
    return ticks;
  }

  const TIME_STEPS = [60e3, 300e3, 900e3, 1800e3, 3600e3, 3 * 3600e3, 6 * 3600e3, 12 * 3600e3, 86400e3, 2 * 86400e3, 7 * 86400e3];

  /// Time ticks at local round times.
  function timeTicks(from, to, count) {
    const step = TIME_STEPS.find((s) => (to - from) / s <= count) || TIME_STEPS[TIME_STEPS.length - 1];
    const offset = new Date(from).getTimezoneOffset() * 60e3;
    const ticks = [];
    for (let t = Math.ceil((from - offset) / step) * step + offset; t <= to; t += step) ticks.push(t);
    return ticks;
  }

  /// Draws `series` ([{label, points: [{t, value}], step}]) into `box`: axes, grid,
  /// lines, legend and a hover read-out of every series at the nearest time.
  function lineChart(box, series, stepMs) {
    const width = Math.max(box.clientWidth, 320), height = 320;
    const pad = { left: 64, right: 16, top: 12, bottom: 28 };
    const all = series.flatMap((s) => s.points);
    const svg = el("svg:svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "time series" });
    box.replaceChildren(svg);
    if (!all.length) return;
    const t0 = Math.min(...all.map((p) => p.t)), t1 = Math.max(...all.map((p) => p.t)) + stepMs;
    const values = all.map((p) => p.value);
    const yTicks = niceTicks(Math.min(0, ...values), Math.max(1, ...values), 5);
    const [v0, v1] = [yTicks[0], yTicks[yTicks.length - 1]];
    const x = (t) => pad.left + ((t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
    const y = (v) => height - pad.bottom - ((v - v0) / (v1 - v0)) * (height - pad.top - pad.bottom);
    const grid = el("svg:g", { class: "grid" }), axis = el("svg:g", { class: "axis" });
    for (const v of yTicks) {
      grid.append(el("svg:line", { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v) }));
      axis.append(el("svg:text", { x: pad.left - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v)));
    }
    for (const t of timeTicks(t0, t1, Math.floor((width - pad.left) / 90))) {
      grid.append(el("svg:line", { x1: x(t), x2: x(t), y1: pad.top, y2: height - pad.bottom }));
      axis.append(el("svg:text", { x: x(t), y: height - 8, "text-anchor": "middle" }, tickLabel(t, t1 - t0)));
    }
    svg.append(grid, axis);
    series.forEach((s, i) => {
      s.colour = COLOURS[i % COLOURS.length];
      // Each bucket's value is drawn across its span (a step line: counts per bucket).
      const d = s.points.map((p, j) => `${j ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.value).toFixed(1)}H${x(p.t + stepMs).toFixed(1)}`).join("");
      svg.append(el("svg:path", { class: "series", d, fill: "none", stroke: s.colour, "stroke-width": 2,
        "data-label": s.label, "data-points": JSON.stringify(s.points.map((p) => [p.t, p.value])) }));
    });
    const cursor = el("svg:line", { class: "cursor hidden", y1: pad.top, y2: height - pad.bottom });
    const hit = el("svg:rect", { x: pad.left, y: pad.top, width: width - pad.left - pad.right, height: height - pad.top - pad.bottom, fill: "transparent" });
    svg.append(cursor, hit);
    const tip = el("div", { class: "tooltip hidden", id: "tooltip" });
    box.append(tip, el("div", { class: "legend" }, series.map((s) => el("span", { "data-label": s.label }, el("span", { class: "swatch", style: `background:${s.colour}` }), s.label))));
    hit.addEventListener("mousemove", (event) => {
      const scale = width / svg.getBoundingClientRect().width;
      const at = t0 + ((event.offsetX * scale - pad.left) / (width - pad.left - pad.right)) * (t1 - t0);
      const bucket = all.reduce((best, p) => (p.t <= at && p.t > best ? p.t : best), t0);
      cursor.setAttribute("x1", x(bucket + stepMs / 2)); cursor.setAttribute("x2", x(bucket + stepMs / 2));
      cursor.classList.remove("hidden");
      tip.replaceChildren(el("div", { class: "when" }, `${day(new Date(bucket))} ${time(bucket)}`),
        ...series.map((s) => {
          const p = s.points.find((q) => q.t === bucket);
          return el("div", { "data-label": s.label }, el("span", { class: "swatch", style: `background:${s.colour}` }), `${s.label}: `, el("b", {}, p ? fmt(p.value) : "–"));
        }));
      tip.setAttribute("data-t", bucket);
      tip.classList.remove("hidden");
      const left = x(bucket + stepMs / 2) / scale;
      tip.style.left = `${Math.min(left + 12, box.clientWidth - tip.offsetWidth - 4)}px`;
      tip.style.top = "12px";
    });
    hit.addEventListener("mouseleave", () => { tip.classList.add("hidden"); cursor.classList.add("hidden"); });
  }

  /// A small line of the last values (e.g. a queue's dequeue rate).
  function sparkline(values, label) {
    const w = 110, h = 24, max = Math.max(1e-9, ...values);
    const points = values.map((v, i) => `${((i / Math.max(1, values.length - 1)) * (w - 2) + 1).toFixed(1)},${(h - 2 - (v / max) * (h - 4)).toFixed(1)}`).join(" ");
    return el("svg:svg", { class: "spark", viewBox: `0 0 ${w} ${h}`, "aria-label": label },
      el("svg:polyline", { points, fill: "none", stroke: COLOURS[0], "stroke-width": 1.5 }));
  }

  /// Counts older than this are flagged stale.
  const STALE_MS = 5000;

  /// How fresh the answers drawn are: the shards they read (each at the offset
  /// applied) and the largest lag, flagged stale past STALE_MS.
  function asOfNote(answers) {
    const shards = new Map();
    for (const a of answers.flatMap((answer) => answer.as_of || [])) {
      const known = shards.get(a.shard);
      if (!known || a.applied < known.applied) shards.set(a.shard, a);
    }
    const listed = [...shards.values()].sort((a, b) => a.shard - b.shard);
    const lags = listed.map((a) => a.lag_ms);
    const known = lags.length > 0 && lags.every((lag) => lag !== null && lag !== undefined);
    const lag = known ? Math.max(...lags) : null;
    const stale = known && lag > STALE_MS;
    const text = !known ? "freshness not known" : stale ? `stale: up to ${(lag / 1000).toFixed(1)} s behind` : `fresh: up to ${fmt(lag)} ms behind`;
    return el("small", { class: `as-of${stale || !known ? " stale" : ""}`, "data-lag-ms": known ? lag : "",
      "data-applied": JSON.stringify(listed.map((a) => [a.shard, a.applied])) }, text);
  }

  /// The freshness indicator: how much newer input the counts may miss, how many
  /// shards serve, when.
  async function freshness(box) {
    try {
      const status = await api("/v1/status");
      const all = status.shards.length;
      const known = status.lag_ms !== null && status.lag_ms !== undefined;
      const stale = known && status.lag_ms > STALE_MS;
      const level = status.serving < all ? "bad" : !known || stale ? "warn" : "ok";
      const said = !known ? "freshness not known yet"
        : stale ? `stale: up to ${(status.lag_ms / 1000).toFixed(1)} s behind`
        : `fresh: up to ${fmt(status.lag_ms)} ms behind`;
      box.replaceChildren(el("span", { class: `dot ${level}` }),
        el("span", { id: "lag", "data-lag-ms": known ? status.lag_ms : "", "data-lag": status.lag ?? "" }, said),
        ` · ${status.serving}/${all} shards serving · updated ${time(status.at_ms)}`);
    } catch (err) {
      box.replaceChildren(el("span", { class: "dot bad" }), `status unavailable: ${err.message}`);
    }
  }

  return { $, el, api, ApiError, askToken, enc, fmt, time, lineChart, sparkline, freshness, asOfNote, COLOURS };
})();
