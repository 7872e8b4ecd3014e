// Nystream's page: the microphone streamed to /v1/stream (protocol version 1, docs/serve.md),
// each record drawn as it comes, the verdict when stopped; a file posted to /v1/classify.
"use strict";

const BACKLOG_SECONDS = 10;       // audio held while the server's credit is spent; older audio is dropped
const TIMELINE_HOPS = 240;        // the timeline's width in hops (60 s)
const COLORS = ["#3b6fd8", "#e0533d", "#2e9d5b", "#c08a00", "#8e44ad", "#16a2b8", "#d63384", "#6c757d",
                "#7a5c2e", "#1f3b73", "#99b000", "#ff7f0e"];
const $ = (id) => document.getElementById(id);

const live = {
  ws: null, ctx: null, media: null, node: null, helloed: false, ended: false, rate: 0,
  credit: 4, sent: 0, heard: 0, pending: [], dropped: 0, classes: [], models: [], tops: [],
};
let token = null, tokenRequired = false;

function say(text, error = false) {
  const m = $("message");
  m.textContent = text;
  m.classList.toggle("error", error);
  m.setAttribute("role", error ? "alert" : "status");
}

function readToken() {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {                                   // kept for this tab; the address bar no longer shows it
    sessionStorage.setItem("nystream-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("nystream-token");
}

function haveToken() {
  if (tokenRequired && !token) {
    const given = prompt("This server needs its token (serve --token-file):");
    if (given) {
      token = given.trim();
      sessionStorage.setItem("nystream-token", token);
    }
  }
  return !tokenRequired || !!token;
}

function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function color(name) {
  const i = live.classes.indexOf(name);
  return COLORS[(i < 0 ? 0 : i) % COLORS.length];
}

// ------------------------------------------------------------------ the server
async function readHealth() {
  try {
    const r = await fetch("v1/health");
    const h = await r.json();
    if (!r.ok) throw new Error(h.error || `HTTP ${r.status}`);
    tokenRequired = !!h.token_required;
    $("server").textContent = `${h.frontend} · models: ${h.models.join(", ")} · ` +
      `${h.active_streams} of ${h.capacity} streams in use · ${h.device}`;
    $("version").textContent = h.version ? `nystream ${h.version}` : "";
    chooseModels(h.models);
  } catch (e) {
    $("server").textContent = `The server's health cannot be read: ${e.message}`;
  }
}

function chooseModels(models) {
  live.models = models;
  const select = $("model");
  const kept = select.value;
  select.replaceChildren(...models.map((name) => new Option(name, name)));
  if (models.includes(kept)) select.value = kept;
  $("model-label").hidden = models.length < 2;
}

// ------------------------------------------------------------------ live
async function start() {
  if (!haveToken()) { say("This server needs its token: open the page with #token=... or give it when asked.", true); return; }
  if (!navigator.mediaDevices) {
    say("This browser gives the microphone only to secure pages: open the page over https, or on localhost.", true);
    return;
  }
  say("Asking for the microphone…");
  let media;
  try {
    media = await navigator.mediaDevices.getUserMedia(
      { audio: { echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
  } catch (e) {
    say(`The microphone is not available: ${e.name}: ${e.message}`, true);
    return;
  }
  const ctx = new AudioContext();
  let node;
  try {
    await ctx.audioWorklet.addModule("static/worklet.js");
    node = new AudioWorkletNode(ctx, "nystream-capture", { numberOfInputs: 1, numberOfOutputs: 0 });
    ctx.createMediaStreamSource(media).connect(node);
  } catch (e) {
    media.getTracks().forEach((t) => t.stop());
    ctx.close();
    say(`This browser cannot capture audio here: ${e.name}: ${e.message}`, true);
    return;
  }
  const url = new URL("v1/stream", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const protocols = token ? ["nystream", "nystream.bearer." + base64url(token)] : ["nystream"];
  const ws = new WebSocket(url, protocols);
  Object.assign(live, { ws, ctx, media, node, helloed: false, ended: false, rate: ctx.sampleRate, sent: 0,
                        heard: 0, pending: [], dropped: 0, tops: [] });
  ws.onopen = () => ws.send(JSON.stringify({ sample_rate: ctx.sampleRate, channels: 1, format: "f32le" }));
  ws.onmessage = (event) => received(JSON.parse(event.data));
  ws.onclose = closed;
  node.port.onmessage = (event) => { live.pending.push(event.data); send(); };
  $("start").textContent = "Stop";
  $("verdict").replaceChildren();
  say(`Connecting (${ctx.sampleRate} Hz)…`);
}

function send(all = false) {
  const ws = live.ws;
  if (!ws || ws.readyState !== WebSocket.OPEN || !live.helloed) return;
  while (live.pending.length && (all || live.sent - live.heard < live.credit)) {
    const block = live.pending.shift();
    ws.send(block);                          // float32 in the machine's order: little-endian wherever browsers run
    live.sent += block.length / live.rate;
  }
  let held = live.pending.reduce((sum, b) => sum + b.length, 0) / live.rate;
  while (held > BACKLOG_SECONDS) {           // the server is behind: the oldest audio goes
    const block = live.pending.shift();
    held -= block.length / live.rate;
    live.dropped += block.length / live.rate;
  }
}

function received(d) {
  if (!live.helloed) {                       // the hello's answer
    live.helloed = true;
    live.classes = d.classes;
    live.credit = d.credit_seconds;
    chooseModels(d.models);
    drawLegend();
    say("Streaming the microphone: press Stop for the verdict.");
    send();
    return;
  }
  if ("verdict" in d) {
    showVerdict($("verdict"), d, "This stream");
    return;
  }
  live.heard = d.audio_time;
  drawRecord(d);
  send();
}

function stop() {
  const ws = live.ws;
  release();
  if (ws && ws.readyState === WebSocket.OPEN && live.helloed) {
    send(true);
    ws.send(JSON.stringify({ end: true }));
    live.ended = true;
    say("Stopped: the last hops and the verdict are on their way…");
    $("start").disabled = true;
  } else if (ws) {
    ws.close();
  }
}

function release() {
  if (live.media) live.media.getTracks().forEach((t) => t.stop());
  if (live.node) live.node.port.onmessage = null;
  if (live.ctx) live.ctx.close();
  live.media = live.node = live.ctx = null;
}

function closed(event) {
  release();
  const opened = live.helloed;
  live.ws = null;
  $("start").textContent = "Start";
  $("start").disabled = false;
  const lost = live.dropped ? ` ${live.dropped.toFixed(1)} s of audio were dropped while the server was behind.` : "";
  if (event.code === 1000) say("Stopped." + lost);
  else if (!opened && event.code === 1006) {
    say("The server refused the stream: a wrong or missing token, or a page of another origin " +
        "(serve --allow-origin).", true);
  } else say(`The server closed the stream (${event.code}): ${event.reason || "no reason given"}.${lost}`, true);
}

// ------------------------------------------------------------------ drawing
function drawRecord(d) {
  const name = live.models.includes($("model").value) ? $("model").value : Object.keys(d.models)[0];
  const m = d.models[name];
  const [genre, p] = m.top;
  $("now").textContent = `${genre} ${(100 * p).toFixed(0)} %`;
  $("now").style.color = color(genre);
  $("cost").textContent = `${name}: ${(m.flops.model / 1e6).toFixed(2)} MFLOPs, ${m.latency_ms.toFixed(2)} ms a step` +
    (m.warm ? "" : " (warming up)");
  drawBars(m.classes, m.probabilities);
  live.tops.push(genre);
  if (live.tops.length > TIMELINE_HOPS) live.tops.shift();
  drawTimeline();
}

function drawBars(classes, probabilities) {
  const bars = $("bars");
  if (bars.childElementCount !== 3 * classes.length) {
    bars.replaceChildren(...classes.flatMap((c) => {
      const label = document.createElement("span");
      label.textContent = c;
      const fill = document.createElement("div");
      fill.className = "fill";
      fill.setAttribute("role", "meter");
      fill.setAttribute("aria-label", c);
      fill.setAttribute("aria-valuemin", "0");
      fill.setAttribute("aria-valuemax", "1");
      const value = document.createElement("span");
      value.className = "value";
      return [label, fill, value];
    }));
  }
  probabilities.forEach((p, i) => {
    const fill = bars.children[3 * i + 1];
    fill.style.width = `${(100 * p).toFixed(1)}%`;
    fill.style.background = color(classes[i]);
    fill.setAttribute("aria-valuenow", p.toFixed(4));
    bars.children[3 * i + 2].textContent = `${(100 * p).toFixed(0)} %`;
  });
}

function drawTimeline() {
  const canvas = $("timeline");
  const width = canvas.width = canvas.clientWidth * devicePixelRatio || 600;
  const height = canvas.height;
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, width, height);
  const step = width / TIMELINE_HOPS;
  live.tops.forEach((genre, i) => {
    g.fillStyle = color(genre);
    g.fillRect(width - (live.tops.length - i) * step, 0, Math.ceil(step), height);
  });
}

function drawLegend() {
  $("legend").replaceChildren(...live.classes.map((c) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color(c);
    item.append(swatch, c);
    return item;
  }));
}

function showVerdict(where, d, title) {
  const table = document.createElement("table");
  const head = table.insertRow();
  for (const h of ["model", "genre", "on top", "mean probability", "top classes"]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.append(th);
  }
  for (const [model, v] of Object.entries(d.verdict)) {
    const row = table.insertRow();
    const top = v.top.map(([c, p]) => `${c} ${(100 * p).toFixed(0)} %`).join(", ");
    for (const text of [model, v.genre, `${(100 * v.share).toFixed(0)} % of ${v.steps} steps`,
                        `${(100 * v.confidence).toFixed(0)} %`, top]) row.insertCell().textContent = text;
  }
  const caption = document.createElement("p");
  caption.textContent = `${title}: ${d.hops} hops` + (d.error ? ` (ended early: ${d.error})` : "");
  where.replaceChildren(caption, table);
}

// ------------------------------------------------------------------ a file
async function classifyFile(file) {
  if (!file) return;
  const where = $("file-verdict");
  if (!haveToken()) { where.textContent = "This server needs its token."; return; }
  where.textContent = `Classifying ${file.name}…`;
  const headers = { "Content-Type": "application/octet-stream" };
  if (token) headers.Authorization = "Bearer " + token;
  try {
    const r = await fetch("v1/classify", { method: "POST", body: file, headers });
    const d = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
    if (!r.ok) throw new Error(d.error || `HTTP ${r.status}`);
    showVerdict(where, d, file.name);
  } catch (e) {
    where.textContent = `${file.name}: ${e.message}`;
  }
}

function init() {
  token = readToken();
  $("start").addEventListener("click", () => (live.ws ? stop() : start()));
  $("model").addEventListener("change", () => { live.tops = []; drawTimeline(); });
  $("file").addEventListener("change", (e) => classifyFile(e.target.files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    classifyFile(e.dataTransfer.files[0]);
  });
  readHealth();
}

init();
