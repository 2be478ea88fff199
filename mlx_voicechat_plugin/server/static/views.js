// The console's live views: a transcript (one block per user item or assistant
// response, so the box's text is every delta in order) and the tool calls.
"use strict";

export class Transcript {
  constructor(box, role) { this.box = box; this.role = role; this.turns = new Map(); }

  clear() { this.box.replaceChildren(); this.turns.clear(); }

  open(id) {
    let turn = this.turns.get(id);
    if (!turn) {
      turn = document.createElement("span");
      turn.className = "turn " + this.role;
      turn.dataset.id = id || "";
      this.box.append(turn);
      this.turns.set(id, turn);
    }
    return turn;
  }

  append(id, delta) {
    if (typeof delta !== "string") return;
    const turn = this.open(id);
    turn.append(delta);
    this.box.scrollTop = this.box.scrollHeight;
  }

  close(id) {
    const turn = this.turns.get(id);
    if (turn) turn.classList.add("done");
  }
}

// A canned answer for the example tool; any other tool gets {"ok": true}.
const CANNED = {get_weather: (args) => ({city: args.city || "here", forecast: "sunny",
                                         temperature_c: 21})};

// The model's tool calls as they arrive (its function channel: name, then the
// arguments), each answerable with a typed or a canned output, and the
// server's acknowledgement of each answer (the function_call_output item).
export class Calls {
  constructor(box, channel, send, log) {
    this.box = box; this.channel = channel; this.send = send; this.log = log;
    this.calls = new Map();
  }

  clear() { this.box.replaceChildren(); this.channel.replaceChildren(); this.calls.clear(); }

  added(item) {
    const entry = document.createElement("li");
    entry.className = "call";
    entry.dataset.callId = item.call_id;
    const title = document.createElement("div");
    title.className = "call-title";
    const server = item.server_label ? `${item.server_label}: ` : "";
    title.textContent = `${server}${item.name || "?"} (${item.call_id})`;
    const args = document.createElement("pre");
    args.className = "call-args";
    const output = document.createElement("input");
    output.type = "text";
    output.className = "call-output";
    output.placeholder = "tool output (JSON or text)";
    const typed = document.createElement("button");
    typed.textContent = "Send output";
    typed.onclick = () => this.answer(item.call_id, output.value);
    const canned = document.createElement("button");
    canned.textContent = "Canned answer";
    canned.className = "call-canned";
    canned.onclick = () => this.answer(item.call_id, this.canned(item.call_id));
    const ack = document.createElement("div");
    ack.className = "call-ack";
    ack.textContent = "waiting for its arguments";
    entry.append(title, args, ack);
    if (item.server_label) {  // the server runs it (an MCP tool): nothing to answer
      entry.classList.add("server-run");
      ack.textContent = `run by the server (${item.server_label})`;
    } else {
      entry.insertBefore(output, ack);
      entry.insertBefore(typed, ack);
      entry.insertBefore(canned, ack);
    }
    this.box.append(entry);
    const line = document.createElement("div");
    line.textContent = `${item.name}(`;
    this.channel.append(line);
    this.calls.set(item.call_id, {item, entry, args, ack, line, text: ""});
  }

  // A call the server ran ended: its output, or its typed failure.
  ran(callId, output, error) {
    const call = this.calls.get(callId);
    const text = error ? `failed: ${error.type}: ${error.message}`
                       : "result: " + String(output || "").slice(0, 200);
    this.log(`${callId} ${text}`, error ? "error" : "note");
    if (!call) return;
    call.ack.textContent = text;
    call.entry.classList.add(error ? "failed" : "acked");
  }

  delta(callId, delta) {
    const call = this.calls.get(callId);
    if (!call || typeof delta !== "string") return;
    call.text += delta;
    call.args.textContent = call.text;
    call.line.append(delta);
  }

  done(callId, name, args) {
    const call = this.calls.get(callId);
    if (!call) return;
    call.text = args;
    call.args.textContent = args;
    call.line.textContent = `${name || call.item.name}(${args})`;
    call.ack.textContent = call.item.server_label ? "running on the server"
                                                  : "waiting for your answer";
  }

  canned(callId) {
    const call = this.calls.get(callId);
    let args = {};
    try { args = JSON.parse(call.text || "{}"); } catch (_) { /* shown as sent */ }
    const make = CANNED[call.item.name];
    return JSON.stringify(make ? make(args) : {ok: true});
  }

  answer(callId, output) {
    const call = this.calls.get(callId);
    this.send({type: "conversation.item.create",
               item: {type: "function_call_output", call_id: callId, output: String(output)}});
    call.sent = "answer sent: " + String(output).slice(0, 120);
    call.ack.textContent = call.sent;
    call.entry.classList.add("answered");
  }

  acked(item) {
    const call = this.calls.get(item.call_id);
    const text = `acknowledged: ${item.id} (${item.type})`;
    this.log(`${item.call_id} ${text}`, "note");
    if (!call) return;
    call.ack.textContent = (call.sent ? call.sent + "; " : "") + text;
    call.entry.classList.add("acked");
  }
}
