"""The hosts' own servers serve a VoiceChat checkpoint with their own conventions.

``python -m mlx_vlm.server`` and ``python -m mlx_audio.server`` hand the
checkpoint to ``mlx-voicechat serve``: the host's key variable, flag spellings,
model flag and default address hold; every host flag we do not support is
named at start-up. The last tests run each host's command as a user would.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import httpx
import pytest
from server_support import (
    LiveServer,
    ServerProcess,
    connect,
    recv,
    running,
)
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.cli import serve
from mlx_voicechat_plugin.hosts.conventions import MLX_AUDIO, MLX_VLM
from mlx_voicechat_plugin.hosts.pickup import HOST_COMMANDS, HOST_SERVERS
from mlx_voicechat_plugin.server.app import API_KEY_ENV, create_app
from mlx_voicechat_plugin.testing.fixtures import make_question_wav

KEY = "s3cret-key"


def _host_source(package: str, relative: str) -> str:
    """A host module's source, read without importing it (mlx-audio's server needs
    webrtcvad, which is not installed)."""
    origin = importlib.util.find_spec(package).origin
    return (Path(origin).parent / relative).read_text()


def _served(argv: list[str], host=None):
    """``argv`` as the host hands it to serve: translated, parsed, start-up lines."""
    if host is not None:
        argv = host.translate(argv, environ={})
    args = serve.parse(argv, host.prog if host else "mlx-voicechat serve", host is not None,
                       host)
    return args, serve.startup_lines(args, host.prog if host else "serve", host, API_KEY_ENV)


# --- the hosts' own spellings and defaults, pinned to their sources ----------------


def test_mlx_vlm_conventions_match_its_server():
    cli = _host_source("mlx_vlm", "server/cli.py")
    assert f'DEFAULT_SERVER_HOST = "{MLX_VLM.host}"' in cli
    assert f"DEFAULT_SERVER_PORT = {MLX_VLM.port}" in cli
    assert '"--max-num-seqs"' in cli and '"--log-level"' in cli
    assert f'SERVER_API_KEY_ENV = "{API_KEY_ENV}"' in _host_source("mlx_vlm", "server/app.py")


def test_mlx_audio_conventions_match_its_server():
    source = _host_source("mlx_audio", "server.py")
    assert re.search(rf'"--host", type=str, default="{MLX_AUDIO.host}"', source)
    assert re.search(rf'"--port", type=int, default={MLX_AUDIO.port}\b', source)
    assert '"--realtime-model"' in source and f'"{MLX_AUDIO.model_env}"' in source


def test_both_host_servers_route_to_serve():
    assert {HOST_COMMANDS[m][0] for m in HOST_SERVERS} == {"serve"}
    assert HOST_SERVERS["mlx_audio.server"] is MLX_AUDIO


# --- flag spellings ------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["INFO", "info", "Debug", "WARNING"])
def test_log_level_is_case_insensitive(spelling):
    args, _ = _served(["--model", "ckpt", "--log-level", spelling], MLX_VLM)
    assert args.log_level == spelling.lower()
    assert serve.parse(["-m", "ckpt", "--log-level", spelling], "serve", False).log_level \
        == spelling.lower()


@pytest.mark.parametrize("argv", [["--max-num-seqs", "4"], ["--max-num-seqs=4"]])
def test_max_num_seqs_means_max_sessions(argv):
    args, lines = _served(["--model", "ckpt", *argv], MLX_VLM)
    assert args.limits.max_sessions == 4
    assert not any("max-num-seqs" in line for line in lines)


def test_every_unsupported_host_flag_is_named_on_its_own_line():
    _, lines = _served(["--model", "ckpt", "--kv-bits", "4", "--trust-remote-code",
                        "--draft-model", "d", "--reload"], MLX_VLM)
    ignored = [line for line in lines if line.startswith("ignoring")]
    assert [line.split(":")[0] for line in ignored] == [
        "ignoring --kv-bits 4", "ignoring --trust-remote-code", "ignoring --draft-model d",
        "ignoring --reload"]
    assert all(MLX_VLM.prog in line for line in ignored)


def test_the_realtime_model_flag_names_the_model_for_mlx_audio():
    assert MLX_AUDIO.model(["--realtime-model", "ckpt"]) == "ckpt"
    args, _ = _served(["--realtime-model", "ckpt", "--realtime"], MLX_AUDIO)
    assert args.model == "ckpt" and not args.ignored_options


def test_mlx_audios_model_variable_names_the_model_when_no_flag_does():
    environ = {MLX_AUDIO.model_env: "from-env"}
    assert MLX_AUDIO.model(["--port", "1"], environ) == "from-env"
    assert MLX_AUDIO.translate(["--port", "1"], environ)[:2] == ["--model", "from-env"]
    assert MLX_AUDIO.model(["--realtime-model", "flag"], environ) == "flag"


# --- the bind address ----------------------------------------------------------------


def test_as_mlx_vlm_server_it_binds_mlx_vlms_default_address_and_says_so():
    args, lines = _served(["--model", "ckpt"], MLX_VLM)
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    assert "serving on http://0.0.0.0:8080 (mlx-vlm's default address; mlx-voicechat " \
           "serve's is 127.0.0.1:8080)" in lines


def test_as_mlx_audio_server_it_binds_mlx_audios_default_address_and_says_so():
    args, lines = _served(["--realtime-model", "ckpt"], MLX_AUDIO)
    assert (args.host, args.port) == ("localhost", 8000)
    assert any(line.startswith("serving on http://localhost:8000 (mlx-audio's default")
               for line in lines)


def test_mlx_voicechat_serve_keeps_its_loopback_default():
    args, lines = _served(["-m", "ckpt"])
    assert (args.host, args.port) == ("127.0.0.1", 8080)
    assert "serving on http://127.0.0.1:8080" in lines


def test_an_address_given_on_the_command_line_is_stated_without_a_note():
    _, lines = _served(["--model", "ckpt", "--host", "127.0.0.1", "--port", "9"], MLX_VLM)
    assert "serving on http://127.0.0.1:9" in lines


# --- the API key variable, read per request --------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt)))


def _upgrade_status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with connect(url, additional_headers=headers) as ws:
            assert recv(ws)["type"] in ("session.created", "error")
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_without_the_key_variable_no_key_is_needed(server, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    server.wait_idle()
    assert _upgrade_status(server.ws()) == 101
    assert httpx.get(server.http("/metrics")).status_code == 200


def test_the_key_variable_set_after_start_guards_the_upgrade(server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert _upgrade_status(server.ws()) == 401
    assert _upgrade_status(server.ws(), "wrong") == 401
    server.wait_idle()
    assert _upgrade_status(server.ws(), KEY) == 101


def test_the_key_variable_guards_http_routes(server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert httpx.get(server.http("/metrics")).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.http("/metrics"), headers=auth).status_code == 200
    posted = httpx.post(server.http("/v1/audio/transcriptions"), files={"file": b"x"})
    assert posted.status_code == 401


def test_an_empty_key_variable_is_no_key(server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "")
    server.wait_idle()
    assert _upgrade_status(server.ws()) == 101


def test_the_api_key_flag_wins_over_the_variable(tiny_ckpt, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    live = LiveServer(create_app(tiny_ckpt, api_key=KEY))
    try:
        assert _upgrade_status(live.ws(), "from-env") == 401
        assert _upgrade_status(live.ws(), KEY) == 101
    finally:
        live.stop()


def test_start_up_says_which_key_guards_the_server(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert f"API key required while {API_KEY_ENV} is set (read per request)" \
        in _served(["--model", "ckpt"], MLX_VLM)[1]
    assert "API key required (--api-key)" in _served(["--model", "c", "--api-key", "k"])[1]
    assert KEY not in " ".join(_served(["--model", "ckpt"], MLX_VLM)[1])


def test_start_up_warns_when_a_keyless_server_binds_beyond_this_machine(monkeypatch):
    """mlx-vlm's default 0.0.0.0 with no key is reachable from the network: say so loudly."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    lines = _served(["--model", "ckpt"], MLX_VLM)[1]
    assert any(line.startswith("unguarded: no API key required and 0.0.0.0") for line in lines)
    loopback = _served(["--model", "ckpt"])[1]
    assert not any(line.startswith("unguarded") for line in loopback)
    assert not any(line.startswith("unguarded")
                   for line in _served(["--model", "c", "--api-key", "k"], MLX_VLM)[1])


