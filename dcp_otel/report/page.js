// dcp-otel report: draws each checkpoint's timeline from the data embedded in the page (no library, works offline).
// Lanes: one rank each; bands: alike ranks folded together (their spread as a range; click to expand).
// A click on a bar shows the span; the search box filters lanes and checkpoints; the wheel zooms, a drag pans,
// a double click resets; the compare view sets two checkpoints side by side. See dcp_otel/report/page_data.py.
"use strict";
const data = JSON.parse(document.getElementById("report-data").textContent);
const colors = {operation: "#8ab8ff", io: "#3274d9", upload: "#a78bfa", other: "#73bf69", stall: "#e0b400", collective: "#b7bcc4"};
const NS = "http://www.w3.org/2000/svg";
const WIDTH = 1100, ROW = 14;
const views = {};      // checkpoint index -> [t0, t1] in ms, the time window shown
const expanded = {};   // checkpoint index -> Set of band numbers shown as lanes
let query = null;      // the parsed search, or null

function el(name, attrs, parent) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}
function niceStep(total, ticks) {  // 1, 2 or 5 times a power of ten, giving at least `ticks` ticks
  const raw = total / ticks, power = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [5, 2, 1]) if (m * power <= raw) return m * power;
  return power / 2;
}
function rankRanges(ranks) {  // [0, 1, 2, 5] -> "0-2,5"
  const parts = [];
  let start = null, prev = null;
  for (const r of ranks) {
    if (prev !== null && r === prev + 1) { prev = r; continue; }
    if (start !== null) parts.push(start === prev ? `${start}` : `${start}-${prev}`);
    start = prev = r;
  }
  if (start !== null) parts.push(start === prev ? `${start}` : `${start}-${prev}`);
  return parts.join(",");
}
const row = {rank: 0, name: 1, depth: 2, start: 3, dur: 4, kind: 5, error: 6, attrs: 7, id: 8, exception: 9};
const nameOf = s => data.names[s[row.name]];
const kindOf = s => data.kinds[s[row.kind]];

// --- search ---------------------------------------------------------------------------------
function parseQuery(text) {
  const q = text.trim().toLowerCase();
  if (!q) return null;
  const rank = q.match(/^rank\s+(\d+)$/);
  if (rank) return {rank: Number(rank[1])};
  if (["failed", "failure", "error", "errors"].includes(q)) return {status: "failed"};
  if (["unfinished", "interrupted", "stalled", "hung"].includes(q)) return {status: "unfinished"};
  if (["ok", "success"].includes(q)) return {status: "ok"};
  return {text: q};
}
function spanText(ckpt, s) {
  const own = s[row.attrs] >= 0 ? JSON.stringify(data.attrs[s[row.attrs]]) : "";
  const error = s[row.error] >= 0 ? data.strings[s[row.error]] : "";
  return `${nameOf(s)} ${error} ${own} rank ${s[row.rank]}`.toLowerCase();
}
// The ranks of `ckpt` the search keeps (null: keep the checkpoint as it is; an empty set: hide it).
function matchingRanks(ckpt) {
  if (query === null) return null;
  const ranks = new Set();
  if (query.rank !== undefined) {
    if (ckpt.spans.some(s => s[row.rank] === query.rank)) ranks.add(query.rank);
    return ranks;
  }
  if (query.status === "ok") return ckpt.status === "ok" ? null : ranks;
  if (query.status === "unfinished") { ckpt.unfinished.forEach(r => ranks.add(r)); return ranks; }
  if (query.status === "failed") {
    for (const s of ckpt.spans) if (s[row.error] >= 0) ranks.add(s[row.rank]);
    return ranks;
  }
  const common = `${ckpt.operation} ${ckpt.id} ${ckpt.status} ${JSON.stringify(data.attrs[ckpt.common])}`.toLowerCase();
  if (common.includes(query.text)) return null;
  for (const s of ckpt.spans) if (spanText(ckpt, s).includes(query.text)) ranks.add(s[row.rank]);
  return ranks;
}

