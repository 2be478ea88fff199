"""Scripted function-channel output for the tool-calling tests."""

from __future__ import annotations


WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
VALID = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
RESULT = '{"temp": 21}'


def short_tool_prompt(monkeypatch) -> None:
    """Validate and render the real tool block, but prefill a short stand-in.

    The rendered text is pinned in test_tools.py; prefilling its hundreds of
    positions in every session test would only cost time.
    """
    from mlx_voicechat_plugin.runtime import prompt, tools

    def render(system_message, toolset):
        tools.render_system_prompt(system_message, toolset)
        return system_message + " [tools]"

    monkeypatch.setattr(prompt, "render_system_prompt", render)


class Script:
    """Makes the function head 'emit' ``text`` from generated frame ``start`` on.

    Every other generated frame emits pad. Forced (injected) frames pass
    through untouched. ``inputs`` / ``forced`` record, per generated frame, the
    previous-function input the position read and the forced id it was given.
    """

    def __init__(self, tokenizer, pad: int, text: str, start: int = 2):
        self.tokenizer = tokenizer
        self.tokens = self.tokenizer_encode(text) if text else []
        self.pad, self.start = pad, start
        self.inputs: list[int] = []
        self.forced: list[int | None] = []

    def tokenizer_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def install(self, monkeypatch):
        from mlx_voicechat_plugin.runtime.timeline import Timeline

        original = Timeline.listen
        script = self

        def listen(timeline, audio, forced=None, *, generate=True, **kwargs):
            if not generate:  # a prompt position
                return original(timeline, audio, forced, generate=False, **kwargs)
            (force,) = forced  # one scripted conversation
            index = len(script.inputs)
            script.inputs.append(int(timeline.prev_function.item()))
            script.forced.append(force)
            if force is not None:
                return original(timeline, audio, forced, **kwargs)
            at = index - script.start
            token = script.tokens[at] if 0 <= at < len(script.tokens) else script.pad
            tokens = original(timeline, audio, [token], **kwargs)
            tokens.forced = [False]  # the head "predicted" it
            return tokens

        monkeypatch.setattr(Timeline, "listen", listen)
        return self
