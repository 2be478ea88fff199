// LiveKit agents-js's GPTLiveModel (@livekit/agents-plugin-openai) run against the server:
// node livekit_gpt_live.cjs BASE_URL API_KEY QUESTION_24K_PCM16 -> one JSON line on stdout.
// Its session starts with a get_weather tool, sends the question, answers the delegated call
// through the framework (a FunctionCallOutput), mutes, and closes. Every step is bounded.
"use strict";
const fs = require("node:fs");
const { initializeLogger, llm } = require("@livekit/agents");
const { AudioFrame } = require("@livekit/rtc-node");
const { realtime } = require("@livekit/agents-plugin-openai");
const { z } = require("zod");

const [baseURL, apiKey, questionPath] = process.argv.slice(2);
const RATE = 24000;
const STEP_MS = 10000;

initializeLogger({ pretty: false, level: process.env.LK_LOG_LEVEL || "silent" });

async function until(what, condition) {
  const end = Date.now() + STEP_MS;
  while (!condition()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

function frames(pcm) {
  const samples = new Int16Array(pcm.buffer, pcm.byteOffset, pcm.byteLength / 2);
  const step = RATE / 10;
  const out = [];
  for (let at = 0; at < samples.length; at += step) {
    const chunk = samples.slice(at, at + step);
    out.push(new AudioFrame(chunk, RATE, 1, chunk.length));
  }
  return out;
}

async function main() {
  const result = { errors: [], calls: [], transcripts: [], userTranscripts: [], audioFrames: 0,
                   events: [] };
  const weather = llm.tool({
    name: "get_weather",
    description: "Current weather for a city.",
    parameters: z.object({ city: z.string() }),
    execute: async () => '{"temp": 21}',
  });
  const model = new realtime.GPTLiveModel({ apiKey, baseURL });
  const session = model.session();
  if (process.env.LK_TRACE) {
    session.on("openai_client_event_queued", (e) => process.stderr.write(
      `> ${JSON.stringify(e).slice(0, 300)}\n`));
    session.on("openai_server_event_received", (e) => process.stderr.write(
      `< ${JSON.stringify(e).slice(0, 300)}\n`));
  }
  session.on("openai_server_event_received", (event) => result.events.push(event));
  session.on("error", (event) => result.errors.push(String(event.error ?? event)));
  session.on("function_call", (call) => result.calls.push(
    { callId: call.callId, name: call.name, args: call.args }));
  session.on("transcript_delta", (delta) => result.transcripts.push(delta.text));
  session.on("input_audio_transcription_completed", (event) =>
    result.userTranscripts.push(event.transcript));
  // What an AgentSession does first: the startup configuration, then the connection starts.
  await session._updateSession("Be brief.", undefined, new llm.ToolContext([weather]));
  const reader = session.audioStream.getReader();
  const reading = (async () => {
    for (;;) {
      const { done } = await reader.read();
      if (done) return;
      result.audioFrames += 1;
    }
  })();
  await until("session.started", () => session.sessionId !== undefined);
  result.sessionId = session.sessionId;
  for (const frame of frames(fs.readFileSync(questionPath))) session.pushAudio(frame);
  await until("the delegated call", () => result.calls.length > 0);
  const call = result.calls[0];
  await session._appendItems([new llm.FunctionCallOutput(
    { callId: call.callId, name: call.name, output: '{"temp": 21}', isError: false })]);
  for (const frame of frames(Buffer.alloc(RATE * 2))) session.pushAudio(frame);
  session.muteInput();
  await new Promise((resolve) => setTimeout(resolve, 500));
  await session.close();
  await Promise.race([reading, new Promise((resolve) => setTimeout(resolve, STEP_MS))]);
  // exit once the line is written (a pipe takes it in parts)
  await new Promise((resolve) => process.stdout.write(JSON.stringify(result) + "\n", resolve));
}

main().then(() => process.exit(0), (error) => {
  process.stderr.write(String(error && error.stack || error) + "\n");
  process.exit(1);
});