// --- a timeline -----------------------------------------------------------------------------
// A search keeps the page folded: at most MATCH_LANES matching ranks become lanes (those worth reading first,
// then the lowest), the other matches stay in their bands, which a click unfolds as ever.
const MATCH_LANES = 24;
function rowsToShow(ckpt) {  // [{kind: "lane", rank} | {kind: "band", band, number}]
  const matches = matchingRanks(ckpt);
  const open = expanded[ckpt.index] || new Set();
  if (matches !== null) {
    const sorted = [...matches].sort((a, b) => a - b);
    const chosen = new Set(ckpt.lanes.filter(r => matches.has(r)).slice(0, MATCH_LANES));
    for (const r of sorted) { if (chosen.size >= MATCH_LANES) break; chosen.add(r); }
    ckpt.bands.forEach((band, n) => { if (open.has(n)) band.ranks.forEach(r => { if (matches.has(r)) chosen.add(r); }); });
    const rows = [...chosen].sort((a, b) => a - b).map(rank => ({kind: "lane", rank}));
    ckpt.bands.forEach((band, n) => {
      if (band.ranks.some(r => matches.has(r) && !chosen.has(r))) rows.push({kind: "band", band, number: n});
    });
    return rows;
  }
  const lanes = new Set(ckpt.lanes);
  ckpt.bands.forEach((band, n) => { if (open.has(n)) band.ranks.forEach(r => lanes.add(r)); });
  const rows = [...lanes].sort((a, b) => a - b).map(rank => ({kind: "lane", rank}));
  ckpt.bands.forEach((band, n) => { if (!open.has(n)) rows.push({kind: "band", band, number: n}); });
  return rows;
}
function draw(ckpt) {
  const host = document.getElementById("timeline-" + ckpt.index);
  if (!host) return;
  host.dataset.drawn = "1";
  host.replaceChildren();
  const [t0, t1] = views[ckpt.index] || [0, Math.max(ckpt.duration_ms, 1e-6)];
  const rows = rowsToShow(ckpt);
  const byRank = new Map();
  for (const s of ckpt.spans) {
    if (!byRank.has(s[row.rank])) byRank.set(s[row.rank], []);
    byRank.get(s[row.rank]).push(s);
  }
  const depth = Math.max(1, ...ckpt.spans.map(s => s[row.depth] + 1));
  const laneHeight = depth * ROW + 8;
  const zoom = document.createElement("div");
  zoom.className = "zoom";
  zoom.innerHTML = '<button data-zoom="in">+</button> <button data-zoom="out">&minus;</button> ' +
    '<button data-zoom="reset">reset</button> <span>wheel: zoom, drag: pan, double click: reset</span>';
  host.appendChild(zoom);
  const svg = el("svg", {class: "timeline", width: WIDTH, height: rows.length * laneHeight + 34}, host);
  const labels = rows.map((r, i) => {
    const lane = r.kind === "lane";
    const origin = lane && ckpt.origins.includes(r.rank);
    const cls = lane ? "lane" + (r.rank === ckpt.straggler ? " straggler" : "") + (origin ? " failed-origin" : "") : "band";
    const g = el("g", {class: cls, ...(lane ? {"data-rank": r.rank} : {"data-band": r.number})}, svg);
    el("rect", {class: "lane-bg", x: 0, y: 4 + i * laneHeight, width: WIDTH, height: laneHeight,
                fill: i % 2 ? "#fff" : "#f6f7f9"}, g);
    const text = el("text", {class: "lane-label" + (lane ? "" : " band-label"), x: 6, y: 4 + i * laneHeight + 14}, g);
    const marks = lane ? [origin ? "failed here" : "", r.rank === ckpt.straggler ? "straggler" : ""].filter(Boolean) : [];
    text.textContent = lane ? "rank " + r.rank + (marks.length ? ` (${marks.join(", ")})` : "")
                            : `▸ ranks ${rankRanges(r.band.ranks)} (${r.band.ranks.length})`;
    if (!lane) text.addEventListener("click", () => {
      (expanded[ckpt.index] = expanded[ckpt.index] || new Set()).add(r.number);
      draw(ckpt);
    });
    return [g, text];
  });
  // Labels first, measured, so the bars start after the longest one: never clipped.
  const label = 16 + Math.max(40, ...labels.map(([, t]) => t.getComputedTextLength()));
  const scale = (WIDTH - label - 16) / Math.max(t1 - t0, 1e-6);
  const x = t => label + (t - t0) * scale;
  const visible = (start, end) => end >= t0 && start <= t1;
  const clip = el("clipPath", {id: "clip-" + ckpt.index}, svg);
  el("rect", {x: label, y: 0, width: WIDTH - label - 16, height: rows.length * laneHeight + 10}, clip);
  rows.forEach((r, i) => {
    const y0 = 4 + i * laneHeight, g = el("g", {"clip-path": `url(#clip-${ckpt.index})`}, labels[i][0]);
    if (r.kind === "lane") {
      for (const s of byRank.get(r.rank) || []) {
        if (!visible(s[row.start], s[row.start] + s[row.dur])) continue;
        const error = s[row.error] >= 0;
        const rect = el("rect", {
          class: "bar " + kindOf(s) + (error ? " error" : ""), "data-name": nameOf(s), "data-span-id": s[row.id],
          // A failed span is never thinner than a few pixels: the outline of the failure must be findable.
          x: x(s[row.start]), y: y0 + 4 + s[row.depth] * ROW, width: Math.max(error ? 4 : 1, s[row.dur] * scale),
          height: ROW - 2, fill: colors[kindOf(s)]}, g);
        el("title", {}, rect).textContent = `rank ${r.rank} ${nameOf(s)}: ${s[row.dur].toFixed(2)} ms` +
          (error ? " (failed: " + data.strings[s[row.error]] + ")" : "") + " — click for its attributes";
      }
    } else {  // a band: per step, its ranks' spread (light) and median (dark)
      const members = new Set(r.band.ranks), steps = new Map();
      for (const s of ckpt.spans) {
        if (!members.has(s[row.rank])) continue;
        const key = s[row.name] + "/" + s[row.depth];
        if (!steps.has(key)) steps.set(key, {depth: s[row.depth], name: nameOf(s), starts: [], ends: []});
        steps.get(key).starts.push(s[row.start]);
        steps.get(key).ends.push(s[row.start] + s[row.dur]);
      }
      for (const step of steps.values()) {
        const starts = step.starts.sort((a, b) => a - b), ends = step.ends.sort((a, b) => a - b);
        const lo = starts[0], hi = ends[ends.length - 1];
        if (!visible(lo, hi)) continue;
        const y = y0 + 4 + step.depth * ROW;
        const range = el("rect", {class: "band-range", x: x(lo), y, width: Math.max(1, (hi - lo) * scale), height: ROW - 2}, g);
        el("title", {}, range).textContent = `${step.name}, ${starts.length} ranks: ${lo.toFixed(1)} to ${hi.toFixed(1)} ms`;
        const a = starts[starts.length >> 1], b = ends[ends.length >> 1];
        el("rect", {class: "band-median", x: x(a), y: y + 3, width: Math.max(1, (b - a) * scale), height: ROW - 8}, g);
      }
    }
  });
  const axisY = rows.length * laneHeight + 8, step = niceStep(t1 - t0, 5);
  for (let t = Math.ceil(t0 / step) * step; t <= t1 + 1e-9; t += step) {
    el("line", {class: "tick-line", x1: x(t), x2: x(t), y1: 4, y2: axisY + 4}, svg);
    const tick = el("text", {class: "tick", x: x(t), y: axisY + 18, "text-anchor": "middle"}, svg);
    tick.textContent = (step < 1 ? t.toFixed(1) : t.toFixed(0)) + " ms";
  }
  interact(ckpt, svg, zoom, label, scale, t0, t1);
}

