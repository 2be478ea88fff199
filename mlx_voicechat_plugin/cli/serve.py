"""``mlx-voicechat serve``: the realtime WebSocket server for one checkpoint.

The same entry point serves ``python -m mlx_vlm.server --model CKPT`` and
``python -m mlx_audio.server --realtime-model CKPT`` for a VoiceChat
checkpoint (see :mod:`mlx_voicechat_plugin.hosts.pickup`), with that host's
conventions (:mod:`mlx_voicechat_plugin.hosts.conventions`): its default
address, and one log line for each of its flags this server does not support.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Sequence

from ..server.operations.drain import DEFAULT_DRAIN_SECONDS
from ..server.limits import MIB, ServerLimits
from ..server.transport.ice import ICEConfig
from .common import (
    add_graph_commit_ops,
    add_memory_budget,
    add_sampling,
    check_device_options,
    check_model,
    check_sampling,
    parse_args,
    EXIT_FAILURE,
    EXIT_USAGE,
    UsageError,
)

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer

logger = logging.getLogger(__name__)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _origins(values: list[str] | None) -> list[str]:
    return [o.strip() for v in values or () for o in v.split(",") if o.strip()]


def build_parser(prog: str = "mlx-voicechat serve") -> argparse.ArgumentParser:
    defaults = ServerLimits()
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve Nemotron VoiceChat over a realtime WebSocket "
                               "(/v1/realtime) and /v1/audio/transcriptions.")
    parser.add_argument("-m", "--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the upgrade")
    parser.add_argument("--api-prefix", default="", help="mount the routes under this prefix")
    parser.add_argument("--nvidia-root", action="store_true",
                        help="serve NVIDIA's VoiceChat protocol (NeMo-Speech.cpp) at "
                             "/v1/realtime and /realtime instead of mlx-vlm's, as "
                             "'nemo-speech serve' lays them out (it is always at "
                             "/nvidia/v1/realtime)")
    parser.add_argument("--alias", action="append", metavar="NAME",
                        help="model id to report (default: the checkpoint's name); repeat "
                             "it for more names a client may use (the first is reported)")
    parser.add_argument("--strict-model", action="store_true",
                        help="refuse (404) a ?model= that is not the served id, the "
                             "checkpoint's name or an --alias on the OpenAI GA route too "
                             "(by default it takes any name and reports the served id)")
    parser.add_argument("--cors-origins", "--allowed-origins", dest="origins", nargs="+",
                        action="extend", metavar="ORIGIN",
                        help="browser origins allowed to connect ('*' for any); without "
                             "a list only loopback origins (localhost, 127.0.0.1, [::1]) are; "
                             "clients that send no Origin (not browsers) always are")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        type=str.lower)  # mlx-vlm spells them upper case
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fuse kernels with mx.compile (default on; the kernels are "
                             "warmed at start-up, before /health reports ready)")
    parser.add_argument("--per-row-attention", action="store_true",
                        help="run each session's attention core on its own ring, the exact "
                             "path, instead of one masked core for the batch (docs/gpu.md)")
    add_graph_commit_ops(parser)
    add_memory_budget(parser)
    webrtc = parser.add_argument_group("WebRTC calls (docs/webrtc.md)")
    webrtc.add_argument("--ice-host", dest="ice_hosts", action="append", metavar="ADDRESS",
                        help="gather the calls' ICE host candidates on this address only "
                             "(repeatable; default: every interface but loopback; "
                             "--ice-host 127.0.0.1 for a browser on this machine)")
    webrtc.add_argument("--ice-server", dest="ice_servers", action="append", metavar="URL",
                        help="a STUN or TURN server the calls use (repeatable; "
                             "turn:USER:PASSWORD@HOST:PORT for a relay that clients behind "
                             "NAT reach; default: none, no server is asked)")
    tools = parser.add_argument_group("tools (docs/tools.md)")
    tools.add_argument("--mcp", metavar="CONFIG.json",
                       help="the operator's MCP servers, in Claude Desktop's mcpServers format "
                            "(stdio command/args/env, or url/headers): their tools are every "
                            "session's, run by the server (needs the mcp extra)")
    tools.add_argument("--mcp-allow-url", dest="mcp_allow_urls", action="append", default=[],
                       metavar="PATTERN",
                       help="a URL pattern (fnmatch, e.g. 'https://mcp.example.com/*') a GA "
                            "session's mcp tool may connect to; none by default. Loopback, "
                            "private and link-local hosts need a pattern naming the host")
    tools.add_argument("--tool-timeout", type=float, default=defaults.tool_timeout,
                       metavar="SECONDS",
                       help="how long a call the client runs may wait for its "
                            "function_call_output before the model hears a timeout "
                            "(default: %(default)s; an MCP server's own: its timeout key)")
    replica = parser.add_argument_group("replicas (behind a balancer: docs/replicas.md)")
    replica.add_argument("--agent-port", type=int, default=None,
                         help="answer HAProxy's agent-check on this TCP port (same host as "
                              "--host): 'up ready maxconn:N' with N the sessions this replica "
                              "holds, 'drain' while stopping, 'down #reason' before it is "
                              "ready (default: off)")
    replica.add_argument("--drain-seconds", type=float, default=DEFAULT_DRAIN_SECONDS,
                         help="on SIGTERM, refuse new sessions and let open ones finish for "
                              "up to this long, then close the rest (1001) and exit 0; a "
                              "second SIGTERM stops at once (default: %(default)s)")
    add_sampling(parser.add_argument_group("sampling"), " of a session that does not set its own")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                        help="largest client message, checked before decoding (default: "
                             f"{defaults.max_message_bytes // MIB} MiB)")
    limits.add_argument("--max-session-seconds", type=float,
                        default=defaults.max_session_seconds,
                        help="seconds of audio one session may stream; with a bounded "
                             "--context-seconds a policy on the call's length, not on its "
                             "memory (default: %(default)s)")
    limits.add_argument("--context-seconds", type=float, default=defaults.context_seconds,
                        help="seconds of conversation a session's attention keeps after its "
                             "prompt, in rings of constant memory, as docs/long-conversations.md "
                             "says; a client may ask for less, and 0 is unbounded (the "
                             "reference's growing caches, which --max-session-seconds then "
                             "bounds) (the model's trained context; default: %(default)s)")
    limits.add_argument("--update-timeout", type=float, default=defaults.update_timeout,
                        help="seconds a client has to send session.update (default: %(default)s)")
    limits.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout,
                        help="seconds a configured session may stay silent (pings do not count; "
                             "default: %(default)s)")
    limits.add_argument("--max-session-wall-seconds", type=float,
                        default=defaults.max_session_wall_seconds,
                        help="seconds a connection may stay open, whatever it sends "
                             "(default: %(default)s)")
    limits.add_argument("--max-failed-updates", type=int, default=defaults.max_failed_updates,
                        help="failed session.update messages before the connection is closed "
                             "(1008; default: %(default)s)")
    limits.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens,
                        help="most tokens the system prompt and rendered tools may take "
                             "(each is one prefill step; default: %(default)s)")
    limits.add_argument("--prompt-cache-bytes", type=int, default=defaults.prompt_cache_bytes,
                        help="bytes of prefilled states kept so repeated system prompts and "
                             "tool sets start at once (0 turns the cache off; default: "
                             f"{defaults.prompt_cache_bytes // MIB} MiB)")
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections in all, counted before authentication (default: %(default)s)")
    limits.add_argument("--max-connections-per-client", type=int,
                        default=defaults.max_connections_per_client,
                        help="open connections from one client address (default: %(default)s)")
    limits.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                        help="seconds a connection has to send each request's headers, "
                             "counted from its start or the previous response's end, and "
                             "a WebSocket its handshake; then it is closed "
                             "(default: %(default)s)")
    limits.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                        help="seconds a request's body (an upload) has to arrive after its "
                             "headers; then the server answers 408 and closes the connection "
                             "(default: %(default)s)")
    limits.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                        help="realtime sessions served at once on the one loaded model "
                             "(default: %(default)s; size it with python -m bench.load)")
    limits.add_argument("--max-state-bytes", type=int, default=defaults.max_state_bytes,
                        help="bytes of state all sessions may reach: each session reserves "
                             "its worst case (window + prompt, or --max-session-seconds "
                             "unbounded) when it opens and is refused with server_busy when "
                             "that does not fit (default: no budget)")
    limits.add_argument("--max-buffered-seconds", type=float,
                        default=defaults.max_buffered_seconds,
                        help="audio one session may queue ahead of the engine; past it the "
                             "server stops reading that client's socket until there is room "
                             "(TCP backpressure) (default: %(default)s; seconds)")
    limits.add_argument("--batch-wait-ms", type=float, default=defaults.batch_wait_ms,
                        help="longest a ready frame waits for the other sessions' frames so "
                             "they run as one batched step (0: never wait; measured with "
                             "python -m bench.load) (default: %(default)s; milliseconds)")
    limits.add_argument("--batch-fill", action=argparse.BooleanOptionalAction,
                        default=defaults.batch_fill,
                        help="once the streaming sessions' frames run one by one would keep "
                             "the engine busy, stretch the wait so every streaming session "
                             "joins the step, while the oldest frame still ends within its "
                             "80 ms (default: %(default)s)")
    limits.add_argument("--resume-seconds", type=float, default=defaults.resume_seconds,
                        help="a session whose connection drops (no close frame, commit or "
                             "cancel) waits this long, paused, for the "
                             "client to resume it with its resume_token (docs/protocol.md, "
                             "\"Resuming a session\"), unless a new connection needs its "
                             "slot; 0 ends it at once "
                             "(default: %(default)s; seconds)")
    limits.add_argument("--max-detached-per-key", type=int,
                        default=defaults.max_detached_per_key,
                        help="detached sessions (awaiting a resume) one API key may hold; "
                             "past it the key's oldest ends. A detached session also gives "
                             "its slot to a connection that finds the server full "
                             "(default: %(default)s)")
    limits.add_argument("--max-replay-seconds", type=float,
                        default=defaults.max_replay_seconds,
                        help="seconds of frames whose events a session keeps for a resume "
                             "to replay; a client further behind cannot resume "
                             "(default: %(default)s)")
    limits.add_argument("--max-replay-bytes", type=int, default=defaults.max_replay_bytes,
                        help="bytes of events (as sent) a session keeps for a resume to "
                             "replay; the oldest go first (default: %(default)s)")
    limits.add_argument("--max-item-bytes", type=int, default=defaults.max_item_bytes,
                        help="bytes of conversation items (as sent) a GA session keeps for "
                             "conversation.item.retrieve; a client's item past them is "
                             "refused with an error (default: %(default)s)")
    limits.add_argument("--max-minted-bytes", type=int, default=defaults.max_minted_bytes,
                        help="bytes of sessions (their JSON) the unexpired ephemeral keys "
                             "hold, all together; a mint past them is refused with 429 "
                             "(default: %(default)s)")
    limits.add_argument("--max-pending-events", type=int, default=defaults.max_pending_events,
                        help="unsent events a connection may queue before it is closed "
                             "(1008, 'client is not reading'; default: %(default)s)")
    limits.add_argument("--max-pending-bytes", type=int, default=defaults.max_pending_bytes,
                        help="bytes of unsent events (as sent) a connection may queue before "
                             "it is closed (1008, 'client is not reading'); a resume's replay "
                             f"is not counted (default: {defaults.max_pending_bytes // MIB} MiB)")
    limits.add_argument("--max-read-bytes-per-second", type=int,
                        default=defaults.max_read_bytes_per_second,
                        help="bytes a second one WebSocket's (or WebRTC call's data channel's) "
                             "messages are read at, past a "
                             "burst of four messages at --max-message-bytes; a faster client "
                             "waits, it is not refused "
                             f"(default: {defaults.max_read_bytes_per_second // MIB} MiB)")
    limits.add_argument("--send-timeout", type=float, default=defaults.send_timeout,
                        help="seconds queued events and the close frame may take at the end "
                             "(default: %(default)s)")
    limits.add_argument("--max-transcript-bytes", type=int,
                        default=defaults.max_transcript_bytes,
                        help="UTF-8 bytes of transcript a text-only session may produce (default: "
                             f"{defaults.max_transcript_bytes // 1024} KiB)")
    limits.add_argument("--max-upload-bytes", type=int, default=defaults.max_upload_bytes,
                        help="largest /v1/audio/transcriptions file (413 past it; default: "
                             "None; then what the memory budget allows, at least OpenAI's "
                             "25 MiB, as docs/serving.md says)")
    limits.add_argument("--max-transcription-seconds", type=float,
                        default=defaults.max_transcription_seconds,
                        help="seconds of audio one transcription file may hold (400 past it; "
                             "default: None; then what the memory budget allows, at least 600)")
    limits.add_argument("--max-transcriptions-in-flight", type=int,
                        default=defaults.max_transcriptions_in_flight,
                        help="file transcriptions admitted at once (429 past it; default: %(default)s)")
    return parser


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool,
          host: "HostServer | None" = None) -> argparse.Namespace:
    """``argv`` as served; run for a ``host``, its default address is the default."""
    parser = build_parser(prog)
    if host is not None:
        parser.set_defaults(host=host.host, port=host.port)
    args = parse_args(parser, argv, tolerate_unknown, report=False)
    check_sampling(parser, args)
    try:
        args.limits = ServerLimits.from_dict(vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    try:
        args.ice = ICEConfig.from_dict({"hosts": args.ice_hosts, "servers": args.ice_servers})
    except ValueError as exc:
        parser.error(str(exc).replace("ice_hosts", "--ice-host")
                     .replace("ice_servers", "--ice-server"))
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be a TCP port (1-65535, or 0 for any free one), "
                     f"got {args.port}")
    if args.agent_port is not None and not 0 < args.agent_port < 65536:
        parser.error(f"--agent-port must be a TCP port (1-65535), got {args.agent_port}")
    if args.agent_port is not None and args.agent_port == args.port:
        parser.error(f"--agent-port must differ from --port ({args.port})")
    if not args.drain_seconds >= 0:
        parser.error(f"--drain-seconds must be >= 0, got {args.drain_seconds:g}")
    args.mcp_servers = mcp_servers(parser, args.mcp)
    if args.mcp_allow_urls:
        try:
            import mcp  # noqa: F401
        except ImportError:
            parser.error("--mcp-allow-url needs the MCP SDK: "
                         "pip install 'mlx-voicechat-plugin[mcp]'")
    check_device_options(parser, args)
    return args


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads (a port in use is
    an ``OSError`` at once, not after a minute of loading)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def ready_line(host: str, port: int, prefix: str, realtime_path: str) -> str:
    """What ``serve`` logs once it takes sessions: where a client connects."""
    shown = f"[{host}]" if ":" in host else host
    base = f"{shown}:{port}{prefix}"
    return (f"ready: realtime sessions at ws://{base}{realtime_path}, transcriptions at "
            f"http://{base}/v1/audio/transcriptions, the console at http://{base}/, "
            f"health at http://{base}/health")


def mcp_servers(parser: argparse.ArgumentParser, path: str | None) -> list:
    """The servers of ``--mcp``'s file (none without it); a mistake is the parser's error."""
    if path is None:
        return []
    try:
        import mcp  # noqa: F401
    except ImportError:
        parser.error("--mcp needs the MCP SDK: pip install 'mlx-voicechat-plugin[mcp]'")
    from ..server.mcp.config import McpConfigError, load_config

    try:
        servers = load_config(path)
    except McpConfigError as exc:
        parser.error(f"--mcp: {exc}")
    if not servers:
        parser.error(f"--mcp: {path} lists no enabled server")
    return servers


LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")
WARNINGS = ("ignoring", "unguarded")  # start-up lines logged as warnings


def startup_lines(args: argparse.Namespace, prog: str, host: "HostServer | None",
                  key_env: str) -> list[str]:
    """What start-up states: each ignored host flag, the bind address, the API key's source."""
    lines = [f"ignoring {option}: {prog} does not support it for this model"
             for option in args.ignored_options]
    address = f"serving on http://{args.host}:{args.port}"
    ours = build_parser()
    own = (ours.get_default("host"), ours.get_default("port"))
    if host is not None and (args.host, args.port) != own and \
            (args.host, args.port) == (host.host, host.port):
        address += (f" ({host.name}'s default address; mlx-voicechat serve's is "
                    f"{own[0]}:{own[1]})")
    lines.append(address)
    if args.api_key:
        lines.append("API key required (--api-key)")
    elif os.environ.get(key_env):
        lines.append(f"API key required while {key_env} is set (read per request)")
    elif args.host in LOOPBACK_BINDS:
        lines.append(f"no API key required (set --api-key or {key_env})")
    else:
        lines.append(f"unguarded: no API key required and {args.host} is reachable from "
                     f"other machines (set --api-key or {key_env}, or --host 127.0.0.1)")
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat serve",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    args = parse(argv, prog, tolerate_unknown, host)
    try:
        import uvicorn  # noqa: F401

        from ..server.app import API_KEY_ENV, create_app
        from ..server.operations.drain import run_server
    except ImportError as exc:
        print(f"error: the server needs its extras: pip install 'mlx-voicechat-plugin[server]' "
              f"({exc})", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_model(args.model)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: "
              f"{error.strerror or error} (--host/--port)", file=sys.stderr)
        return EXIT_FAILURE
    port = args.port = sock.getsockname()[1]  # --port 0: the free port it got
    for line in startup_lines(args, prog, host, API_KEY_ENV):
        (logger.warning if line.startswith(WARNINGS) else logger.info)(line)
    from ..runtime import compile_policy
    from ..runtime.device_settings import apply_graph_commit_ops

    apply_graph_commit_ops(args.graph_commit_ops)  # read once, at the GPU's first work
    compiled = compile_policy.apply(args.compile, long_running=True)
    if args.per_row_attention:  # the setting every model loaded in this process starts with
        from ..models import kv_arena

        os.environ[kv_arena.ENV_PER_ROW] = "1"
    from ..server import dialects

    served = dialects.NVIDIA_ROOT_DIALECTS if args.nvidia_root else dialects.DIALECTS
    app = create_app(args.model, alias=args.alias, strict_model=args.strict_model,
                     api_key=args.api_key, dialects=served,
                     api_prefix=args.api_prefix, allowed_origins=_origins(args.origins),
                     limits=args.limits, warm_up=compiled, drain_seconds=args.drain_seconds,
                     agent_port=args.agent_port, agent_host=args.host, ice=args.ice,
                     memory_budget=args.memory_budget, mcp_servers=args.mcp_servers,
                     mcp_allow_urls=args.mcp_allow_urls)
    from ..server.app import normalize_prefix

    line = ready_line(args.host, port, normalize_prefix(args.api_prefix), served[0].paths[0])
    return run_server(app, sockets=[sock], on_ready=lambda: logger.info(line),
                      host=args.host, port=port, log_level=args.log_level,
                      **args.limits.uvicorn_options())  # uvicorn.run, draining on SIGTERM


if __name__ == "__main__":
    sys.exit(main())
