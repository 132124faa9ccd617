// atomd dashboard: reads the control API (/v1) of the daemon that serves it, every 2 s, and
// draws the swarm, the selected job's curves (inline SVG), its sync rounds and recent events.
// No dependencies, no build step. The control token (when the daemon has one) comes from the
// URL fragment (#token=..., never sent to a server) or the form, is kept in sessionStorage
// and sent only as "Authorization: Bearer".
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "atomd.token";
const COLORS = ["#2f5fd0", "#d0542f", "#1a9c6b", "#9b3fd0", "#c99a06", "#0a8fb5", "#d03f86",
  "#5d6b1f"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = { jobId: null, userPicked: false, timer: null, colors: new Map() };

// -- small DOM helpers (text only: nothing from the API is parsed as HTML) ------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}
const $ = (id) => document.getElementById(id);
const short = (id) => (id ? String(id).slice(0, 8) : "?");
function fmt(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 1e4) return Intl.NumberFormat("en", { notation: "compact" }).format(x);
  if (Math.abs(x) >= 100) return String(Math.round(x));
  const text = Number(x).toPrecision(digits);
  return text.includes(".") && !text.includes("e") ? text.replace(/\.?0+$/, "") : text;
}
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}
function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 2) return "now";
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}
function pill(text) {
  return el("span", { class: `pill s-${text}` }, text);
}
function colorOf(peerId) {
  if (!state.colors.has(peerId)) state.colors.set(peerId, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(peerId);
}

// -- the token and the API ------------------------------------------------------------------
function takeTokenFromFragment() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search); // out of the URL bar
  }
}
class Unauthorized extends Error {}
async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const r = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  if (r.status === 401) throw new Unauthorized("the control token is missing or wrong");
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(`${path}: ${r.status} ${detail}`);
  }
  return r.json();
}