// --- zoom and pan ---------------------------------------------------------------------------
function setView(ckpt, t0, t1) {
  const full = Math.max(ckpt.duration_ms, 1e-6), span = Math.min(full, Math.max(t1 - t0, full / 10000));
  const start = Math.min(Math.max(0, t0), full - span);
  views[ckpt.index] = [start, start + span];
  draw(ckpt);
}
function interact(ckpt, svg, zoom, label, scale, t0, t1) {
  const timeAt = px => t0 + (px - label) / scale;
  const around = (factor, center) => setView(ckpt, center - (center - t0) * factor, center + (t1 - center) * factor);
  zoom.addEventListener("click", e => {
    const what = e.target.dataset && e.target.dataset.zoom;
    if (what === "in") around(0.5, (t0 + t1) / 2);
    else if (what === "out") around(2, (t0 + t1) / 2);
    else if (what === "reset") { delete views[ckpt.index]; draw(ckpt); }
  });
  svg.addEventListener("wheel", e => {
    e.preventDefault();
    around(e.deltaY < 0 ? 0.8 : 1.25, timeAt(e.offsetX));
  }, {passive: false});
  let drag = null;
  svg.addEventListener("mousedown", e => { drag = {x: e.clientX, moved: false}; });
  svg.addEventListener("mousemove", e => {
    if (drag && Math.abs(e.clientX - drag.x) > 3) drag.moved = true;
  });
  svg.addEventListener("mouseup", e => {
    if (drag && drag.moved) { const dt = (drag.x - e.clientX) / scale; setView(ckpt, t0 + dt, t1 + dt); }
    drag = null;
  });
  svg.addEventListener("click", e => {  // (after a drag the timeline was redrawn: this svg is gone)
    const bar = e.target.closest("[data-span-id]");
    if (bar) showSpan(ckpt, bar.dataset.spanId);
  });
  svg.addEventListener("dblclick", () => { delete views[ckpt.index]; draw(ckpt); });
}

