// The job dashboard: polls the job's REST API (Flink's paths) once a second and
// draws the job graph, the checkpoint history and the latest checkpoint's subtasks
// with inline SVG. No framework, no build step.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let jid = null;

function el(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(n) {
  if (n >= 1e9) return (n / 1e9).toFixed(1) + "G";
  if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (n >= 1e4) return (n / 1e3).toFixed(0) + "k";
  return String(Math.round(n));
}

async function get(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function drawGraph(job) {
  const svg = document.getElementById("graph");
  svg.replaceChildren();
  const w = 190, h = 96, gap = 70;
  const defs = el("defs");
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8, markerHeight: 8, orient: "auto" });
  marker.append(el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#718096" }));
  defs.append(marker);
  svg.append(defs);
  const pos = {};
  job.vertices.forEach((v, i) => { pos[v.id] = { x: 10 + i * (w + gap), y: 20 }; });
  for (const node of job.plan.nodes) {
    for (const input of node.inputs) {
      const a = pos[input.id], b = pos[node.id];
      if (!a || !b) continue;
      svg.append(el("line", { x1: a.x + w, y1: a.y + h / 2, x2: b.x, y2: b.y + h / 2, stroke: "#718096", "marker-end": "url(#arrow)" }));
      svg.append(el("text", { x: (a.x + w + b.x) / 2, y: a.y + h / 2 - 6, "text-anchor": "middle", "font-size": 11, fill: "#718096" }, input.ship_strategy));
    }
  }
  for (const v of job.vertices) {
    const p = pos[v.id];
    const bp = v["backpressured-ms-per-second"] || 0;
    // Flink's colours: idle blue, backpressured towards red.
    const red = Math.min(1, bp / 1000);
    const fill = `rgb(${Math.round(220 + 35 * red)},${Math.round(235 - 150 * red)},${Math.round(250 - 170 * red)})`;
    const g = el("g", { class: "vertex", "data-id": v.id });
    g.append(el("rect", { x: p.x, y: p.y, width: w, height: h, rx: 6, fill, stroke: "#4a5568" }));
    g.append(el("text", { x: p.x + 10, y: p.y + 20, "font-weight": 600 }, `${v.id} ×${v.parallelism}`));
    g.append(el("text", { x: p.x + 10, y: p.y + 42, class: "rate" }, `${fmt(v["records-in-per-second"] || 0)} in/s · ${fmt(v["records-out-per-second"] || 0)} out/s`));
    g.append(el("text", { x: p.x + 10, y: p.y + 62, class: "backpressure" }, `backpressured ${Math.round(bp)} ms/s`));
    g.append(el("text", { x: p.x + 10, y: p.y + 82, "font-size": 11, fill: "#4a5568" }, `${fmt(v.metrics["read-records"])} in · ${fmt(v.metrics["write-records"])} out`));
    svg.append(g);
  }
  svg.setAttribute("viewBox", `0 0 ${Math.max(400, job.vertices.length * (w + gap))} 140`);
}

function drawChart(id, points) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  if (!points.length) return;
  const W = 300, H = 120, pad = 14;
  const max = Math.max(1, ...points.map(p => p.y));
  const x = i => pad + (points.length === 1 ? 0 : (i * (W - 2 * pad)) / (points.length - 1));
  const y = v => H - pad - (v / max) * (H - 2 * pad);
  svg.append(el("polyline", { points: points.map((p, i) => `${x(i)},${y(p.y)}`).join(" "), fill: "none", stroke: "#3182ce", "stroke-width": 1.5 }));
  points.forEach((p, i) => {
    const c = el("circle", { class: "point", cx: x(i), cy: y(p.y), r: 2.5, fill: p.failed ? "#c53030" : "#3182ce" });
    c.append(el("title", {}, `checkpoint ${p.id}: ${p.y}`));
    svg.append(c);
  });
  svg.append(el("text", { x: 4, y: 11, "font-size": 10, fill: "#718096" }, fmt(max)));
}

function drawHistory(cp) {
  const h = cp.history.filter(c => c.status !== "IN_PROGRESS").slice().reverse();
  const series = f => h.map(c => ({ id: c.id, y: f(c), failed: c.status === "FAILED" }));
  drawChart("chart-duration", series(c => c.end_to_end_duration));
  drawChart("chart-persisted", series(c => c.persisted_data));
  drawChart("chart-start-delay", series(c => c.start_delay || 0));
  drawChart("chart-alignment", series(c => c.alignment_duration || 0));
}

async function drawSubtasks(job, cp) {
  const latest = cp.latest.completed;
  const body = document.querySelector("#subtasks tbody");
  if (!latest) return;
  document.getElementById("latest-id").textContent = "#" + latest.id;
  const rows = [];
  for (const v of job.vertices) {
    const d = await get(`/jobs/${jid}/checkpoints/details/${latest.id}/subtasks/${encodeURIComponent(v.id)}`);
    for (const s of d.subtasks) {
      if (s.status !== "completed") continue;
      const tr = document.createElement("tr");
      for (const cell of [`${v.id}#${s.index}`, s.end_to_end_duration, s.start_delay, s.alignment.duration, fmt(s.alignment.persisted), fmt(s.state_size)]) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.append(td);
      }
      rows.push(tr);
    }
  }
  body.replaceChildren(...rows);
}

function drawExceptions(ex) {
  document.getElementById("restarts").textContent = `restarts: ${ex.numRestarts}`;
  const box = document.getElementById("exceptions");
  const entries = ex.exceptionHistory.entries;
  if (!entries.length) { box.innerHTML = '<p class="muted">no exceptions</p>'; return; }
  box.replaceChildren(...entries.slice(0, 5).map(e => {
    const pre = document.createElement("pre");
    pre.className = "exception";
    pre.textContent = `${new Date(e.timestamp).toISOString()} attempt ${e.attempt}: ${e.exceptionName}: ${e.message}`;
    return pre;
  }));
}

async function refresh() {
  try {
    if (!jid) jid = (await get("/jobs")).jobs[0].id;
    const [job, cp, ex] = await Promise.all([
      get(`/jobs/${jid}`), get(`/jobs/${jid}/checkpoints`), get(`/jobs/${jid}/exceptions`),
    ]);
    document.getElementById("name").textContent = job.name;
    const state = document.getElementById("state");
    state.textContent = job.state;
    state.className = job.state;
    document.getElementById("jid").textContent = jid;
    const c = cp.counts;
    document.getElementById("summary").textContent =
      `checkpoints: ${c.completed} completed · ${c.failed} failed · ${c.in_progress} in progress`;
    drawGraph(job);
    drawHistory(cp);
    drawExceptions(ex);
    await drawSubtasks(job, cp);
  } catch (err) {
    document.getElementById("summary").textContent = "disconnected: " + err.message;
  }
}

refresh();
setInterval(refresh, 1000);
