// What the console says on each route: OpenAI Realtime GA (WebRTC and its
// WebSocket) and mlx-vlm's WebSocket, whose events are read here as GA ones so
// the page handles one vocabulary. mlx-vlm's also carries what GA has no event
// for: the model's raw function channel and the acknowledgement of a tool
// result's injection.
"use strict";

export const FINISH = "console-finish";  // the metadata of the response Finish waits for

export const GA = {
  name: "ga",
  path: "/openai/v1/realtime",
  inputRate: 24000,    // audio/pcm
  audioEvent: "response.output_audio.delta",
  session: (s) => s,   // the page's settings are GA's session fields
  // End the user's turn, and ask for a response (tagged: the page waits for its response.done).
  finish: () => [{type: "input_audio_buffer.commit"},
                 {type: "response.create", response: {metadata: {source: FINISH}}}],
  turns: true,         // a commit ends a turn (push-to-talk); session.update may come again
  read: (event) => [event],
};

export const VLM = {
  name: "vlm",
  path: "/v1/realtime",
  inputRate: 16000,    // mlx-vlm's PCM16
  audioEvent: "response.output_audio.delta",
  session: (s) => {
    const out = {system_prompt: s.instructions || null, seed: s.seed};
    if (s.context_seconds !== undefined) out.context_seconds = s.context_seconds;
    if (s.tools) out.tools = s.tools;
    return out;
  },
  // A commit ends mlx-vlm's stream: the rest runs, response.done, the server closes.
  finish: () => [{type: "input_audio_buffer.commit"}],
  turns: false,        // one session.update; a commit ends the stream
  read: readVlm,
};

const ID = "vlm";  // mlx-vlm's stream is one user item and one response

function readVlm(event) {
  switch (event.type) {
    case "response.text.delta":
      return [{type: "response.output_audio_transcript.delta", response_id: ID, delta: event.delta}];
    case "conversation.item.input_audio_transcription.delta":
      return [{type: event.type, item_id: ID, delta: event.delta}];
    case "response.audio.delta":
      return [{type: "response.output_audio.delta", delta: event.delta, rate: event.sample_rate}];
    case "response.function.delta":
      return [{type: "console.function.delta", delta: event.delta}];
    case "response.function_call_arguments.done":
      return [{type: "response.output_item.added",
               item: {type: "function_call", call_id: event.call_id, name: event.name,
                      server_label: event.server_label}},
              {type: event.type, call_id: event.call_id, name: event.name,
               arguments: event.arguments}];
    case "conversation.item.function_call_output":  // a call the server ran ended
      return [{type: "console.tool.ran", call_id: event.call_id, output: event.output,
               error: event.error}];
    case "conversation.item.function_call_output.injected":
      return [{type: "conversation.item.added", item: {type: "function_call_output",
               call_id: event.call_id, id: `injected at frame ${event.first_frame_index}, ` +
               `${event.num_tokens} tokens`}}];
    case "response.done":
      return [{type: "response.done", response: {id: ID, status: "completed",
                                                 metadata: {source: FINISH}}}];
    case "session.warning":
      return [{type: "error", error: {code: "warning", message: event.message}}];
    default:
      return [event];
  }
}