// --- a span's details -------------------------------------------------------------------------
function showSpan(ckpt, spanId) {
  const s = ckpt.spans.find(x => x[row.id] === spanId);
  if (!s) return;
  document.querySelectorAll("rect.bar.selected").forEach(b => b.classList.remove("selected"));
  document.querySelectorAll(`rect.bar[data-span-id="${spanId}"]`).forEach(b => b.classList.add("selected"));
  const attributes = {...data.attrs[ckpt.common], "dcp.rank": s[row.rank], ...(s[row.attrs] >= 0 ? data.attrs[s[row.attrs]] : {})};
  const panel = document.getElementById("span-details");
  panel.replaceChildren();
  const add = (tag, text, parent = panel) => { const n = document.createElement(tag); n.textContent = text; parent.appendChild(n); return n; };
  const close = add("button", "×");
  close.className = "close";
  close.addEventListener("click", () => { panel.hidden = true; });
  add("h3", "dcp." + nameOf(s));
  const table = document.createElement("table");
  const line = (k, v) => {  // a value of several lines (a stack) keeps its lines, wrapped
    const tr = table.insertRow();
    tr.insertCell().textContent = k;
    const cell = tr.insertCell();
    if (String(v).includes("\n")) add("pre", String(v), cell); else cell.textContent = v;
  };
  line("status", s[row.error] >= 0 ? "ERROR: " + data.strings[s[row.error]] : "OK");
  line("rank", s[row.rank]);
  line("start", `+${s[row.start].toFixed(3)} ms`);
  line("duration", `${s[row.dur].toFixed(3)} ms`);
  line("trace id", ckpt.trace);
  line("span id", s[row.id]);
  for (const [k, v] of Object.entries(attributes).sort()) line(k, typeof v === "object" ? JSON.stringify(v) : String(v));
  panel.appendChild(table);
  table.className = "attributes";
  if (s[row.exception] >= 0) {
    add("h4", "exception");
    add("pre", data.strings[s[row.exception]]).className = "exception";
  }
  if (data.traceUrl) {
    const a = add("a", "open this trace");
    a.id = "trace-link";
    a.href = data.traceUrl.replaceAll("{trace_id}", ckpt.trace).replaceAll("{span_id}", s[row.id]);
    a.target = "_blank";
  }
  panel.hidden = false;
}