# --- the hosts' commands, run as a user would ---------------------------------------------


@pytest.fixture(scope="module")
def mlx_vlm_server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("mlx_vlm") / "server.log"
    process = ServerProcess("mlx_vlm.server", [
        "--model", str(tiny_ckpt), "--log-level", "INFO", "--max-num-seqs", "2",
        "--kv-bits", "4", "--trust-remote-code", "--no-compile"], log, env={API_KEY_ENV: KEY})
    yield process
    process.stop()


def test_mlx_vlm_server_refuses_an_upgrade_without_the_key_variables_key(mlx_vlm_server):
    assert _upgrade_status(mlx_vlm_server.ws()) == 401
    assert _upgrade_status(mlx_vlm_server.ws(), KEY) == 101


def test_mlx_vlm_server_takes_max_num_seqs_as_max_sessions(mlx_vlm_server):
    assert httpx.get(mlx_vlm_server.http("/health")).json()["max_sessions"] == 2


def test_mlx_vlm_server_logs_each_ignored_flag_and_its_address(mlx_vlm_server):
    output = mlx_vlm_server.output()
    assert "ignoring --kv-bits 4: python -m mlx_vlm.server" in output
    assert "ignoring --trust-remote-code: python -m mlx_vlm.server" in output
    assert f"serving on http://127.0.0.1:{mlx_vlm_server.port}\n" in output


@pytest.fixture(scope="module")
def mlx_audio_server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("mlx_audio") / "server.log"
    process = ServerProcess("mlx_audio.server", [
        "--realtime-model", str(tiny_ckpt), "--realtime", "--log-dir", "unused",
        "--no-compile"], log)
    yield process
    process.stop()


def test_mlx_audio_server_serves_the_plugin_without_importing_its_own_server(
        mlx_audio_server):
    # mlx-audio's own server imports webrtcvad (absent here): it never ran.
    assert httpx.get(mlx_audio_server.http("/health")).json()["status"] == "ok"
    assert "ignoring --log-dir unused: python -m mlx_audio.server" in mlx_audio_server.output()


def test_mlx_audio_server_realtime_takes_the_model_as_started(mlx_audio_server, tiny_ckpt):
    assert _upgrade_status(mlx_audio_server.ws(f"/v1/realtime?model={tiny_ckpt}")) == 101


def test_mlx_audio_server_transcribes_with_the_model_field(mlx_audio_server, tiny_ckpt,
                                                           tmp_path):
    wav = make_question_wav(tmp_path / "q.wav", seconds=0.5)
    response = httpx.post(mlx_audio_server.http("/v1/audio/transcriptions"),
                          files={"file": ("q.wav", wav.read_bytes(), "audio/wav")},
                          data={"model": str(tiny_ckpt)}, timeout=120)
    assert response.status_code == 200, response.text
    assert "text" in response.json()
