// The console's audio: the microphone, the WebSocket path's PCM16 capture and
// playback, level meters (WebAudio AnalyserNode) and the per-turn latency.
"use strict";

// What the page asks the browser's audio processing for (WebRTC's echo
// canceller keeps the model, which listens while it speaks, from hearing itself).
export const MIC_CONSTRAINTS = {audio: {channelCount: 1, echoCancellation: true,
                                        noiseSuppression: true, autoGainControl: true}};
export const CHUNK_MS = 80;        // one model frame a message on the WebSocket path

export async function openMicrophone() {
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    throw new Error("this page has no microphone API (it needs https or localhost)");
  }
  try {
    return await navigator.mediaDevices.getUserMedia(MIC_CONSTRAINTS);
  } catch (err) {
    throw new Error("microphone: " + (err.name || "") + " " + (err.message || err));
  }
}

// Linear-interpolation resampler that keeps its phase across blocks.
export function makeResampler(from, to) {
  const step = from / to;
  let pos = 0, prev = new Float32Array(0);
  return (block) => {
    const sig = new Float32Array(prev.length + block.length);
    sig.set(prev); sig.set(block, prev.length);
    if (sig.length < 2) { prev = sig; return new Float32Array(0); }
    const count = Math.max(Math.floor((sig.length - 1 - pos) / step) + 1, 0);
    const out = new Float32Array(count);
    for (let k = 0; k < count; k++) {
      const t = pos + k * step, i = Math.floor(t), f = t - i;
      out[k] = i + 1 < sig.length ? sig[i] * (1 - f) + sig[i + 1] * f : sig[i];
    }
    const next = pos + count * step;
    const keep = Math.min(Math.floor(next), sig.length - 1);
    prev = sig.slice(keep); pos = next - keep;
    return out;
  };
}

export function pcm16Base64(samples) {
  const bytes = new Uint8Array(samples.length * 2);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < samples.length; i++) {
    const v = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32768)));
    view.setInt16(2 * i, v, true);
  }
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

// The microphone as 80 ms PCM16 chunks at `rate` (the WebSocket path):
// onChunk(base64) for each; silent while muted (the timeline keeps running).
export class Capture {
  constructor(ctx, stream, rate, onChunk) {
    this.ctx = ctx; this.stream = stream; this.onChunk = onChunk;
    this.muted = false; this.running = false;
    this.chunk = rate * CHUNK_MS / 1000;
    this.pending = []; this.pendingLength = 0;
    this.resample = makeResampler(ctx.sampleRate, rate);
  }

  async start() {
    this.source = this.ctx.createMediaStreamSource(this.stream);
    if (this.ctx.audioWorklet && window.AudioWorkletNode) {
      const code = "registerProcessor('capture', class extends AudioWorkletProcessor {" +
        " process(inputs) { const c = inputs[0] && inputs[0][0];" +
        " if (c) this.port.postMessage(c.slice(0)); return true; } });";
      const url = URL.createObjectURL(new Blob([code], {type: "application/javascript"}));
      await this.ctx.audioWorklet.addModule(url);
      this.node = new AudioWorkletNode(this.ctx, "capture",
                                       {numberOfInputs: 1, numberOfOutputs: 0});
      this.node.port.onmessage = (e) => this.captured(e.data);
    } else {  // insecure origins (plain http off localhost) have no AudioWorklet
      this.node = this.ctx.createScriptProcessor(4096, 1, 1);
      this.node.onaudioprocess = (e) => this.captured(e.inputBuffer.getChannelData(0));
      this.node.connect(this.ctx.destination);  // a ScriptProcessor runs only when connected
    }
    this.source.connect(this.node);
    this.running = true;
  }

  captured(block) {
    if (!this.running) return;
    const samples = this.resample(this.muted ? new Float32Array(block.length) : block);
    this.pending.push(samples); this.pendingLength += samples.length;
    if (this.pendingLength < this.chunk) return;
    const all = this.take();
    let start = 0;
    for (; start + this.chunk <= all.length; start += this.chunk) {
      this.onChunk(pcm16Base64(all.subarray(start, start + this.chunk)));
    }
    if (start < all.length) { this.pending.push(all.slice(start)); this.pendingLength = all.length - start; }
  }

