// The console at "/": connect (WebRTC or the GA WebSocket), talk, watch the
// transcripts, the tool calls and their answers, levels, latency and errors.
"use strict";

import {Level, TurnClock} from "./audio.js";
import {FINISH, GA, VLM} from "./dialects.js";
import {SocketCall, WebRTCCall} from "./transports.js";
import {Calls, Transcript} from "./views.js";

const $ = (id) => document.getElementById(id);
const prefix = document.querySelector('meta[name="api-prefix"]').content;
const LEVEL_MS = 50, STATS_MS = 1000, METRICS_MS = 2000;

let call = null, ctx = null, inLevel = null, outLevel = null, finishing = false;
let timers = [], metricsBase = null, outPeak = 0, paced = false;
const user = new Transcript($("transcript"), "user");
const assistant = new Transcript($("assistant"), "assistant");
const calls = new Calls($("calls"), $("function"), (event) => call && call.send(event), log);
const clock = new TurnClock(showTurn);

// --- status, errors, log --------------------------------------------------

function setStatus(text) {
  $("status").textContent = text;
  document.body.dataset.state = text.split(":")[0];
}

function log(text, kind = "event") {
  const line = document.createElement("div");
  line.className = kind;
  line.textContent = new Date().toISOString().slice(11, 23) + " " + text;
  const box = $("log");
  box.append(line);
  while (box.childElementCount > 300) box.firstElementChild.remove();
  box.scrollTop = box.scrollHeight;
}

function showError(text) {
  const item = document.createElement("li");
  item.textContent = new Date().toISOString().slice(11, 19) + " " + text;
  $("errors").prepend(item);
  log(text, "error");
}

function fail(text) {
  showError(text);
  setStatus("error: " + text);
}

window.addEventListener("error", (e) => showError("page: " + e.message));
window.addEventListener("unhandledrejection", (e) => showError("page: " + (e.reason && e.reason.message || e.reason)));

// --- settings ---------------------------------------------------------------

function sessionConfig() {
  const session = {type: "realtime", instructions: $("prompt").value.trim(),
                   seed: Math.max(0, parseInt($("seed").value, 10) || 0)};
  const context = $("context").value.trim();
  if (context) session.context_seconds = Number(context);
  session.audio = {input: {turn_detection: $("ptt-mode").checked ? null
    : {type: "server_vad", silence_duration_ms: 800}}};
  if ($("use-tools").checked) {
    let tools;
    try { tools = JSON.parse($("tools").value); } catch (err) {
      throw new Error("tools: not JSON: " + err.message);
    }
    if (!Array.isArray(tools)) throw new Error("tools: a JSON list of function tools");
    session.tools = tools;
    session.tool_choice = "auto";
  }
  return session;
}

// --- connecting --------------------------------------------------------------

const hooks = {
  event: onEvent,
  error: (text) => fail(text),
  warn: (text) => showError(text),
  note: (text) => log(text, "note"),
  counted: showCounts,
  input: (stream) => { inLevel = new Level(ctx, ctx.createMediaStreamSource(stream)); },
  output: (stream) => {
    const audio = $("speaker");
    audio.srcObject = stream;  // Chrome feeds WebAudio from a remote track only while it plays
    audio.play().catch((err) => showError("playback: " + err));
    outLevel = new Level(ctx, ctx.createMediaStreamSource(stream));
  },
  closed: (reason) => {
    stopTimers();
    const state = document.body.dataset.state;
    if (state !== "done" && state !== "error") setStatus("closed: " + reason);
    log("closed: " + reason, "note");
    buttons(false);
  },
};

async function start() {
  buttons(true);
  finishing = false; outPeak = 0; metricsBase = null; paced = false;
  user.clear(); assistant.clear(); calls.clear();
  for (const id of ["sent", "received"]) $(id).textContent = "0";
  let session;
  try { session = sessionConfig(); } catch (err) { fail(err.message); buttons(false); return; }
  try {
    ctx = ctx || new AudioContext();
    await ctx.resume();
    inLevel = outLevel = null;
    const transport = $("transport").value;
    if (transport === "webrtc") {
      call = new WebRTCCall(prefix, hooks);
    } else {
      const output = ctx.createGain();
      output.connect(ctx.destination);
      outLevel = new Level(ctx, output);
      call = new SocketCall(prefix, hooks, transport === "vlm" ? VLM : GA, ctx, output);
    }
    call.setMuted($("ptt-mode").checked || $("mute").classList.contains("on"));
    setStatus("connecting: " + transport);
    startTimers();
    const ice = $("ice").value.trim();
    await call.connect($("key").value.trim(), session, ice ? JSON.parse(ice) : []);
    setStatus("configuring: waiting for the session");
    $("update").disabled = !call.dialect.turns;
  } catch (err) {
    const closed = call && call.done;
    showError(err.message || String(err));
    if (!closed) { setStatus("error: " + (err.message || err)); if (call) call.finish("failed"); else buttons(false); }
  }
}

