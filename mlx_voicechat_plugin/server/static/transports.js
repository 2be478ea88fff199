// The console's two ways to the server's OpenAI Realtime GA session:
// WebRTC (POST .../realtime/calls, events on the "oai-events" data channel,
// audio as Opus tracks) and the GA WebSocket (base64 PCM16 in JSON events).
// Both call hooks.event(event), hooks.error(text), hooks.closed(reason).
"use strict";

import {Capture, Player, openMicrophone} from "./audio.js";

import {GA} from "./dialects.js";

export const REALTIME = GA.path;
export const CALLS = REALTIME + "/calls";
export const CLIENT_SECRETS = REALTIME + "/client_secrets";
const ICE_GATHERING_MS = 3000;  // the server takes no trickled candidates: all in the offer

// A failed fetch as one line: status, and the server's error message when it sent one.
export async function describe(response, what) {
  let detail = "";
  try {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      detail = (body.error && (body.error.message || body.error)) || body.detail || text;
    } catch (_) { detail = text; }
  } catch (err) { detail = String(err); }
  return `${what}: HTTP ${response.status}${detail ? ": " + String(detail).slice(0, 300) : ""}`;
}

// The key the WebRTC request carries. A key starting with ek_ is used as is;
// any other key (the server's own) only mints a short-lived, single-use one at
// client_secrets; without a key the page mints one (no auth needed then) or,
// where the server has no client_secrets, goes on without.
export async function callKey(prefix, key, warn) {
  if (key.startsWith("ek_")) return {token: key, note: "ephemeral key as given"};
  const headers = {"Content-Type": "application/json"};
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(prefix + CLIENT_SECRETS, {method: "POST", headers,
    body: JSON.stringify({expires_after: {anchor: "created_at", seconds: 60}})});
  if (response.ok) {
    const body = await response.json();
    const left = Math.round(body.expires_at - Date.now() / 1000);
    return {token: body.value, note: `ephemeral key minted (expires in ${left} s)`};
  }
  if (response.status === 404 && !key) return {token: null, note: "no key"};
  if (response.status === 404) {
    warn("this server has no client_secrets route: the WebRTC request carries the key itself");
    return {token: key, note: "the key itself (no client_secrets)"};
  }
  throw new Error(await describe(response, "minting an ephemeral key"));
}

function waitForIce(pc, ms) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); resolve(); };
    const timer = setTimeout(done, ms);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") done();
    });
  });
}

class Call {
  constructor(prefix, hooks) {
    this.prefix = prefix; this.hooks = hooks;
    this.sent = 0; this.received = 0; this.muted = false; this.open = false;
    this.dialect = GA;
  }

  event(text) {
    let event;
    try { event = JSON.parse(text); } catch (err) {
      this.hooks.error("a server message is not JSON: " + String(text).slice(0, 120));
      return;
    }
    for (const read of this.dialect.read(event)) this.hooks.event(read);
  }
}

export class WebRTCCall extends Call {
  kind = "webrtc";

