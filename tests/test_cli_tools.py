"""The offline two-pass tool flow from the command line."""

from __future__ import annotations

import json

from mlx_voicechat_plugin.cli.generate import main
from mlx_voicechat_plugin.testing.fixtures import make_question_wav

from tool_support import RESULT, VALID, WEATHER, Script, short_tool_prompt


def _files(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    response = tmp_path / "response.json"
    response.write_text(RESULT)
    return tools, response, make_question_wav(tmp_path / "q.wav", seconds=1.0)


def test_two_pass_flow_prints_the_call_and_reruns_with_the_result(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from mlx_voicechat_plugin.loader import load_tokenizer

    short_tool_prompt(monkeypatch)
    Script(load_tokenizer(tiny_ckpt), 12, VALID).install(monkeypatch)
    tools, response, wav = _files(tmp_path)
    code = main(["-m", str(tiny_ckpt), "--audio", str(wav), "--tools-json", str(tools),
                 "--api-response-json", str(response), "--extra-decoding-seconds", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert '[tool_call] get_weather({"city": "Paris"})' in out
    assert "[second pass: tool result injected]" in out


def test_response_without_a_call_is_reported(tiny_ckpt, tmp_path, monkeypatch, capsys):
    short_tool_prompt(monkeypatch)
    tools, response, wav = _files(tmp_path)
    assert main(["-m", str(tiny_ckpt), "--audio", str(wav), "--tools-json", str(tools),
                 "--api-response-json", str(response), "--extra-decoding-seconds", "0"]) == 0
    assert "made no tool call" in capsys.readouterr().err


def test_api_response_needs_tools(tiny_ckpt, tmp_path, capsys):
    import pytest

    _, response, wav = _files(tmp_path)
    with pytest.raises(SystemExit):
        main(["-m", str(tiny_ckpt), "--audio", str(wav), "--api-response-json", str(response)])
    assert "--api-response-json needs --tools-json" in capsys.readouterr().err
