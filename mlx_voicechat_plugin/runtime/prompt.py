"""The system prompt a conversation prefills: its text, the tool block and its token ids."""

from __future__ import annotations

from typing import Any

from .options import ConversationOptions
from .tools import ToolSet, render_system_prompt


def session_prompt(
    tokenizer: Any, model: Any, options: ConversationOptions
) -> tuple[list[int], ToolSet | None]:
    """The options' prompt ids (``[BOS] + tokens + [EOS]`` of the system prompt with the
    tool block rendered in, nothing when it is blank) and validated tools (or ``None``),
    checked against ``max_prompt_tokens``."""
    config = model.config
    text = config.default_system_prompt if options.system_prompt is None else options.system_prompt
    toolset = None if options.tools is None else ToolSet(options.tools, options.max_tools)
    if toolset is not None:
        text = render_system_prompt(text, toolset)
    prompt = []
    if text.strip():
        prompt = [config.bos_token_id, *tokenizer.encode(text, add_special_tokens=False),
                  config.eos_token_id]
    limit = options.max_prompt_tokens
    if limit is not None and len(prompt) > limit:
        raise ValueError(
            f"the system prompt and tools are {len(prompt)} tokens; at most "
            f"max_prompt_tokens={limit} are allowed"
        )
    return prompt, toolset
