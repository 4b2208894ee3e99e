// The tray's panel in a browser, from the same /status contract.
// The wording follows tray_app/ui/viewmodel.py. Every text that comes from
// the server (model names, reasons, app names, answers) goes in through
// textContent, never innerHTML, so it can't become markup.
"use strict";

const POLL_MS = 1000;  // the tray's rate
const CSRF_COOKIE = "tray_app_csrf";
const ROUTE_REASONS = {
  admitted: "admitted", forced_cpu: "GPU paused (force CPU)", gpu_unavailable: "GPU unavailable",
  gpu_context_cap: "over the GPU context cap", gpu_vram_headroom: "not enough VRAM headroom", gpu_busy: "GPU busy",
  gpu_failed_replayed: "GPU failed, re-run on the CPU", gpu_yielded: "GPU given to another app",
  gpu_loading: "GPU model loading", peer: "sent to a peer", peer_failed_replayed: "peer failed, re-run on the CPU",
  gpu_failed_resumed: "GPU failed, answer continued on the CPU",
  peer_failed_resumed: "peer failed, answer continued on the CPU",
  cpu_cannot_read_images: "images need the GPU (the CPU has no projector)", cpu_only: "CPU only (no GPU path)",
};
const ROUTE_NAMES = {gpu: "GPU", gpu_queue: "GPU queue", cpu: "CPU", peer: "peer", reject: "refused"};
const GIVEN_STATES = ["given_away", "given_back_by_user"];
const MAX_APPS_SHOWN = 4;
const HISTORY_S = 300;  // the tray's "Last 5 minutes"
// A hidden page polls nothing; the charts' lines break across such a gap
// rather than drawing a straight line through minutes nobody measured.
const GAP_S = 5;
const LOG_LINES = 500;
const RENDER_EVERY_MS = 100;
const SVG = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
let lastStatus = null;
let pollTimer = null;

// ----- formatting, as viewmodel.py ---------------------------------------------------

function num(value) { return typeof value === "number" && Number.isFinite(value) ? value : null; }

function fmtMib(value, scale) {
  if (value === null || value === undefined) return "unknown";
  const ref = scale === undefined || scale === null ? value : scale;
  if (Math.abs(ref) >= 10 * 1024) return `${(value / 1024).toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1})} GiB`;
  return `${Math.round(value).toLocaleString("en-US")} MiB`;
}

function fmtSeconds(value) {
  if (value === null || value === undefined) return "unknown";
  if (value < 10) return `${value.toFixed(1)} s`;
  if (value < 120) return `${Math.round(value)} s`;
  return `${Math.round(value / 60)} min`;
}

function ordinal(n) {
  const suffix = (n % 100 >= 10 && n % 100 <= 20) ? "th" : ({1: "st", 2: "nd", 3: "rd"}[n % 10] || "th");
  return `${n}${suffix}`;
}

function reasonInWords(reason) {
  if (!reason) return "";
  const at = reason.indexOf(": ");
  if (at > 0 && ROUTE_REASONS[reason.slice(0, at)]) return `${ROUTE_REASONS[reason.slice(0, at)]}: ${reason.slice(at + 2)}`;
  return reason;
}

// A route reason code in words; an unknown code without its underscores (core/route_reasons.py).
function reasonText(code) {
  if (!code) return "";
  return ROUTE_REASONS[code] || String(code).replaceAll("_", " ");
}

function sentence(text) { return text.charAt(0).toUpperCase() + text.slice(1); }

function timeLeftText(request) {
  const estimate = num(request.estimated_latency_s);
  if (estimate === null) return "";
  const left = estimate - (num(request.age_s) || 0);
  if (left >= 0.5) return `about ${fmtSeconds(left)} left`;
  if (left > -0.5) return "due now";
  return `overdue by ${fmtSeconds(-left)}`;
}

function requestLine(request) {
  const path = String(request.path || "?");
  let where;
  if (request.state === "queued" && request.queue_position) {
    where = `${ordinal(request.queue_position)} in the ${path === "cpu" ? "CPU" : "GPU"} queue`;
  } else if (request.state === "running" && path === "peer") {
    where = `running on peer ${request.peer || "?"}`;
  } else if (request.state === "running") {
    where = `running on the ${path.toUpperCase()}`;
  } else {
    where = String(request.state || "?");
  }
  const parts = [String(request.client || request.id), where];
  const left = timeLeftText(request);
  if (left) parts.push(left);
  const age = num(request.age_s);
  if (age !== null) parts.push(`${fmtSeconds(age)} old`);
  return parts.join(" · ");
}

function workers(status) {
  const byRole = {};
  for (const w of status.workers || []) byRole[w.role] = w;
  return byRole;
}

function residencyState(status) { return ((status.gpu || {}).residency || {}).state || null; }