  take() {
    const all = new Float32Array(this.pendingLength);
    let at = 0;
    for (const piece of this.pending) { all.set(piece, at); at += piece.length; }
    this.pending = []; this.pendingLength = 0;
    return all;
  }

  // Stop capturing; the audio not yet sent goes out as a last chunk, padded with
  // silence to 80 ms (the server's resampler makes nothing of a few samples).
  stop() {
    if (!this.running) return;
    this.running = false;
    if (this.source) this.source.disconnect();
    if (this.node) this.node.disconnect();
    if (!this.pendingLength) return;
    const last = new Float32Array(this.chunk);
    last.set(this.take().subarray(0, this.chunk));
    this.onChunk(pcm16Base64(last));
  }
}

// The WebSocket path's output: base64 PCM16 chunks scheduled back to back into `output`.
export class Player {
  constructor(ctx, output) { this.ctx = ctx; this.output = output; this.playAt = 0; }

  play(base64, rate) {
    const raw = atob(base64);
    const count = raw.length >> 1;
    if (!count) return;
    const buffer = this.ctx.createBuffer(1, count, rate);
    const data = buffer.getChannelData(0);
    for (let i = 0; i < count; i++) {
      let v = raw.charCodeAt(2 * i) | (raw.charCodeAt(2 * i + 1) << 8);
      if (v >= 0x8000) v -= 0x10000;
      data[i] = v / 32768;
    }
    const player = this.ctx.createBufferSource();
    player.buffer = buffer;
    player.connect(this.output);
    this.playAt = Math.max(this.playAt, this.ctx.currentTime + 0.05);
    player.start(this.playAt);
    this.playAt += buffer.duration;
  }
}

// The level (RMS, 0..1) of what flows through an AnalyserNode.
export class Level {
  constructor(ctx, node) {
    this.analyser = ctx.createAnalyser();
    this.analyser.fftSize = 1024;
    this.data = new Float32Array(this.analyser.fftSize);
    node.connect(this.analyser);
  }

  read() {
    this.analyser.getFloatTimeDomainData(this.data);
    let sum = 0;
    for (const v of this.data) sum += v * v;
    return Math.sqrt(sum / this.data.length);
  }
}

// Per turn: the end of the user's speech to the first audible answer, two ways:
// - vadMs: from the page's own VAD (the last moment the microphone's level was
//   above SPEECH_LEVEL) to the first moment the output level is above
//   ANSWER_LEVEL after QUIET_MS of quiet (none while the user still speaks);
// - serverMs: from the arrival of the server's input_audio_buffer.speech_stopped
//   (sent after silence_duration_ms without transcript) to the next audible output.
export const SPEECH_LEVEL = 0.02;
export const ANSWER_LEVEL = 0.01;
const QUIET_MS = 400;

export class TurnClock {
  constructor(onTurn) {
    this.onTurn = onTurn;
    this.lastSpeech = null;     // page VAD: the mic's last loud moment
    this.speechStopped = null;  // when the server's speech_stopped arrived
    this.lastLoud = -Infinity;  // the output's last loud moment
  }

  serverStopped(now) { this.speechStopped = now; }

  tick(now, input, output) {
    if (input > SPEECH_LEVEL) this.lastSpeech = now;
    if (output <= ANSWER_LEVEL) return;
    const onset = now - this.lastLoud > QUIET_MS;
    this.lastLoud = now;
    const turn = {vadMs: null, serverMs: null};
    if (onset && this.lastSpeech !== null && input <= SPEECH_LEVEL) {
      turn.vadMs = Math.round(now - this.lastSpeech);
      this.lastSpeech = null;
    }
    if (this.speechStopped !== null) {
      turn.serverMs = Math.round(now - this.speechStopped);
      this.speechStopped = null;
    }
    if (turn.vadMs !== null || turn.serverMs !== null) this.onTurn(turn);
  }
}