  // Microphone, key, offer, answer; resolves once the answer is set.
  async connect(key, session, iceServers = []) {
    this.stream = await openMicrophone();
    this.hooks.input(this.stream);
    const {token, note} = await callKey(this.prefix, key, this.hooks.warn);
    this.token = token;
    this.hooks.note("key: " + note);
    const pc = this.pc = new RTCPeerConnection({iceServers});
    for (const track of this.stream.getAudioTracks()) pc.addTrack(track, this.stream);
    pc.ontrack = (e) => this.hooks.output(e.streams[0] || new MediaStream([e.track]));
    pc.oniceconnectionstatechange = () => {
      this.hooks.note("ICE: " + pc.iceConnectionState);
      if (pc.iceConnectionState === "failed") {
        this.hooks.error("ICE failed: no route to the server's candidates (see --ice-host, TURN)");
      }
    };
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "failed") this.hooks.error("WebRTC connection failed");
      if (["failed", "closed"].includes(pc.connectionState)) this.finish("connection " + pc.connectionState);
    };
    const channel = this.channel = pc.createDataChannel("oai-events");
    this.queue = [];
    channel.onopen = () => {
      this.open = true;
      for (const event of this.queue.splice(0)) this.send(event);
    };
    channel.onmessage = (m) => this.event(m.data);
    channel.onclose = () => this.finish("data channel closed");
    await pc.setLocalDescription(await pc.createOffer());
    await waitForIce(pc, ICE_GATHERING_MS);
    const form = new FormData();
    form.set("sdp", pc.localDescription.sdp);
    form.set("session", JSON.stringify(session));
    const headers = token ? {Authorization: "Bearer " + token} : {};
    const response = await fetch(this.prefix + CALLS, {method: "POST", body: form, headers});
    if (response.status !== 201) throw new Error(await describe(response, "the call"));
    this.location = response.headers.get("Location");
    this.hooks.note("call: " + (this.location || "(no Location)"));
    await pc.setRemoteDescription({type: "answer", sdp: await response.text()});
  }

  send(event) {
    if (!this.channel || this.channel.readyState === "connecting") { (this.queue ||= []).push(event); return; }
    if (this.channel.readyState !== "open") return this.hooks.error("not sent: the data channel is " + this.channel.readyState);
    this.channel.send(JSON.stringify(event));
  }

  setMuted(muted) {
    this.muted = muted;  // a disabled track sends silence: the timeline keeps running
    if (this.stream) for (const track of this.stream.getAudioTracks()) track.enabled = !muted;
  }

  // Packets sent and received so far, and what the receiver's jitter buffer saw.
  async stats() {
    if (!this.pc) return null;
    const out = {};
    (await this.pc.getStats()).forEach((s) => {
      if (s.type === "outbound-rtp" && s.kind === "audio") this.sent = s.packetsSent;
      if (s.type === "inbound-rtp" && s.kind === "audio") {
        this.received = s.packetsReceived;
        Object.assign(out, {jitter: s.jitter, lost: s.packetsLost,
          concealed: s.concealedSamples, samples: s.totalSamplesReceived});
      }
    });
    return out;
  }

  async hangup() {
    const location = this.location;
    this.location = null;
    if (location) {
      const headers = this.token ? {Authorization: "Bearer " + this.token} : {};
      try {
        const response = await fetch(location, {method: "DELETE", headers});
        if (!response.ok && response.status !== 404) {
          this.hooks.warn(await describe(response, "hang-up (the call ends with the connection)"));
        }
      } catch (err) { this.hooks.warn("hang-up: " + err); }
    }
    this.finish("hung up");
  }

  finish(reason) {
    if (this.done) return;
    this.done = true; this.open = false;
    if (this.pc) this.pc.close();
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    this.hooks.closed(reason);
  }
}

export class SocketCall extends Call {
  kind = "websocket";

  constructor(prefix, hooks, dialect, ctx, output) {
    super(prefix, hooks);
    this.dialect = dialect; this.ctx = ctx;
    this.player = new Player(ctx, output);
  }

  // Microphone and socket; resolves once the socket is open. A browser cannot set
  // Authorization on a WebSocket: the key goes as a subprotocol beside "realtime".
  async connect(key, session) {
    this.stream = await openMicrophone();
    this.hooks.input(this.stream);
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host +
                this.prefix + this.dialect.path;
    const ws = this.ws = key ? new WebSocket(url, ["realtime", "openai-insecure-api-key." + key])
                             : new WebSocket(url);
    ws.onmessage = (m) => this.event(m.data);
    await new Promise((resolve, reject) => {  // a refused upgrade: onerror, then onclose
      ws.onopen = resolve;
      ws.onclose = (e) => {
        const why = `the server refused or did not answer the WebSocket (code ${e.code}; ` +
                    "a wrong key, or an origin not allowed?)";
        this.finish(why);
        reject(new Error(why));
      };
    });
    ws.onclose = (e) => this.finish("code " + e.code + (e.reason ? " " + e.reason : ""));
    ws.onerror = () => this.hooks.error("WebSocket error");
    this.open = true;
    this.send({type: "session.update", session: this.dialect.session(session)});
  }

  // The microphone starts flowing once the session is configured.
  async startAudio() {
    if (this.capture) return;
    this.capture = new Capture(this.ctx, this.stream, this.dialect.inputRate, (audio) => {
      this.send({type: "input_audio_buffer.append", audio});
      this.sent++;
      this.hooks.counted();
    });
    this.capture.muted = this.muted;
    await this.capture.start();
  }

  stopAudio() { if (this.capture) this.capture.stop(); }

  play(delta, rate) { this.received++; this.player.play(delta, rate); this.hooks.counted(); }

  send(event) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  setMuted(muted) {
    this.muted = muted;  // silence goes instead of the microphone: the timeline keeps running
    if (this.capture) this.capture.muted = muted;
  }

  async stats() { return null; }

  async hangup() {
    this.stopAudio();
    if (this.ws) this.ws.close(1000);
    else this.finish("hung up");
  }

  finish(reason) {
    if (this.done) return;
    this.done = true; this.open = false;
    this.stopAudio();
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    this.hooks.closed(reason);
  }
}