function stateTitle(status) {
  const service = status.service || {};
  const roles = workers(status);
  if (!service.healthy) {
    return Object.values(roles).some((w) => ["starting", "stopping"].includes(w.state)) ? "Starting" : "Down";
  }
  if (!roles.gpu) return "Serving on the CPU";
  if ((status.degraded || {}).active) return "Degraded: the CPU is serving";
  if (residencyState(status) === "unloaded_idle") return "Idle: the GPU model is unloaded";
  return "Serving on the GPU";
}

function otherAppsText(processes, ours) {
  const apps = (processes || []).filter((p) => p && !ours.has(p.pid))
    .map((p) => [p.name || `pid ${p.pid}`, num(p.used_mib)]).sort((a, b) => (b[1] || 0) - (a[1] || 0));
  if (!apps.length) return "";
  const shown = apps.slice(0, MAX_APPS_SHOWN).map(([name, used]) => used === null ? name : `${name} ${fmtMib(used)}`);
  const more = apps.length - MAX_APPS_SHOWN;
  return "Other apps: " + shown.join(" · ") + (more > 0 ? ` · ${more} more` : "");
}

function headroomSegments(workerLabel, workerMib, used, keptLabel, kept, free, what) {
  const mine = Math.min(workerMib, used);
  const segments = [];
  if (mine > 0) segments.push(["worker", workerLabel, mine]);
  segments.push(["used", mine > 0 ? "other use" : "used", Math.max(0, used - mine)]);
  if (free >= kept) return [[...segments, ["reserve", keptLabel, kept], ["free", "headroom", free - kept]], ""];
  return [[...segments, ["reserve", keptLabel, free], ["free", "headroom", 0]],
    `${what} is ${fmtMib(kept - free)} below the ${fmtMib(kept)} ${keptLabel}`];
}

function memoryBars(status) {
  const bars = [];
  const gpu = status.gpu || {};
  const ours = new Set((status.workers || []).map((w) => w.pid).filter((pid) => Number.isInteger(pid)));
  if (gpu.available) {
    const worker = workers(status).gpu;
    const workerMib = worker && worker.pid ? num(worker.estimated_vram_mib) || 0 : 0;
    const devices = gpu.devices && gpu.devices.length ? gpu.devices
      : [{name: "GPU", total_mib: gpu.total_mib, used_mib: gpu.used_mib, free_mib: gpu.free_mib}];
    devices.forEach((device, position) => {
      const total = num(device.total_mib), free = num(device.free_mib);
      const name = String(device.name || `GPU ${position}`);
      // A simulated device is usually named so already.
      const title = `VRAM · ${name}` + (gpu.simulated && !/simulated/i.test(name) ? " (simulated)" : "");
      if (!total || free === null) { bars.push({title, total: null, segments: [], caption: "free VRAM unknown"}); return; }
      const used = num(device.used_mib) ?? Math.max(0, total - free);
      const [segments, warning] = position === 0
        ? headroomSegments("GPU worker (est.)", workerMib, used, "reserve", num(gpu.reserve_mib) || 0, free, "free VRAM")
        : [[["used", "used", used], ["free", "free", free]], ""];
      bars.push({title, total, segments, warning, caption: `${fmtMib(free, total)} free of ${fmtMib(total)}`,
        apps: otherAppsText(device.processes, ours)});
    });
  } else if (workers(status).gpu) {
    bars.push({title: "VRAM", total: null, segments: [], caption: "no GPU reading",
      warning: `no GPU reading: ${gpu.reason || "unknown"}`});
  }
  const ram = status.ram || {};
  const total = num(ram.total_mib), available = num(ram.available_mib);
  if (total === null || available === null) {
    bars.push({title: "RAM · host", total: null, segments: [], caption: "RAM unknown"});
  } else {
    const rss = Object.values(ram.rss_mib_by_pid || {}).reduce((sum, v) => sum + (num(v) || 0), 0);
    const floor = num(ram.floor_mib) ?? num(ram.ram_floor_mib) ?? 0;
    const [segments, warning] = headroomSegments("workers (RSS)", rss, Math.max(0, total - available), "floor", floor,
      available, "available RAM");
    bars.push({title: "RAM · host", total, segments, warning,
      caption: `${fmtMib(available, total)} available of ${fmtMib(total)}`});
  }
  return bars;
}

function modelViews(status) {
  return (status.models || []).map((model) => {
    const location = String(model.location || "unloaded"), gpu = String(model.gpu || "");
    let where = "unloaded";
    if (gpu === "loaded") where = "on the GPU";
    else if (location.split("+").includes("cpu")) where = "on the CPU";
    else if (gpu === "loading" || location === "loading") where = "loading";
    else if (gpu === "given_away") where = "GPU given away";
    const vram = num(model.vram_mib) || 0;
    let memory;
    if (where === "on the GPU" && vram > 0) memory = `${fmtMib(vram)} VRAM`;
    else if (where === "on the CPU") memory = `${fmtMib(num(model.estimated_ram_mib))} RAM`;
    else memory = num(model.size_bytes) ? `${fmtMib(model.size_bytes / 1048576)} on disk` : "size unknown";
    const busy = Number(model.in_flight || 0);
    return {name: String(model.name), where, memory, isDefault: model.source === "default",
      canLoad: gpu === "unloaded_idle" && where !== "loading" && where !== "on the GPU",
      canUnload: (where === "on the GPU" || where === "on the CPU") && busy === 0};
  });
}

