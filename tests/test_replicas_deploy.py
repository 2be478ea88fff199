"""The replica deployment files match the server: serve flags that exist, grace periods
longer than the drain, HAProxy configs HAProxy accepts and routes the app serves."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from test_docs import _unknown, serve_flags

from mlx_voicechat_plugin.cli.serve import build_parser
from mlx_voicechat_plugin.server.app import OPENAI_BASE
from mlx_voicechat_plugin.server.dialects import DIALECTS
from mlx_voicechat_plugin.server.operations.transcriptions import TRANSCRIPTIONS_PATH

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy"
                                      if Path("/usr/sbin/haproxy").exists() else None)


def serve_args(argv: list[str]):
    assert argv[:2] == ["mlx-voicechat", "serve"], argv
    return build_parser().parse_args(argv[2:])


def seconds(text: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", text).groups()
    return float(value) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[unit]


def haproxy_config_routes(text: str) -> set[str]:
    return {path for line in text.splitlines() if line.strip().startswith("acl ")
            for path in line.split()[3:]}


def served_routes() -> set[str]:
    paths = {p for d in DIALECTS for p in d.paths}
    return paths | {TRANSCRIPTIONS_PATH, OPENAI_BASE + TRANSCRIPTIONS_PATH}


def test_the_compose_replicas_run_serve_with_an_agent_and_a_grace_period_past_the_drain():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    replicas = {name: s for name, s in compose["services"].items() if name.startswith("replica")}
    assert len(replicas) == 3
    env = compose["services"]["haproxy"]["environment"]
    for i, (name, service) in enumerate(sorted(replicas.items()), 1):
        args = serve_args(shlex.split(service["command"]))
        assert args.host == "0.0.0.0" and args.agent_port
        assert seconds(service["stop_grace_period"]) > args.drain_seconds
        assert env[f"REPLICA{i}_ADDR"] == f"{name}:{args.port}"
        assert env[f"REPLICA{i}_AGENT_PORT"] == str(args.agent_port)


def test_the_kubernetes_replicas_are_ready_on_health_and_drain_within_the_grace_period():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == "mlx-voicechat")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["http"], ports["agent"]) == (args.port, args.agent_port)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" not in container  # a draining replica answers 503 there
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + args.drain_seconds


@pytest.mark.parametrize("source", ["haproxy.cfg", "kubernetes.yaml"])
def test_the_haproxy_configs_route_every_served_path_and_haproxy_accepts_them(source,
                                                                            tmp_path):
    text = (DEPLOY / source).read_text()
    if source.endswith(".yaml"):
        (config,) = [d for d in yaml.safe_load_all(text) if d["kind"] == "ConfigMap"]
        text = config["data"]["haproxy.cfg"]
    assert haproxy_config_routes(text) == served_routes()
    assert "balance leastconn" in text and "agent-check" in text and "timeout tunnel" in text
    if HAPROXY is None:
        pytest.skip("haproxy is not installed: the syntax check needs it")
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    result = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True,
                            timeout=30, env={"HAPROXY_STATS_SOCKET": str(tmp_path / "s")})
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_replicas_page_names_only_serve_flags_and_the_readme_links_it():
    text = (ROOT / "docs" / "replicas.md").read_text(encoding="utf-8")
    flags = serve_flags(text, everywhere=True)
    assert {"--agent-port", "--drain-seconds", "--max-sessions"} <= set(flags)
    assert _unknown(flags) == {}
    assert "(docs/replicas.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
