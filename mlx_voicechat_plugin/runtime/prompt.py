"""The system prompt a conversation prefills: its text, the tool block and its token ids."""

from __future__ import annotations

from typing import Any

from .options import ConversationOptions
from .tools import DEFAULT_MAX_TOOLS, ToolSet, render_system_prompt


def prompt_token_ids(tokenizer: Any, model: Any, system_prompt: str | None) -> list[int]:
    """``[BOS] + tokens + [EOS]`` of a non-blank system prompt, else nothing."""
    text = model.config.default_system_prompt if system_prompt is None else system_prompt
    if not text.strip():
        return []
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return [model.config.bos_token_id, *tokens, model.config.eos_token_id]


def tool_prompt(
    tokenizer: Any, model: Any, system_prompt: str | None, tools: list[dict] | None,
    max_tools: int = DEFAULT_MAX_TOOLS,
) -> tuple[list[int], ToolSet | None]:
    """Prompt ids with the tool block rendered in, and the validated tools (or ``None``)."""
    if tools is None:
        return prompt_token_ids(tokenizer, model, system_prompt), None
    toolset = ToolSet(tools, max_tools)
    base = model.config.default_system_prompt if system_prompt is None else system_prompt
    rendered = render_system_prompt(base, toolset)
    return prompt_token_ids(tokenizer, model, rendered), toolset


def session_prompt(
    tokenizer: Any, model: Any, options: ConversationOptions
) -> tuple[list[int], ToolSet | None]:
    """The options' prompt ids and tools, checked against ``max_prompt_tokens``."""
    prompt, toolset = tool_prompt(
        tokenizer, model, options.system_prompt, options.tools, options.max_tools
    )
    limit = options.max_prompt_tokens
    if limit is not None and len(prompt) > limit:
        raise ValueError(
            f"the system prompt and tools are {len(prompt)} tokens; at most "
            f"max_prompt_tokens={limit} are allowed"
        )
    return prompt, toolset