function buttons(connected) {
  $("start").disabled = connected;
  $("stop").disabled = $("hangup").disabled = $("update").disabled = !connected;
  $("transport").disabled = connected;
}

// Finish: the user's turn ends (commit), the page asks for an answer and hangs
// up once it is done (the old page's Stop).
function finish() {
  if (!call) return;
  $("stop").disabled = true;
  finishing = true;
  if (call.kind === "websocket") call.stopAudio(); else call.setMuted(true);
  for (const event of call.dialect.finish()) call.send(event);
  setStatus("committed: finishing the answer");
}

function hangup() { if (call) call.hangup(); }

function setMute(on) {
  $("mute").classList.toggle("on", on);
  $("mute").textContent = on ? "Unmute" : "Mute";
  if (call) call.setMuted(on || ($("ptt-mode").checked && !talking));
}

let talking = false;
function talk(on) {
  if (talking === on || !$("ptt-mode").checked) return;
  talking = on;
  $("ptt").classList.toggle("on", on);
  if (!call) return;
  call.setMuted(!on || $("mute").classList.contains("on"));
  if (!on && call.dialect.turns) call.send({type: "input_audio_buffer.commit"});  // answer now
}

// --- events ---------------------------------------------------------------

function onEvent(event) {
  const type = event.type;
  if (type !== "response.output_audio.delta") log(type + brief(event));
  switch (type) {
    case "session.created":
      if (call.kind === "webrtc") ready(event.session);
      break;
    case "session.updated":
      ready(event.session);
      break;
    case "input_audio_buffer.speech_started":
      user.open(event.item_id);
      break;
    case "input_audio_buffer.speech_stopped":
      clock.serverStopped(performance.now());
      break;
    case "conversation.item.input_audio_transcription.delta":
      user.append(event.item_id, event.delta);
      break;
    case "conversation.item.input_audio_transcription.completed":
      user.close(event.item_id);
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      assistant.append(event.response_id, event.delta);
      break;
    case "response.output_audio.delta":
      if (call.play) call.play(event.delta, event.rate || GA.inputRate);
      break;
    case "console.function.delta":  // mlx-vlm's raw function channel
      $("function").append(event.delta);
      break;
    case "response.output_item.added":
      if (event.item && event.item.type === "function_call") calls.added(event.item);
      if (event.item && event.item.type === "mcp_call") {  // a tool the server runs (MCP)
        calls.added({call_id: event.item.id, name: event.item.name,
                     server_label: event.item.server_label});
      }
      break;
    case "response.mcp_call_arguments.done":
      calls.done(event.item_id, null, event.arguments);
      break;
    case "conversation.item.done":
      if (event.item && event.item.type === "mcp_call") {
        calls.ran(event.item.id, event.item.output, event.item.error);
      }
      break;
    case "console.tool.ran":  // mlx-vlm's result of a call the server ran
      calls.ran(event.call_id, event.output, event.error);
      break;
    case "response.function_call_arguments.delta":
      calls.delta(event.call_id, event.delta);
      break;
    case "response.function_call_arguments.done":
      calls.done(event.call_id, event.name, event.arguments);
      break;
    case "conversation.item.added":
      if (event.item && event.item.type === "function_call_output") calls.acked(event.item);
      break;
    case "response.done":
      responseDone(event.response || {});
      if (event.voicechat) showPace(event.voicechat);
      break;
    case "error":
      onServerError(event.error || {});
      break;
  }
}

function brief(event) {
  const part = event.delta !== undefined ? event.delta : event.transcript;
  return typeof part === "string" ? " " + JSON.stringify(part.slice(0, 60)) : "";
}

function ready(session) {
  if (document.body.dataset.state !== "configuring" && document.body.dataset.state !== "connecting") return;
  setStatus("ready: " + session.model + " (speak; Finish ends your turn and hangs up after the answer)");
  if (call.startAudio) call.startAudio().catch((err) => fail("microphone: " + err.message));
}

function responseDone(response) {
  assistant.close(response.id);
  if (response.status === "failed") showError("response failed: " + JSON.stringify(response.status_details));
  const metadata = response.metadata || {};
  if (finishing && metadata.source === FINISH) {
    setStatus("done");
    call.hangup();
  }
}

function onServerError(error) {
  const text = `${error.code || error.type}: ${error.message}` + (error.param ? ` (${error.param})` : "");
  showError("server: " + text);
  if (finishing) { setStatus("error: " + text); call.hangup(); }
}

// --- meters, latency, counters ---------------------------------------------------

function startTimers() {
  stopTimers();
  timers.push(setInterval(levels, LEVEL_MS), setInterval(stats, STATS_MS),
              setInterval(lateness, METRICS_MS));
}

function stopTimers() { timers.forEach(clearInterval); timers = []; }

function levels() {
  const input = inLevel ? inLevel.read() : 0, output = outLevel ? outLevel.read() : 0;
  outPeak = Math.max(outPeak, output);
  $("level-in").value = Math.min(1, input * 4);
  $("level-out").value = Math.min(1, output * 4);
  $("level-in-text").textContent = input.toFixed(3);
  $("level-out-text").textContent = output.toFixed(3);
  $("level-out-peak").textContent = outPeak.toFixed(3);
  clock.tick(performance.now(), input, output);
}