// -- charts ---------------------------------------------------------------------------------
const W = 600, H = 230, PAD = { l: 48, r: 10, t: 10, b: 26 };
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const step0 = (hi - lo) / n;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0) || step0;
  const out = [];
  // At most 2n + 1: where the range is below the numbers' precision (a peer's curve may hold
  // two losses one ulp apart), v += step no longer moves v.
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9 && out.length <= 2 * n;
    v += step) out.push(v);
  return out;
}
function drawChart(box, series, opts) {
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart-svg", role: "img",
    "aria-label": opts.label });
  const pts = series.flatMap((s) => s.points);
  if (pts.length === 0) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = opts.empty || "no data yet";
    root.append(t);
    box.replaceChildren(root);
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x1 === x0) { x1 = x0 + 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const padY = (y1 - y0) * 0.05; y0 -= padY; y1 += padY;
  if (opts.zero && y0 < 0) y0 = 0;
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0)) * (W - PAD.l - PAD.r);
  const sy = (y) => H - PAD.b - ((y - y0) / (y1 - y0)) * (H - PAD.t - PAD.b);
  for (const v of niceTicks(y0, y1, 4)) {
    if (v < y0 || v > y1) continue;
    root.append(svg("line", { x1: PAD.l, x2: W - PAD.r, y1: sy(v), y2: sy(v), class: "axis" }));
    const t = svg("text", { x: PAD.l - 6, y: sy(v) + 4, "text-anchor": "end" });
    t.textContent = fmt(v);
    root.append(t);
  }
  for (const v of niceTicks(x0, x1, 5)) {
    if (v < x0 || v > x1) continue;
    const t = svg("text", { x: sx(v), y: H - 8, "text-anchor": "middle" });
    t.textContent = fmt(v);
    root.append(t);
  }
  root.append(svg("line", { x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b, class: "axis" }));
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`)
      .join("");
    const path = svg("path", { d, class: "series", stroke: s.color, "data-peer": s.peer,
      "data-points": String(s.points.length) });
    const title = svg("title", {});
    title.textContent = s.name;
    path.append(title);
    root.append(path);
    if (opts.markers || s.points.length === 1) {
      for (const p of s.points) {
        root.append(svg("circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 2.5,
          fill: s.color }));
      }
    }
  }
  const xl = svg("text", { x: W - PAD.r, y: H - 8 - 12, "text-anchor": "end" });
  xl.textContent = "step";
  root.append(xl);
  box.replaceChildren(root);
}

// -- sections -------------------------------------------------------------------------------
function renderStatus(status) {
  const up = status.uptime_s < 3600 ? `${Math.round(status.uptime_s / 60)} min`
    : `${(status.uptime_s / 3600).toFixed(1)} h`;
  $("whoami").textContent = `peer ${short(status.peer_id)} · v${status.version} · ` +
    `${status.device} · swarm “${status.swarm}” · up ${up}`;
}

function renderPeers(peers) {
  const rows = peers.map((p) => el("tr", { "data-peer": p.id },
    el("td", { title: p.id }, el("code", {}, short(p.id)), p.is_self ? " (this daemon)" : ""),
    el("td", {}, pill(p.state)),
    el("td", { class: "num" }, p.is_self ? "–" : p.rtt_ms === null ? "–" : `${fmt(p.rtt_ms)} ms`),
    el("td", {}, p.is_self ? "–" : ago(p.last_seen_at)),
    el("td", { title: p.excluded_reason || "" }, p.excluded ? pill(p.excluded) : "no",
      p.excluded_reason ? ` ${p.excluded_reason.slice(0, 60)}` : ""),
    el("td", {}, el("code", {}, p.url))));
  $("peers").tBodies[0].replaceChildren(...rows);
  const alive = peers.filter((p) => p.state === "alive").length;
  const excluded = peers.filter((p) => p.excluded).length;
  $("swarm-summary").textContent = `${peers.length} known, ${alive} alive` +
    (excluded ? `, ${excluded} excluded` : "");
}

function renderJobSelect(jobs) {
  const sel = $("job-select");
  const current = state.jobId;
  sel.replaceChildren(...jobs.map((j) => el("option", { value: j.id },
    `${short(j.id)} · ${j.spec.preset || "?"} · ${j.state}`)));
  if (current) sel.value = current;
}

function pickJob(jobs, status) {
  if (state.userPicked && jobs.some((j) => j.id === state.jobId)) return state.jobId;
  if (status.job) return status.job.id;
  return jobs.length ? jobs[0].id : null;
}

function stat(label, value) {
  return el("div", { class: "stat" }, el("b", {}, value), el("span", {}, label));
}

function renderJob(job, curves) {
  const self = curves.peers.find((p) => p.is_self) || { points: [] };
  const last = self.points[self.points.length - 1];
  const maxSteps = job.spec.max_steps;
  const sync = job.sync || {};
  $("job-stats").replaceChildren(
    stat("state", pill(job.state)),
    stat("step", maxSteps ? `${job.step} / ${maxSteps}` : String(job.step)),
    stat("tokens", fmt(job.tokens)),
    stat("loss", fmt(job.loss, 4)),
    stat("val loss", fmt(job.val_loss, 4)),
    stat("tokens/s", last ? fmt(last.tokens_per_s) : "–"),
    stat("scope", job.scope + (job.origin ? ` · from ${short(job.origin)}` : "")),
    stat("cadence", sync.every ? `${sync.every} steps/round` : "–"),
    stat("peers training", String(curves.peers.length + (curves.left_out || 0))));
  const bar = $("job-bar");
  bar.hidden = !maxSteps;
  if (maxSteps) bar.firstElementChild.style.width = `${Math.min(100, (100 * job.step) / maxSteps)}%`;
  $("job-reason").textContent = job.reason || "";

  const series = (key) => curves.peers.map((p) => ({
    peer: p.peer_id, color: colorOf(p.peer_id),
    name: `${short(p.peer_id)}${p.is_self ? " (this daemon)" : ""}`,
    points: p.points.filter((q) => q[key] !== null && q[key] !== undefined)
      .map((q) => [q.step, q[key]]),
  }));
  drawChart($("chart-loss"), series("loss"), { label: "training loss per peer" });
  drawChart($("chart-val"), series("val_loss"), { label: "validation loss per peer",
    markers: true, empty: "no evaluation yet" });
  drawChart($("chart-tps"), series("tokens_per_s"), { label: "tokens per second per peer",
    zero: true });
  $("legend").replaceChildren(...curves.peers.map((p) => el("span", {},
    el("i", { "data-color": colorOf(p.peer_id) }), short(p.peer_id),
    p.is_self ? " (this daemon)" : "")));
  for (const i of $("legend").querySelectorAll("i")) i.style.background = i.dataset.color;
  const errors = curves.peers.filter((p) => p.error)
    .map((p) => `${short(p.peer_id)}: ${p.error}`);
  const missing = errors.length ? `Curves missing: ${errors.join("; ")}` : "";
  const notAsked = curves.left_out ? `${curves.left_out} more peers train it (not shown).` : "";
  $("curve-errors").textContent = [missing, notAsked].filter(Boolean).join(" ");
}

// "peer URL: POST /p2p/v1/jobs/ID/deltas answered 404: why" -> "404: why"
function shortReason(reason) {
  const text = reason.replace(/^peer \S+: (?:GET|POST) \S+ (?:answered )?/, "");
  return text.length > 70 ? `${text.slice(0, 69)}…` : text;
}

function renderRounds(rounds) {
  const sent = rounds.filter((r) => r.direction === "sent");
  const recv = rounds.filter((r) => r.direction === "received");
  const refused = recv.filter((r) => !r.applied);
  const sum = (xs) => xs.reduce((a, r) => a + r.bytes, 0);
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
  const stale = recv.map((r) => r.staleness).filter((s) => s !== null);
  const every = rounds.map((r) => r.every).filter((e) => e !== null);
  // Cadence in time: the mean gap between this daemon's sent rounds.
  const times = sent.map((r) => Date.parse(r.at)).sort((a, b) => a - b);
  const gaps = times.slice(1).map((t, i) => (t - times[i]) / 1000);
  $("round-stats").replaceChildren(
    stat("sent", `${sent.length} · ${bytes(sum(sent))}`),
    stat("received", `${recv.length} · ${bytes(sum(recv))}`),
    stat("compression", rounds.length
      ? `${fmt(mean(rounds.map((r) => r.compression_ratio)))}×` : "–"),
    stat("cadence", every.length ? `${fmt(mean(every))} steps` +
      (gaps.length ? ` · ${fmt(mean(gaps))} s` : "") : "–"),
    stat("staleness (mean)", stale.length ? fmt(mean(stale)) : "–"),
    stat("refused", String(refused.length)));
  $("rounds-summary").textContent = rounds.length ? `newest ${rounds.length}` : "none yet";
  $("round-table").tBodies[0].replaceChildren(...rounds.slice(0, 25).map((r) => el("tr", {},
    el("td", { class: "num" }, r.round),
    el("td", {}, r.direction === "sent" ? "→ sent" : "← recv"),
    el("td", { title: r.peer_id }, el("code", {}, short(r.peer_id))),
    el("td", { class: "num" }, bytes(r.bytes)),
    el("td", {}, r.codec),
    el("td", { class: "num" }, `${fmt(r.compression_ratio)}×`),
    el("td", { class: "num" }, r.staleness === null ? "–" : r.staleness),
    el("td", { class: "num" }, r.every === null ? "–" : r.every),
    el("td", { title: r.reason || "" }, pill(r.applied ? "yes" : "no"),
      r.reason ? ` ${shortReason(r.reason)}` : ""))));
}

function renderEvents(events) {
  $("event-list").replaceChildren(...events.map((e) => el("li", {},
    el("time", { datetime: e.at, title: e.at }, ago(e.at)),
    el("span", { class: "kind" }, e.kind), e.message)));
}

// -- the loop -------------------------------------------------------------------------------
function setLive(ok, text) {
  const live = $("live");
  live.className = `live ${ok ? "ok" : "bad"}`;
  live.textContent = text;
}

async function refresh() {
  const [status, peers, jobs, events] = await Promise.all([
    api("/v1/status"), api("/v1/peers"), api("/v1/jobs"), api("/v1/events?limit=40")]);
  $("login").hidden = true;
  $("main").hidden = false;
  renderStatus(status);
  renderPeers(peers);
  renderEvents(events);
  state.jobId = pickJob(jobs, status);
  renderJobSelect(jobs);
  $("no-job").hidden = state.jobId !== null;
  $("job-body").hidden = state.jobId === null;
  $("rounds").hidden = state.jobId === null;
  if (state.jobId !== null) {
    const id = encodeURIComponent(state.jobId);
    const [job, curves, rounds] = await Promise.all([
      api(`/v1/jobs/${id}`), api(`/v1/jobs/${id}/curves`), api(`/v1/jobs/${id}/rounds?limit=200`)]);
    renderJob(job, curves);
    renderRounds(rounds);
  }
}

async function tick() {
  clearTimeout(state.timer);
  try {
    await refresh();
    setLive(true, `live · ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if (e instanceof Unauthorized) {
      $("main").hidden = true;
      $("login").hidden = false;
      $("login-error").textContent = sessionStorage.getItem(TOKEN_KEY) ? e.message : "";
      setLive(false, "token needed");
      return; // wait for the form
    }
    setLive(false, `not updated: ${e.message}`);
  }
  if (!document.hidden) state.timer = setTimeout(tick, POLL_MS);
}

function start() {
  takeTokenFromFragment();
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const token = $("token").value.trim();
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    $("token").value = "";
    tick();
  });
  $("job-select").addEventListener("change", (ev) => {
    state.jobId = ev.target.value;
    state.userPicked = true;
    tick();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) tick(); });
  window.addEventListener("hashchange", () => { takeTokenFromFragment(); tick(); });
  tick();
}

document.addEventListener("DOMContentLoaded", start);