// Speculative decoding on the default model's workers, and how often its drafts pay.
function draftingText(status) {
  const parts = (status.workers || []).filter((w) => w.speculative).map((w) => {
    const acceptance = num((w.drafts || {}).acceptance);
    const rate = acceptance === null ? "" : ` (${Math.round(acceptance * 100)} % of drafts accepted)`;
    const draft = w.draft_model ? ` with ${w.draft_model}` : "";
    return `${w.speculative}${draft} on the ${String(w.role).toUpperCase()}${rate}`;
  });
  return parts.length ? `speculative decoding: ${parts.join(", ")}` : "";
}

function cpuRequests(status) {
  return (status.requests || []).filter((r) => ["cpu", "peer"].includes(r.path) && ["queued", "running"].includes(r.state))
    .sort((a, b) => (a.state === "queued") - (b.state === "queued") || (a.queue_position || 0) - (b.queue_position || 0)
      || (b.age_s || 0) - (a.age_s || 0));
}

function bannerLatency(status) {
  const latency = num((status.degraded || {}).estimated_latency_s);
  return latency === null ? "unknown" : `a new request would be answered in about ${fmtSeconds(latency)}, queue included`;
}

// ----- the 5-minute charts, kept by the page from its own polls -------------------------

const history = [];

function addSample(status, now) {
  const gpu = status.gpu || {}, ram = status.ram || {};
  const available = Boolean(gpu.available);
  const total = num(gpu.total_mib);
  history.push({t: now, vramFree: available ? num(gpu.free_mib) : null,
    // A device that reports 0 MiB in all has not been read, not filled up.
    vramTotal: available && total > 0 ? total : null, reserve: num(gpu.reserve_mib),
    ramAvailable: num(ram.available_mib), ramTotal: num(ram.total_mib), floor: num(ram.floor_mib) ?? num(ram.ram_floor_mib)});
  while (history.length && history[0].t < now - HISTORY_S) history.shift();
}

const CHARTS = [
  {key: "vram", title: "Free VRAM", value: (s) => s.vramFree, total: (s) => s.vramTotal, threshold: (s) => s.reserve,
    thresholdLabel: "reserve", shown: (status) => Boolean((status.gpu || {}).available || workers(status).gpu)},
  {key: "ram", title: "Available RAM", value: (s) => s.ramAvailable, total: (s) => s.ramTotal, threshold: (s) => s.floor,
    thresholdLabel: "floor", shown: () => true},
];

