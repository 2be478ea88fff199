"""No secret in any log line: the access log's query strings are redacted (issue 63, finding 8).

uvicorn's access log quoted each request's path with its query string: the
key a client sends as ``?api_key=`` (the NVIDIA route) and a resume's
``?resume_token=`` were written to the server's output.
"""

from __future__ import annotations

import time

import httpx
from raw_client import RawClient
from resume_support import event, resume_path, until
from server_support import ServerProcess

from mlx_voicechat_plugin.server.operations.redaction import redact_query

KEY = "log-secret-key-5f1c"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_query_keeps_its_names_and_loses_its_secret_values():
    line = '127.0.0.1:5 - "GET /v1/realtime?api_key=s3cret&model=m&resume_token=t0k HTTP/1.1" 101'
    assert redact_query(line) == \
        '127.0.0.1:5 - "GET /v1/realtime?api_key=***&model=m&resume_token=*** HTTP/1.1" 101'
    assert redact_query("no query here") == "no query here"


def test_no_key_or_resume_token_reaches_the_servers_output(tiny_ckpt, tmp_path):
    process = ServerProcess("mlx_voicechat_plugin.cli.main",
                            ["serve", "-m", str(tiny_ckpt), "--no-compile", "--api-key", KEY,
                             "--log-level", "info"], tmp_path / "serve.log")
    try:
        assert httpx.get(process.http(f"/health?api_key={KEY}")).status_code == 200
        nvidia = RawClient(process.port, f"/nvidia/v1/realtime?api_key={KEY}")
        event(nvidia)
        nvidia.close()
        client = RawClient(process.port, headers=AUTH)
        created = event(client)
        token = created["session"]["resume_token"]
        client.send_json({"type": "session.update", "session": {}})
        last = event(client)["seq"]
        client.close()  # dropped: no close frame, the session waits for its resume
        resumed = until(lambda: _resume(process.port, token, last), "the detach")
        assert event(resumed)["type"] == "session.resumed"
        resumed.close()
        time.sleep(0.5)  # the log lines of the last connections
    finally:
        process.stop()
    output = process.output()
    assert "resume_token=***" in output and "api_key=***" in output, output
    assert KEY not in output and token not in output, output


def _resume(port: int, token: str, last: int) -> RawClient | None:
    try:
        return RawClient(port, resume_path("/v1/realtime", token, last), headers=AUTH)
    except AssertionError:  # 409 while the server has not seen the drop yet
        return None
