// The run's live page: reads the monitor's API (/api/status, /api/series) every few seconds and redraws.
// Names and details come from peers: they are only ever set as text, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const STALE_AFTER_POLLS = 3;  // "no news" once this many of the monitor's polls went by without a new document
const charts = {};
let statusEtag = null;
let lastUpdated = null;
let lastSeriesTime = null;
let pollEvery = 10;

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", second: "2-digit"});
}

function stamp(seconds) {
  return new Date(seconds * 1000).toLocaleString([], {dateStyle: "short", timeStyle: "medium"});
}

function duration(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function count(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 1e9) return `${(value / 1e9).toFixed(2)} G`;
  if (value >= 1e6) return `${(value / 1e6).toFixed(2)} M`;
  if (value >= 1e4) return `${(value / 1e3).toFixed(1)} k`;
  return String(Math.round(value));
}

function chart(id, datasets, xLabel, xIsTime) {
  const color = css("--muted"), grid = css("--line");
  charts[id] = new Chart(document.getElementById(id), {
    type: "line",
    data: {datasets: datasets.map(([label, variable]) => ({
      label, data: [], borderColor: css(variable), backgroundColor: css(variable), pointRadius: 2, borderWidth: 2,
      spanGaps: false, stepped: label !== "loss" && label !== "samples / s" ? "before" : false}))},
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: false, normalized: true,
      interaction: {mode: "nearest", intersect: false},
      plugins: {legend: {display: datasets.length > 1, labels: {color}},
                tooltip: {callbacks: {title: (items) => items.length ?
                  (xIsTime ? clock(items[0].parsed.x) : `${count(items[0].parsed.x)} samples`) : ""}}},
      scales: {
        x: {type: "linear", title: {display: true, text: xLabel, color}, grid: {color: grid},
            ticks: {color, maxTicksLimit: 6, callback: (value) => xIsTime ? clock(value) : count(value)}},
        y: {title: {display: false}, grid: {color: grid}, ticks: {color, maxTicksLimit: 6}, beginAtZero: false},
      },
    },
  });
}

function makeCharts() {
  chart("chart-loss-time", [["loss", "--loss"]], "time", true);
  chart("chart-loss-samples", [["loss", "--loss"]], "samples", false);
  chart("chart-peers", [["volunteers", "--volunteers"], ["anchors", "--anchors"]], "time", true);
  chart("chart-throughput", [["samples / s", "--throughput"]], "time", true);
  charts["chart-peers"].options.scales.y.beginAtZero = true;
  charts["chart-peers"].options.scales.y.ticks.precision = 0;
  charts["chart-throughput"].options.scales.y.beginAtZero = true;
}