function turnRow(turn) {
  const row = document.createElement("tr");
  const cell = (v) => { const td = document.createElement("td"); td.textContent = v; row.append(td); };
  cell(String($("turns").childElementCount + 1));
  cell(turn.vadMs === null ? "-" : turn.vadMs + " ms");
  cell(turn.serverMs === null ? "-" : turn.serverMs + " ms");
  cell("");  // the server's lateness, when its response is done
  $("turns").append(row);
  return row;
}

function showTurn(turn) {
  turnRow(turn);
  const figure = turn.vadMs !== null ? turn.vadMs : turn.serverMs;
  $("latency").textContent = figure + " ms" + (turn.vadMs !== null ? " (page VAD)" : " (speech_stopped)");
}

const lateText = (p) => `${p.late_frames} late of ${p.frames} frames` +
  (p.frames ? ` (${(100 * p.late_frames / p.frames).toFixed(1)}%)` : "") +
  (p.late_frames && p.max_late_ms !== undefined ? `, worst +${p.max_late_ms} ms` : "");

// The server's lateness for this session (the voicechat extension of GA's
// response.done): the response's in the latest turn's row (a row of its own
// when that one has it already), the session's so far overall.
function showPace(pace) {
  const last = $("turns").lastElementChild;
  const row = last && last.lastChild.textContent === "" ? last : turnRow({vadMs: null, serverMs: null});
  row.lastChild.textContent = lateText(pace);
  if (!pace.session) return;
  paced = true;
  $("lateness").textContent = lateText(pace.session) + ", this session";
}

function showCounts() {
  if (!call) return;
  $("sent").textContent = String(call.sent);
  $("received").textContent = String(call.received);
}

async function stats() {
  if (!call) return;
  const s = await call.stats();
  showCounts();
  if (!s || s.samples === undefined) return;
  const concealed = s.samples ? (100 * s.concealed / s.samples).toFixed(1) : "0.0";
  $("rtc-stats").textContent = `jitter ${(1000 * (s.jitter || 0)).toFixed(0)} ms, ` +
    `lost ${s.lost || 0} packets, concealed ${concealed}% of the output`;
}

// Until a response.done tells this session's own figure (mlx-vlm's route never
// does): the server's late frames (steps slower than a frame of wall time), all
// sessions, since this call began, from /metrics, which needs the server's key.
async function lateness() {
  if (paced) return;
  const key = $("key").value.trim();
  const headers = key && !key.startsWith("ek_") ? {Authorization: "Bearer " + key} : {};
  let text;
  try {
    const response = await fetch(prefix + "/metrics", {headers});
    if (response.status === 401) { $("lateness").textContent = "(/metrics needs the server's API key)"; return; }
    if (!response.ok) { $("lateness").textContent = `(/metrics: HTTP ${response.status})`; return; }
    text = await response.text();
  } catch (err) { $("lateness").textContent = "(/metrics: " + err + ")"; return; }
  const read = (name) => { const m = text.match(new RegExp("^" + name + " ([0-9.e+]+)$", "m")); return m ? Number(m[1]) : 0; };
  const now = {frames: read("voicechat_frames_total"), late: read("voicechat_late_frames_total")};
  metricsBase = metricsBase || now;
  const frames = now.frames - metricsBase.frames, late = now.late - metricsBase.late;
  $("lateness").textContent = lateText({frames, late_frames: late}) + ", all sessions";
}

// --- wiring -----------------------------------------------------------------

$("start").onclick = start;
$("stop").onclick = finish;
$("hangup").onclick = hangup;
$("mute").onclick = () => setMute(!$("mute").classList.contains("on"));
$("update").onclick = () => {
  try { call.send({type: "session.update", session: sessionConfig()}); } catch (err) { fail(err.message); }
};
$("ptt-mode").onchange = () => { $("ptt").disabled = !$("ptt-mode").checked; setMute($("mute").classList.contains("on")); };
for (const [down, up] of [["mousedown", "mouseup"], ["touchstart", "touchend"]]) {
  $("ptt").addEventListener(down, (e) => { e.preventDefault(); talk(true); });
  $("ptt").addEventListener(up, () => talk(false));
}
$("ptt").addEventListener("mouseleave", () => talk(false));
const typing = (e) => ["INPUT", "TEXTAREA", "SELECT"].includes(e.target.tagName);
document.addEventListener("keydown", (e) => { if (e.code === "Space" && !typing(e)) { e.preventDefault(); talk(true); } });
document.addEventListener("keyup", (e) => { if (e.code === "Space" && !typing(e)) talk(false); });
const wanted = new URLSearchParams(location.search).get("transport");
if (["webrtc", "websocket", "vlm"].includes(wanted)) $("transport").value = wanted;
if (!window.RTCPeerConnection) { $("transport").value = "websocket"; log("no WebRTC in this browser: WebSocket", "note"); }
setStatus("idle");