// The series as runs of [x, y] in a 0..100 box (y down), broken where a value
// is unknown or the page was not polling; the scale is the largest total seen.
function chartRuns(samples, chart) {
  const latest = samples[samples.length - 1];
  const total = Math.max(0, ...samples.map((s) => chart.total(s) || 0));
  if (!latest || total <= 0) return {runs: [], total: 0};
  const start = latest.t - HISTORY_S;
  const clamp = (v) => Math.min(Math.max(v, 0), 1);
  const runs = [[]];
  let previous = null;
  for (const sample of samples) {
    const value = chart.value(sample);
    if (value === null || (previous !== null && sample.t - previous > GAP_S)) {
      if (runs[runs.length - 1].length) runs.push([]);
    }
    previous = sample.t;
    if (value === null) continue;
    runs[runs.length - 1].push([100 * clamp((sample.t - start) / HISTORY_S), 100 - 100 * clamp(value / total)]);
  }
  return {runs: runs.filter((run) => run.length), total};
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

function chartFigure(chart, samples) {
  const latest = samples[samples.length - 1];
  const {runs, total} = chartRuns(samples, chart);
  const figure = el("figure", undefined, "chart");
  figure.dataset.chart = chart.key;
  const caption = el("figcaption");
  const now = latest ? chart.value(latest) : null;
  caption.append(el("strong", chart.title), el("span", latest ? fmtMib(now, total || undefined) : "no data"));
  figure.append(caption);
  const plot = svg("svg", {viewBox: "0 0 100 100", preserveAspectRatio: "none", role: "img", class: "plot"});
  const lows = samples.map(chart.value).filter((v) => v !== null);
  plot.setAttribute("aria-label", `${chart.title}, last 5 minutes: now ${fmtMib(now, total || undefined)}` +
    (lows.length ? `, lowest ${fmtMib(Math.min(...lows), total || undefined)}` : ""));
  for (const fraction of [0.25, 0.5, 0.75]) {
    plot.append(svg("line", {x1: 0, x2: 100, y1: 100 * fraction, y2: 100 * fraction, class: "grid"}));
  }
  const threshold = latest ? chart.threshold(latest) : null;
  if (threshold && total > 0) {
    const y = 100 - 100 * Math.min(threshold / total, 1);
    plot.append(svg("line", {x1: 0, x2: 100, y1: y, y2: y, class: "threshold"}));
  }
  for (const run of runs) {
    // One sample alone draws as a dot: the same point twice, with round caps.
    const points = (run.length === 1 ? [run[0], run[0]] : run).map(([x, y]) => `${x.toFixed(2)},${y.toFixed(2)}`);
    plot.append(svg("polyline", {points: points.join(" "), class: `series series-${chart.key}`}));
  }
  figure.append(plot);
  const axis = el("div", undefined, "axis");
  axis.append(el("span", "5 min ago"), el("span", total > 0 ? `scale 0 – ${fmtMib(total)}` : ""), el("span", "now"));
  figure.append(axis);
  if (threshold) figure.append(el("p", `${chart.thresholdLabel} ${fmtMib(threshold, total || undefined)}`, "legend threshold-key"));
  return figure;
}

function renderCharts(status) {
  $("charts").replaceChildren(...CHARTS.filter((chart) => chart.shown(status)).map((chart) => chartFigure(chart, history)));
}

// ----- recent requests ------------------------------------------------------------------

function timeOfDay(seconds) {
  const time = new Date(seconds * 1000);
  return Number.isNaN(time.getTime()) ? "" : time.toLocaleTimeString("en-GB", {hour12: false});
}

function recentLine(decision) {
  const parts = [timeOfDay(num(decision.t)), String(decision.client || decision.id || "?")];
  if (decision.model) parts.push(String(decision.model));
  parts.push(ROUTE_NAMES[decision.route] || String(decision.route || "?"), reasonText(decision.reason));
  return parts.filter(Boolean).join(" · ");
}

// ----- usage, from /status's "usage" (core/usage.py) ----------------------------------------

function count(value) { return (num(value) || 0).toLocaleString("en-US"); }

function usageLine(period, counts) {
  const paths = counts.paths || {};
  const byPath = ["gpu", "cpu", "peer"].filter((path) => num((paths[path] || {}).requests))
    .map((path) => `${ROUTE_NAMES[path]} ${count(paths[path].requests)}`);
  const parts = [`${period}: ${count(counts.requests)} ${counts.requests === 1 ? "request" : "requests"}`
    + (byPath.length ? ` (${byPath.join(", ")})` : ""),
    `${count(counts.tokens_in)} tokens in`, `${count(counts.tokens_out)} out`];
  for (const field of ["degraded", "refused", "cancelled"]) if (num(counts[field])) parts.push(`${count(counts[field])} ${field}`);
  return parts.join(" · ");
}

// Busiest first over the week, so the apps that matter lead.
function usageRows(usage) {
  return Object.entries((usage || {}).by_name || {})
    .map(([name, entry]) => ({name, today: entry.today || {}, week: entry.last_7_days || {}}))
    .sort((a, b) => (num(b.week.requests) || 0) - (num(a.week.requests) || 0) || a.name.localeCompare(b.name));
}

// ----- talking to the service ---------------------------------------------------------

function csrfToken() {
  for (const part of document.cookie.split(";")) {
    const [name, ...rest] = part.trim().split("=");
    if (name === CSRF_COOKIE) return rest.join("=");
  }
  return "";
}

class LoggedOut extends Error {}

// Every change carries the CSRF token: with a key set the service refuses
// one made with the login cookie but without it.
async function call(method, path, body, signal) {
  const headers = {};
  if (method !== "GET") headers["X-CSRF-Token"] = csrfToken();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin", cache: "no-store", signal});
  if (response.status === 401) throw new LoggedOut();
  return response;
}

async function act(method, path, body) {
  $("action-error").textContent = "";
  try {
    const response = await call(method, path, body);
    if (!response.ok) $("action-error").textContent = await errorText(response);
  } catch (error) {
    if (error instanceof LoggedOut) showLogin(); else $("action-error").textContent = String(error);
  }
  poll();
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && (body.error.message || body.error)) || `HTTP ${response.status}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// ----- rendering -------------------------------------------------------------------------

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function button(label, onClick, className) {
  const node = el("button", label, className);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

function cancelButton(request) {
  const node = button("Cancel", () => act("DELETE", `/v1/requests/${encodeURIComponent(request.id)}`), "secondary");
  node.setAttribute("aria-label", `Cancel ${request.client || request.id}`);
  node.dataset.requestId = request.id;
  return node;
}

function requestRow(request) {
  const row = el("li");
  row.append(el("span", requestLine(request)));
  const buttons = el("span", undefined, "buttons");
  buttons.append(cancelButton(request));
  row.append(buttons);
  return row;
}

function renderBars(status) {
  const holder = $("bars");
  holder.replaceChildren();
  for (const bar of memoryBars(status)) {
    const box = el("div", undefined, "bar");
    const title = el("div", undefined, "bar-title");
    title.append(el("strong", bar.title), el("span", bar.caption));
    box.append(title);
    if (bar.total) {
      const track = el("div", undefined, "track");
      track.setAttribute("role", "img");
      track.setAttribute("aria-label", `${bar.title}: ${bar.caption}`);
      const legend = el("p", undefined, "legend");
      bar.segments.forEach(([key, label, mib], position) => {
        const segment = el("span", undefined, `seg-${key}`);
        segment.style.width = `${Math.max(0, mib) / bar.total * 100}%`;
        track.append(segment);
        // One entry never breaks inside, so a figure stays with its unit.
        legend.append(...(position ? [" · "] : []), el("span", `${label} ${fmtMib(mib, bar.total)}`, `key-${key}`));
      });
      box.append(track, legend);
    }
    if (bar.warning) box.append(el("p", bar.warning, "warning"));
    if (bar.apps) box.append(el("p", bar.apps, "apps"));
    holder.append(box);
  }
}

function renderBanner(status) {
  const degraded = status.degraded || {};
  const banner = $("banner");
  banner.hidden = !degraded.active || !workers(status).gpu;
  if (banner.hidden) return;
  $("banner-title").textContent = "Degraded: the CPU is serving";
  $("banner-reason").textContent = sentence(reasonInWords(degraded.reason || "the GPU path can't take this request"));
  let model = String(degraded.fallback_model || "unknown");
  $("banner-warning").textContent = "";
  if (degraded.fallback_equivalent === false) {
    model += " (a different model)";
    $("banner-warning").textContent = `Answers may differ from the GPU model: ${degraded.fallback_detail}`;
  }
  $("banner-model").textContent = model;
  const queue = (status.queues || {}).cpu || {};
  const cap = degraded.cpu_context_cap;
  const depth = degraded.cpu_queue_depth ?? queue.depth ?? 0;
  $("banner-limits").textContent = (Number.isInteger(cap) ? `context up to ${cap.toLocaleString("en-US")} tokens`
    : "context cap unknown") + ` · ${depth} waiting` + (queue.limit !== undefined && queue.limit !== null ? ` (limit ${queue.limit})` : "");
  $("banner-latency").textContent = bannerLatency(status);
  $("banner-requests").replaceChildren(...cpuRequests(status).map(requestRow));
}

function renderRequests(status) {
  const active = (status.requests || []).filter((r) => ["queued", "running"].includes(r.state));
  $("requests-empty").hidden = active.length > 0;
  $("requests").replaceChildren(...active.map(requestRow));
}

function renderModels(status) {
  const views = modelViews(status);
  $("models").replaceChildren(...views.map((view) => {
    const row = el("li");
    const drafting = view.isDefault ? draftingText(status) : "";
    row.append(el("span", `${view.name}${view.isDefault ? " (default)" : ""}: ${view.where}, ${view.memory}`
      + (drafting ? `; ${drafting}` : "")));
    const buttons = el("span", undefined, "buttons");
    const path = `/admin/models/${encodeURIComponent(view.name)}`;
    const load = button("Load", () => act("POST", path, {loaded: true}), "admin-only");
    load.disabled = !view.canLoad;
    load.setAttribute("aria-label", `Load ${view.name}`);
    const unload = button("Unload", () => act("POST", path, {loaded: false}), "secondary admin-only");
    unload.disabled = !view.canUnload;
    unload.setAttribute("aria-label", `Unload ${view.name}`);
    buttons.append(load, unload);
    row.append(buttons);
    return row;
  }));
  const picker = $("chat-model");
  const names = views.map((view) => view.name);
  if (names.join("\n") !== [...picker.options].map((o) => o.value).join("\n")) {
    const chosen = picker.value;
    picker.replaceChildren(...names.map((name) => { const o = el("option", name); o.value = name; return o; }));
    if (names.includes(chosen)) picker.value = chosen;
  }
}

function renderGpu(status) {
  const state = residencyState(status);
  const give = $("give-back");
  give.hidden = !workers(status).gpu;
  give.textContent = GIVEN_STATES.includes(state) ? "Use the GPU again" : "Give the GPU back now";
  const residency = (status.gpu || {}).residency || {};
  const texts = {given_back_by_user: "GPU: given back by you", given_away: String(residency.text || "GPU given to another app"),
    unloaded_idle: String(residency.text || "GPU unloaded (idle)"), loading: "GPU: loading the model"};
  $("residency").textContent = texts[state] || "";
}

function renderRecent(status) {
  // Newest first: what was just sent is at the top.
  const decisions = [...(status.recent_decisions || [])].reverse();
  $("recent-empty").hidden = decisions.length > 0;
  $("recent").replaceChildren(...decisions.map((decision) => {
    const row = el("li");
    row.dataset.requestId = String(decision.id || "");
    const text = el("span");
    text.append(el("span", recentLine(decision)));
    if (decision.detail) text.append(el("span", String(decision.detail), "detail"));
    row.append(text);
    return row;
  }));
}

function renderLogWorkers(status) {
  const picker = $("logs-worker");
  const roles = ["gpu", "cpu"].filter((role) => workers(status)[role]);
  if (roles.join() === [...picker.options].map((o) => o.value).join()) return;
  const chosen = picker.value;
  picker.replaceChildren(...roles.map((role) => {
    const option = el("option", `${role.toUpperCase()} worker`);
    option.value = role;
    return option;
  }));
  if (roles.includes(chosen)) picker.value = chosen;
}

function renderUsage(status) {
  $("usage-section").hidden = !status.usage;
  if (!status.usage) return;
  const rows = usageRows(status.usage);
  $("usage-empty").hidden = rows.length > 0;
  $("usage").replaceChildren(...rows.map((row) => {
    const item = el("li");
    item.dataset.usageName = row.name;
    const text = el("span");
    text.append(el("strong", row.name), el("span", usageLine("today", row.today), "detail"),
      el("span", usageLine("7 days", row.week), "detail"));
    item.append(text);
    return item;
  }));
}

function render(status) {
  $("state").textContent = stateTitle(status);
  const version = (status.service || {}).version;
  $("version").textContent = version ? `tray-app ${version}` : "";
  renderBanner(status);
  renderBars(status);
  renderCharts(status);
  renderRequests(status);
  renderModels(status);
  renderRecent(status);
  renderUsage(status);
  renderGpu(status);
  renderLogWorkers(status);
}

// ----- logs, read when asked -----------------------------------------------------------

let logLines = [];
let logsShown = false;

async function showLogs(event) {
  if (event) event.preventDefault();
  logsShown = true;
  const worker = $("logs-worker").value || "gpu";
  try {
    const response = await call("GET", `/admin/logs?worker=${encodeURIComponent(worker)}&lines=${LOG_LINES}`);
    // An inference key's page has no log view.
    $("logs-section").hidden = response.status === 403;
    if (!response.ok) {
      logLines = [];
      renderLogs(await errorText(response));
      return;
    }
    logLines = (await response.json()).lines || [];
    renderLogs();
  } catch (error) {
    if (error instanceof LoggedOut) showLogin(); else renderLogs(String(error));
  }
}

function renderLogs(problem) {
  const filter = $("logs-filter").value.trim().toLowerCase();
  const shown = filter ? logLines.filter((line) => line.toLowerCase().includes(filter)) : logLines;
  const view = $("logs");
  view.textContent = shown.join("\n");
  view.scrollTop = view.scrollHeight;  // the newest lines, as a tail shows them
  $("logs-count").textContent = problem
    || (filter ? `${shown.length} of the last ${logLines.length} lines` : `the last ${logLines.length} lines`);
}

// ----- polling, only while the page is seen ---------------------------------------------

async function poll() {
  clearTimeout(pollTimer);
  pollTimer = null;
  if (document.visibilityState !== "visible") return;
  try {
    const response = await call("GET", "/status");
    if (!response.ok) throw new Error(await errorText(response));
    lastStatus = await response.json();
    addSample(lastStatus, Date.now() / 1000);
    $("login").hidden = true;
    $("panel").hidden = false;
    // Logged in by cookie (a key is set): the page can log out again.
    // Without one, /status answered with no key at all: say what that means.
    $("logout").hidden = !csrfToken();
    $("no-key").hidden = Boolean(csrfToken());
    render(lastStatus);
    if (!logsShown) showLogs();
    if (!keysLoaded) loadKeys();
  } catch (error) {
    if (error instanceof LoggedOut) { showLogin(); return; }
    $("state").textContent = `The service did not answer: ${error.message || error}`;
  }
  if (document.visibilityState === "visible" && pollTimer === null) pollTimer = setTimeout(poll, POLL_MS);
}

function showLogin() {
  clearTimeout(pollTimer);
  pollTimer = null;
  $("panel").hidden = true;
  $("logout").hidden = true;
  // The next login may hold another key: what it may read is asked again.
  logsShown = keysLoaded = false;
  $("login").hidden = false;
  $("state").textContent = "Log in to see the service";
  $("login-key").focus();
}

async function logIn(event) {
  event.preventDefault();
  $("login-error").textContent = "";
  const response = await fetch("/ui/login", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({key: $("login-key").value}), credentials: "same-origin"});
  if (!response.ok) { $("login-error").textContent = await errorText(response); return; }
  $("login-key").value = "";
  poll();
}

// ----- Markdown, built as DOM nodes ---------------------------------------------------------
// Model text never becomes HTML: every piece goes in as a text node or
// through textContent, and a link keeps only an http(s) address.

// `code`, **bold**, __bold__, *italic*, _italic_, [text](http…)
const INLINE = /`([^`\n]+)`|\*\*(\S(?:[^*]*\S)?)\*\*|__(\S(?:[^_]*\S)?)__|\*(\S(?:[^*]*\S)?)\*|(?<!\w)_(\S(?:[^_]*\S)?)_(?!\w)|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

function safeHref(address) {
  try {
    const url = new URL(address);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch (_) {
    return null;  // relative, or not an address at all
  }
}

function appendInline(parent, text) {
  let done = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(text.slice(done, match.index));
    const [whole, code, bold1, bold2, italic1, italic2, label, address] = match;
    if (code !== undefined) {
      parent.append(el("code", code));
    } else if (bold1 !== undefined || bold2 !== undefined) {
      parent.append(appendInline(el("strong"), bold1 ?? bold2));
    } else if (italic1 !== undefined || italic2 !== undefined) {
      parent.append(appendInline(el("em"), italic1 ?? italic2));
    } else {
      const href = safeHref(address);
      if (href === null) {
        parent.append(whole);
      } else {
        const link = appendInline(el("a"), label);
        link.href = href;
        link.rel = "noopener noreferrer";
        link.target = "_blank";
        parent.append(link);
      }
    }
    done = match.index + whole.length;
  }
  parent.append(text.slice(done));
  return parent;
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

// Fenced code, headings, lists, quotes and paragraphs. A fence still open
// (the answer is streaming) holds the rest as code.
function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = String(text).split("\n");
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) root.append(appendInline(el("p"), paragraph.join("\n")));
    paragraph = [];
  };
  for (let i = 0; i < lines.length;) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const code = [];
      for (i += 1; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i += 1) code.push(lines[i]);
      i += 1;
      const block = el("code", code.join("\n"));
      if (fence[2]) block.dataset.language = fence[2];
      const pre = el("pre");
      pre.append(block);
      root.append(pre);
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      flush();
      // Under the page's own h2 ("Chat"): # is an h3.
      root.append(appendInline(el(`h${Math.min(heading[1].length + 2, 6)}`), heading[2]));
      i += 1;
      continue;
    }
    const kind = BULLET.test(line) ? BULLET : NUMBERED.test(line) ? NUMBERED : null;
    if (kind) {
      flush();
      const list = el(kind === BULLET ? "ul" : "ol");
      if (kind === NUMBERED) list.start = Number(line.match(NUMBERED)[1]);
      let item = null;
      for (; i < lines.length; i += 1) {
        const match = lines[i].match(kind);
        if (match) {
          item = appendInline(el("li"), match[match.length - 1]);
          list.append(item);
        } else if (item && /^\s+\S/.test(lines[i]) && !FENCE.test(lines[i])) {
          appendInline(item, `\n${lines[i].trim()}`);  // an item's wrapped line
        } else {
          break;
        }
      }
      root.append(list);
      continue;
    }
    if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i += 1) quoted.push(lines[i].match(QUOTE)[1]);
      root.append(appendInline(el("blockquote"), quoted.join("\n")));
      continue;
    }
    if (line.trim() === "") flush(); else paragraph.push(line);
    i += 1;
  }
  flush();
  return root;
}