function addPoints(series) {
  const n = series.time.length;
  for (let i = 0; i < n; i++) {
    const t = series.time[i];
    if (series.loss[i] !== null) {
      charts["chart-loss-time"].data.datasets[0].data.push({x: t, y: series.loss[i]});
      if (series.samples[i] !== null) {
        charts["chart-loss-samples"].data.datasets[0].data.push({x: series.samples[i], y: series.loss[i]});
      }
    }
    charts["chart-peers"].data.datasets[0].data.push({x: t, y: series.volunteers[i]});
    if (series.anchors[i] !== null) charts["chart-peers"].data.datasets[1].data.push({x: t, y: series.anchors[i]});
    charts["chart-throughput"].data.datasets[0].data.push({x: t, y: series.samples_per_second[i]});
  }
  if (n) {
    lastSeriesTime = series.time[n - 1];
    for (const id in charts) {
      // one point alone would stretch its axis over hours: give it a window of a few polls until a second comes
      const x = charts[id].options.scales.x, points = charts[id].data.datasets[0].data;
      const single = points.length === 1 && id !== "chart-loss-samples";
      x.min = single ? points[0].x - 5 * pollEvery : undefined;
      x.max = single ? points[0].x + 5 * pollEvery : undefined;
      charts[id].update("none");
    }
  }
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined || text === "" ? "–" : String(text);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function fillTable(id, rows, columns, emptyText, rowClass) {
  const body = document.querySelector(`#${id} tbody`);
  const fresh = document.createElement("tbody");
  if (!rows.length) {
    const tr = fresh.insertRow(), td = cell(tr, emptyText, "empty");
    td.colSpan = document.querySelectorAll(`#${id} thead th`).length;
  }
  for (const item of rows) {
    const tr = fresh.insertRow();
    if (rowClass) rowClass(tr, item);
    for (const [value, className] of columns(item)) {
      if (value instanceof Node) tr.insertCell().appendChild(value); else cell(tr, value, className);
    }
  }
  body.replaceWith(fresh);
}

function hubLink(item) {
  if (!item.hub_url) return "";
  const a = document.createElement("a");
  a.href = item.hub_url;
  a.rel = "noopener noreferrer";
  a.textContent = item.hub;
  return a;
}

function render(status) {
  const run = status.run, now = status.now;
  pollEvery = run.poll_every;
  document.title = `${run.run_id}: epoch ${now.epoch}`;
  document.body.dataset.poll = status.poll;  // which of the monitor's polls the page shows (tools and tests read it)
  document.getElementById("run-id").textContent = run.run_id;
  document.getElementById("mode").textContent =
    [`${run.preset} preset`, run.mode, run.data && `data: ${run.data}`, run.authorized && "Hugging Face login"]
      .filter(Boolean).join(" · ");
  document.getElementById("epoch").textContent = now.epoch;
  document.getElementById("loss").textContent = now.loss === null ? "–" : now.loss.toFixed(4);
  document.getElementById("volunteers").textContent = now.volunteers;
  document.getElementById("anchors").textContent = now.anchors === null ? "–" : now.anchors;
  document.getElementById("throughput").textContent = now.samples_per_second.toFixed(1);
  document.getElementById("samples").textContent = count(now.samples);
  document.getElementById("join-line").textContent = run.join_line ||
    "this monitor accepts no connections: ask the organizers for the line to join with";
  fillTable("peers", status.peers, (p) => [[p.name, "name"], [p.detail, `state-${p.state}`], [p.device],
                                             [clock(p.last_seen)]],
            "no training peer has reported yet", (tr, p) => { tr.className = p.state; tr.dataset.state = p.state; });
  fillTable("leaderboard", status.leaderboard, (c) => [
    [c.rank, "number"], [c.name, "name"], [c.samples.toLocaleString(), "number"],
    [`${(100 * c.share).toFixed(1)}%`, "number"], [duration(c.compute_seconds), "number"], [c.device],
    [stamp(c.first_seen)], [stamp(c.last_seen)]], "nobody has contributed yet");
  fillTable("checkpoints", status.checkpoints, (c) => [[c.epoch, "number"], [stamp(c.time)], [c.name, "name"],
                                                       [hubLink(c)]], "no checkpoint yet");
  fillTable("settings", Object.entries(run.settings), ([name, value]) => [[name, "name"], [JSON.stringify(value)]],
            "none");
}

function showLiveness(ok) {
  const pill = document.getElementById("live");
  if (lastUpdated === null) {
    pill.textContent = ok ? "waiting for the monitor's first poll" : "cannot reach the monitor";
    pill.className = "pill waiting";
    return;
  }
  const age = Date.now() / 1000 - lastUpdated;
  const stale = !ok || age > STALE_AFTER_POLLS * pollEvery + 5;
  pill.textContent = stale ? `no news for ${duration(age)}` : `live · polled ${clock(lastUpdated)}`;
  pill.className = stale ? "pill stale" : "pill live";
}

async function refresh() {
  let ok = true;
  try {
    const headers = statusEtag ? {"If-None-Match": statusEtag} : {};
    const answer = await fetch("/api/status", {cache: "no-store", headers});
    if (answer.status === 200) {
      statusEtag = answer.headers.get("ETag");
      const status = await answer.json();
      render(status);
      lastUpdated = status.updated;
      const query = lastSeriesTime === null ? "" : `?since=${lastSeriesTime}`;
      const series = await fetch(`/api/series${query}`, {cache: "no-store"});
      if (series.status === 200) addPoints(await series.json());
    } else if (answer.status !== 304) {
      ok = answer.status === 503;  // 503: before the first poll
    }
  } catch (error) {
    ok = false;  // the monitor is gone or restarting: try again at the next tick
  }
  showLiveness(ok);
  setTimeout(refresh, REFRESH_MS);
}

document.getElementById("copy-join").addEventListener("click", async () => {
  const button = document.getElementById("copy-join");
  const text = document.getElementById("join-line").textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (error) {  // no clipboard (a page over plain http on another host): select it for Ctrl-C
    const range = document.createRange();
    range.selectNodeContents(document.getElementById("join-line"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    button.textContent = "Selected: press Ctrl-C";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
});

makeCharts();
refresh();
