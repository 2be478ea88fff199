"""The load client runs real-time-paced streams against a live server and reports them."""

from __future__ import annotations

import json

import pytest
from server_support import LiveServer, running

from bench import load as load_client
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import make_question_wav


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt, limits=ServerLimits(max_sessions=2))))


def test_load_client_measures_each_level_and_stops_at_refusals(server, tmp_path, capsys):
    wav = make_question_wav(tmp_path / "q.wav", seconds=0.5)
    out = tmp_path / "load.json"
    # Three streams against two slots: level 4 (3 here) cannot be all admitted.
    load_client.main([str(wav), "--url", server.ws(), "--num-streams", "3", "--seconds", "0.8",
                      "--late-ms", "100000", "--json", str(out)])
    report = json.loads(out.read_text())
    first, second, third = report["levels"]
    assert [r["streams"] for r in report["levels"]] == [1, 2, 3]
    assert not first["errors"] and first["drops"] == 0 and first["first_audio_s_p50"] > 0
    assert not second["errors"]
    assert third["errors"] == ["server_busy"]
    assert report["largest_real_time"] == 2
    assert "largest real-time N: 2" in capsys.readouterr().out