// ----- keys, for an admin: /admin/keys (core/api/key_routes.py) ------------------------------

let keysLoaded = false;

function keyLine(key) {
  const parts = [key.scope];
  parts.push(key.models && key.models.length ? `models: ${key.models.join(", ")}` : "every model");
  if (Number.isInteger(key.max_concurrency)) parts.push(`${key.max_concurrency} at once`);
  if (num(key.created)) parts.push(`made ${new Date(key.created * 1000).toLocaleDateString("en-CA")}`);
  return parts.join(" · ");
}

// Read when the page opens and after each change, not every poll: keys
// change only here or from the command line.
async function loadKeys() {
  keysLoaded = true;
  try {
    const response = await call("GET", "/admin/keys");
    // An inference key's page: no key controls, and no admin buttons it would be refused.
    document.body.classList.toggle("not-admin", response.status === 403);
    if (response.status === 403 || response.status === 404) { $("keys-section").hidden = true; return; }
    if (!response.ok) { $("keys-error").textContent = await errorText(response); return; }
    renderKeys((await response.json()).keys || []);
  } catch (error) {
    if (error instanceof LoggedOut) showLogin(); else $("keys-error").textContent = String(error);
  }
}

function renderKeys(keys) {
  $("keys-section").hidden = false;
  $("keys-empty").hidden = keys.length > 0;
  $("keys").replaceChildren(...keys.map((key) => {
    const row = el("li");
    row.dataset.keyName = key.name;
    const text = el("span");
    text.append(el("strong", String(key.name)), el("span", keyLine(key), "detail"));
    const buttons = el("span", undefined, "buttons");
    const revoke = button("Revoke", () => askRevoke(String(key.name)), "secondary");
    revoke.setAttribute("aria-label", `Revoke ${key.name}`);
    buttons.append(revoke);
    row.append(text, buttons);
    return row;
  }));
}

