"""mlx-lm's sampling names as session options: ``temperature`` (0 only: the text channel
is greedy, as the reference's) and ``top_p`` (the speech head's nucleus, (0, 1])."""

from __future__ import annotations

import math

import pytest

from mlx_voicechat_plugin.runtime.options import ConversationOptions


def test_the_defaults_are_the_references():
    options = ConversationOptions()
    assert options.temperature == 0 and options.top_p is None  # None: the checkpoint's


@pytest.mark.parametrize("value", [0.01, 0.5, 1, 1.0])
def test_top_p_in_range_is_taken(value):
    assert ConversationOptions(top_p=value).top_p == value


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, math.nan, math.inf, True, "0.9"])
def test_top_p_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        ConversationOptions(top_p=value)


@pytest.mark.parametrize("value", [0.7, 1, -1, math.nan, "0"])
def test_a_temperature_other_than_0_is_refused_with_the_reason(value):
    with pytest.raises(ValueError, match="temperature must be 0 .*decoded greedily"):
        ConversationOptions(temperature=value)


# --- the server: --temperature / --top-p defaults, the mlx-vlm session's fields ---

def test_serve_takes_the_sessions_defaults_and_refuses_a_bad_one_by_flag(capsys):
    from mlx_voicechat_plugin.cli.serve import parse

    args = parse(["-m", "ckpt", "--top-p", "0.8", "--temperature", "0"], "serve", False)
    assert (args.limits.top_p, args.limits.temperature) == (0.8, 0.0)
    for flag, value in (("--top-p", "1.5"), ("--temperature", "0.7")):
        with pytest.raises(SystemExit) as exit_:
            parse(["-m", "ckpt", flag, value], "serve", False)
        assert exit_.value.code == 2
        assert flag in capsys.readouterr().err


def test_a_session_takes_the_servers_top_p_unless_its_client_sets_one():
    from mlx_voicechat_plugin.server.dialects.client_options import session_options
    from mlx_voicechat_plugin.server.dialects.vlm import FIELDS
    from mlx_voicechat_plugin.server.limits import ServerLimits

    limits = ServerLimits(top_p=0.8)
    assert session_options(limits, FIELDS).top_p == 0.8
    assert session_options(limits, FIELDS, top_p=0.3).top_p == 0.3
    assert session_options(ServerLimits(), FIELDS).top_p is None  # the checkpoint's


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from server_support import LiveServer, running

    from mlx_voicechat_plugin.server.app import create_app
    from mlx_voicechat_plugin.server.limits import ServerLimits

    limits = ServerLimits(update_timeout=5, idle_timeout=10, max_sessions=1)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


@pytest.mark.parametrize("field, value, limit", [
    ("top_p", 1.5, "(0, 1]"), ("top_p", 0, "(0, 1]"), ("temperature", 0.7, "must be 0"),
])
def test_a_bad_sampling_field_is_named_and_the_session_stays_usable(server, field, value, limit):
    from server_support import connect, expect_error, recv, send, until_closed

    with connect(server.ws()) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, {"type": "session.update", "session": {field: value}})
        message = expect_error(ws, "session_initialization_failed")["error"]["message"]
        assert f"session.{field}" in message and limit in message
        send(ws, {"type": "session.update", "session": {"top_p": 0.5, "temperature": 0}})
        assert recv(ws)["type"] == "session.updated"
        send(ws, {"type": "session.cancel"})
        until_closed(ws)
    server.wait_idle()