// --- compare two checkpoints ------------------------------------------------------------------
// Always the newer minus the older, whichever was picked first, and said in words: "+16.019 s" means the
// newer took longer. Ranks are ordered by the change in their busy time (their own work), not in their
// total, which every rank waiting for a straggler shares.
function fmt(seconds) { return seconds.toFixed(3) + " s"; }
function change(older, newer) {
  const d = newer - older;
  return `${d >= 0 ? "+" : ""}${d.toFixed(3)} s` + (older > 0 ? ` (${(newer / older).toFixed(2)}x)` : "");
}
function bytes(n) {  // as the report's tables say sizes: powers of 1024, named so
  let size = n;
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (size < 1024) return unit === "B" ? `${size.toFixed(0)} B` : `${size.toFixed(1)} ${unit}`;
    size /= 1024;
  }
  return `${size.toFixed(1)} TiB`;
}
function compare() {
  const picked = ["compare-a", "compare-b"].map(id => data.checkpoints[Number(document.getElementById(id).value)]);
  const out = document.getElementById("compare-result");
  out.replaceChildren();
  if (!picked[0] || !picked[1]) return;
  const [a, b] = picked[0].index <= picked[1].index ? picked : [picked[1], picked[0]];  // a: the older
  const steps = new Map();
  for (const [name, median, max, rank] of a.steps) steps.set(name, {name, a: {median, max, rank}});
  for (const [name, median, max, rank] of b.steps) steps.set(name, {...(steps.get(name) || {name}), b: {median, max, rank}});
  const none = {median: 0, max: 0, rank: null};  // a step one of the two did not run
  const rowsOfSteps = [...steps.values()].map(s => ({...s, a: s.a || none, b: s.b || none}))
    .sort((x, y) => Math.abs(y.b.max - y.a.max) - Math.abs(x.b.max - x.a.max));
  const table = (cls, head) => {
    const t = document.createElement("table");
    t.className = cls;
    const tr = t.insertRow();
    for (const h of head) { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); }
    out.appendChild(t);
    return t;
  };
  const [da, db] = [a.duration_ms / 1e3, b.duration_ms / 1e3];
  const h = document.createElement("p");
  h.className = "compare-headline";
  h.textContent = `#${b.index + 1} ${b.operation} ${b.id} (newer, ${fmt(db)}, ${b.status}) took ` +
    `${fmt(Math.abs(db - da))} ${db >= da ? "longer" : "less"} than #${a.index + 1} ${a.operation} ${a.id} ` +
    `(older, ${fmt(da)}, ${a.status}): ${change(da, db)}, newer minus older.`;
  out.appendChild(h);
  const stepsTable = table("compare-steps", ["step", "slowest rank, older", "slowest rank, newer", "change",
                                             "median, older", "median, newer", "change of the median"]);
  rowsOfSteps.forEach((s, i) => {
    const tr = stepsTable.insertRow();
    if (i === 0) tr.className = "changed-most";
    const slowest = x => x.rank === null ? "not run" : `${fmt(x.max)} (rank ${x.rank})`;
    for (const v of [s.name, slowest(s.a), slowest(s.b),
                     change(s.a.max, s.b.max), fmt(s.a.median), fmt(s.b.median), change(s.a.median, s.b.median)])
      tr.insertCell().textContent = v;
  });
  const ranksA = new Map(a.ranks.map(r => [r[0], r])), ranksB = new Map(b.ranks.map(r => [r[0], r]));
  const busyChange = r => Math.abs(ranksB.get(r)[2] - ranksA.get(r)[2]);
  const changed = [...ranksA.keys()].filter(r => ranksB.has(r)).sort((x, y) => busyChange(y) - busyChange(x) || x - y)
    .slice(0, 10);
  const ranksTable = table("compare-ranks", ["rank", "busy, older", "busy, newer", "change of busy", "total, older",
                                             "total, newer", "change", "bytes, older", "bytes, newer",
                                             "I/O MB/s, older", "I/O MB/s, newer"]);
  for (const r of changed) {
    const [ra, rb] = [ranksA.get(r), ranksB.get(r)];
    const tr = ranksTable.insertRow();
    for (const v of [r, fmt(ra[2]), fmt(rb[2]), change(ra[2], rb[2]), fmt(ra[1]), fmt(rb[1]), change(ra[1], rb[1]),
                     bytes(ra[4]), bytes(rb[4]), (ra[5] / 1e6).toFixed(1), (rb[5] / 1e6).toFixed(1)])
      tr.insertCell().textContent = v;
  }
}

// --- the page -----------------------------------------------------------------------------------
function sectionOf(ckpt) { return document.getElementById("checkpoint-" + ckpt.index); }
function applySearch() {
  query = parseQuery(document.getElementById("search").value);
  let shown = 0;
  for (const ckpt of data.checkpoints) {
    const section = sectionOf(ckpt);
    if (!section) continue;
    const matches = matchingRanks(ckpt);
    const hide = matches !== null && matches.size === 0;
    section.hidden = hide;
    if (!hide) shown += 1;
    const details = section.querySelector("details.ckpt");
    if (!hide && (!details || details.open)) draw(ckpt);
  }
  document.getElementById("search-count").textContent = query === null ? "" : `${shown} of ${data.checkpoints.length} checkpoints`;
}
for (const ckpt of data.checkpoints) {
  const section = sectionOf(ckpt);
  const details = section && section.querySelector("details.ckpt");
  if (!details || details.open) draw(ckpt);
  if (details) details.addEventListener("toggle", () => { if (details.open) draw(ckpt); });
}
document.getElementById("search").addEventListener("input", applySearch);
for (const id of ["compare-a", "compare-b"]) document.getElementById(id).addEventListener("change", compare);
compare();
document.body.setAttribute("data-rendered", String(data.checkpoints.length));