async function addKey(event) {
  event.preventDefault();
  $("keys-error").textContent = "";
  const models = $("key-models").value.split(",").map((name) => name.trim()).filter(Boolean);
  const limit = $("key-concurrency").value.trim();
  const body = {name: $("key-name").value.trim(), scope: $("key-scope").value, models,
    max_concurrency: limit === "" ? null : Number(limit)};
  try {
    const response = await call("POST", "/admin/keys", body);
    if (!response.ok) { $("keys-error").textContent = await errorText(response); return; }
    const made = await response.json();
    $("key-add").reset();
    $("key-made-name").textContent = made.name;
    $("key-made-value").value = made.key;
    $("key-made").showModal();
    $("key-made-value").select();
  } catch (error) {
    if (error instanceof LoggedOut) showLogin(); else $("keys-error").textContent = String(error);
  }
  loadKeys();
}

function askRevoke(name) {
  $("key-revoke-name").textContent = name;
  $("key-revoke").dataset.keyName = name;
  $("key-revoke").returnValue = "";
  $("key-revoke").showModal();
}

async function revokeKey() {
  const dialog = $("key-revoke");
  if (dialog.returnValue !== "revoke") return;  // "Keep it", or Escape
  $("keys-error").textContent = "";
  try {
    const response = await call("DELETE", `/admin/keys/${encodeURIComponent(dialog.dataset.keyName)}`);
    if (!response.ok) $("keys-error").textContent = await errorText(response);
  } catch (error) {
    if (error instanceof LoggedOut) { showLogin(); return; }
    $("keys-error").textContent = String(error);
  }
  loadKeys();
}

// ----- chat --------------------------------------------------------------------------------

let chatAbort = null;

function routeLine(servedBy, reason, fallbackModel, peer) {
  const parts = [servedBy === "peer" ? `served by peer ${peer || "unknown"}` : `served by ${(servedBy || "unknown").toUpperCase()}`];
  if (reason) parts.push(reasonText(reason));
  if (servedBy === "cpu" && fallbackModel) parts.push(`fallback model ${fallbackModel}`);
  return parts.join(" · ");
}

function showAnswer(text, problem) {
  const answer = $("chat-answer");
  answer.replaceChildren(renderMarkdown(text));
  if (problem) answer.append(el("p", problem, "error"));
}

async function chat(event) {
  event.preventDefault();
  const send = $("chat-send"), stop = $("chat-stop");
  let text = "";
  showAnswer("");
  $("chat-route").textContent = "";
  send.disabled = true;
  stop.hidden = false;
  chatAbort = new AbortController();
  try {
    const response = await call("POST", "/v1/chat/completions", {model: $("chat-model").value, stream: true,
      messages: [{role: "user", content: $("chat-prompt").value}]}, chatAbort.signal);
    if (!response.ok) { showAnswer("", await errorText(response)); return; }
    const h = response.headers;
    $("chat-route").textContent = routeLine(h.get("X-Served-By"), h.get("X-Route-Reason"), h.get("X-Fallback-Model"), h.get("X-Peer"));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "", problem = "", shownAt = -Infinity;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      pending += decoder.decode(value, {stream: true});
      const lines = pending.split("\n");
      pending = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const event = JSON.parse(data);
        if (event.error) { problem = event.error.message || "error"; continue; }
        const delta = ((event.choices || [])[0] || {}).delta || {};
        if (typeof delta.content === "string") text += delta.content;
      }
      // Each render parses the whole answer again: at most ten a second, so a
      // long answer doesn't cost the page more than the model's speed.
      if (performance.now() - shownAt >= RENDER_EVERY_MS) {
        showAnswer(text, problem);
        shownAt = performance.now();
      }
    }
    showAnswer(text, problem);
  } catch (error) {
    if (error instanceof LoggedOut) showLogin();
    else if (error.name === "AbortError") showAnswer(text, "Stopped.");
    else showAnswer(text, String(error));
  } finally {
    chatAbort = null;
    send.disabled = false;
    stop.hidden = true;
  }
}

// Closing the stream ends the request on the server too (it cancels a
// request whose client has gone).
function stopChat() {
  if (chatAbort) chatAbort.abort();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", logIn);
  $("chat").addEventListener("submit", chat);
  $("chat-stop").addEventListener("click", stopChat);
  $("chat-prompt").addEventListener("keydown", (event) => {
    // Ctrl+Enter (⌘+Enter) sends; Enter alone is a new line.
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); $("chat").requestSubmit(); }
  });
  $("logs-form").addEventListener("submit", showLogs);
  $("key-add").addEventListener("submit", addKey);
  $("key-revoke").addEventListener("close", revokeKey);
  // The raw key leaves the page once its dialog is closed.
  $("key-made").addEventListener("close", () => { $("key-made-value").value = ""; });
  $("logs-worker").addEventListener("change", () => showLogs());
  $("logs-filter").addEventListener("input", () => renderLogs());
  // Escape stops a streaming answer; a dialog closes itself on Escape.
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && chatAbort && !document.querySelector("dialog[open]")) stopChat();
  });
  $("logout").addEventListener("click", async () => { await call("POST", "/ui/logout"); showLogin(); });
  $("give-back").addEventListener("click", () =>
    act("POST", "/admin/gpu", {given_back: !GIVEN_STATES.includes(residencyState(lastStatus || {}))}));
  // Hidden tab: no polling, so an open-but-unseen page costs the service nothing.
  document.addEventListener("visibilitychange", poll);
  poll();
});
