"""The docs match the code: flags the docs name for ``serve`` exist, defaults are shown,
the deployment files parse as ``serve`` command lines, the conversion recipe works.

The docs are the README (the front door) and the pages under ``docs/`` it
links to; every check below reads all of them."""

from __future__ import annotations

import argparse
import json
import plistlib
import re
import shlex
from importlib.metadata import version
from pathlib import Path

import pytest

from mlx_voicechat_plugin.cli import main as cli_main
from mlx_voicechat_plugin.cli.serve import build_parser
from mlx_voicechat_plugin.server.limits import MIB

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
SERVE = re.compile(r"\bmlx-voicechat\s+serve\b")
# Another command (its flags are not serve's). The hosts' server commands take the
# hosts' own spellings, so they are left out of this check too.
OTHER = re.compile(r"\bmlx-voicechat\s+(?!serve\b)[a-z]+|\bpython3?\s+-m\s|\.py\b"
                   r"|^\s*(?:make|docker|curl|hf|huggingface-cli|pip|bash)\b"
                   r"|mlx_vlm\.server|mlx_audio\.server", re.M)
# Sections about the server (README or docs/), where a bare `--flag` names a serve flag.
SERVE_SECTIONS = frozenset({"Realtime server", "Transcription only",
                            "From the OpenAI SDK, Pipecat or LiveKit", "Server limits",
                            "Serving many sessions", "Deployment"})
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _sections(markdown: str) -> list[tuple[str, str]]:
    """``(heading, body)`` for each heading of any level (the preamble's heading is '');
    a ``#`` line inside a code block is code, not a heading."""
    sections, heading, lines, fenced = [], "", [], False
    for line in markdown.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        title = None if fenced else re.match(r"#{1,6} +(.+)$", line)
        if title:
            sections.append((heading, "".join(lines)))
            heading, lines = title.group(1).strip(), []
        else:
            lines.append(line)
    return sections + [(heading, "".join(lines))]


def _code_lines(code: str) -> list[str]:
    """Logical lines of a code block: a trailing backslash joins the next line."""
    return code.replace("\\\n", " ").splitlines()


def _snippets(body: str) -> list[str]:
    """Each code block line and each inline code span (spans may cross a line break)."""
    snippets: list[str] = []
    for block in FENCE.findall(body):
        snippets += _code_lines(block)
    prose = FENCE.sub("", body)
    snippets += re.findall(r"`([^`]+)`", prose)
    return snippets


def serve_flags(markdown: str, everywhere: bool = False) -> dict[str, str]:
    """Flags the text names for ``serve`` -> the snippet naming it.

    A snippet that invokes ``mlx-voicechat serve`` names its flags after ``serve``;
    one that invokes another command names none; a bare flag counts inside the
    server sections (or ``everywhere``).
    """
    found: dict[str, str] = {}
    for heading, body in _sections(markdown):
        in_scope = everywhere or heading.strip() in SERVE_SECTIONS
        for snippet in _snippets(body):
            serve = SERVE.search(snippet)
            if serve:
                text = snippet[serve.end():]
            elif OTHER.search(snippet) or not in_scope:
                continue
            else:
                text = snippet
            for flag in FLAG.findall(text):
                found.setdefault(flag, snippet.strip())
    return found


def serve_options() -> set[str]:
    return set(build_parser()._option_string_actions)


def _unknown(flags: dict[str, str]) -> dict[str, str]:
    known = serve_options()
    return {flag: where for flag, where in flags.items() if flag not in known}


# --- the scanner ------------------------------------------------------------


SAMPLE = """# Tool

## Use

```sh
# Realtime server
mlx-voicechat generate --model M --extra-decoding-seconds 3
mlx-voicechat serve -m M --port 8080 \\
    --max-sesions 4
```

`--seed` here is generate's, and `--top-k` is no serve flag.

### Realtime server

`--idle-timeout` and `--no-such-limit` bound a session; `python -m bench.load
--num-streams 8` sizes it.
"""


def test_the_scanner_finds_a_flag_serve_lacks_in_a_serve_command_line():
    assert "--max-sesions" in _unknown(serve_flags(SAMPLE))


def test_the_scanner_finds_a_bare_flag_serve_lacks_in_a_server_section():
    assert "--no-such-limit" in _unknown(serve_flags(SAMPLE))


def test_the_scanner_leaves_other_commands_and_other_sections_alone():
    flags = serve_flags(SAMPLE)
    assert {"--port", "--idle-timeout"} <= set(flags)
    assert not {"--model", "--extra-decoding-seconds", "--seed", "--num-streams",
                "--top-k"} & set(flags)  # a '#' line in code is no section heading
    assert set(_unknown(flags)) == {"--max-sesions", "--no-such-limit"}


# --- README, docs/, SECURITY.md ----------------------------------------------


def docs_text() -> str:
    """The README and every page of docs/, one after another."""
    return "\n".join(p.read_text(encoding="utf-8") for p in [README, *PAGES])


def test_the_readme_links_every_docs_page_and_every_link_resolves():
    readme = README.read_text(encoding="utf-8")
    assert PAGES and all(f"](docs/{p.name})" in readme for p in PAGES)
    for page in [README, *PAGES]:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", page.read_text(encoding="utf-8")):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links {target}"


def test_every_flag_the_docs_name_for_serve_is_in_serve_help():
    flags = serve_flags(docs_text())
    assert len(flags) >= 20  # the scan reaches the server sections
    assert _unknown(flags) == {}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_docs_page_names_only_serve_flags_serve_has(page):
    assert _unknown(serve_flags(page.read_text(encoding="utf-8"))) == {}


def test_every_flag_security_md_names_is_in_serve_help():
    flags = serve_flags((ROOT / "SECURITY.md").read_text(encoding="utf-8"), everywhere=True)
    assert len(flags) >= 20
    assert _unknown(flags) == {}


def test_the_docs_document_the_bind_prefix_and_log_flags():
    flags = serve_flags(docs_text())
    assert {"--host", "--port", "--api-prefix", "--log-level"} <= set(flags)


# --- --help and --version ---------------------------------------------------


def _shown_default(value: object) -> set[str]:
    if value is None:
        return {"no budget", "None"}
    shown = {str(value)}
    if isinstance(value, int) and value >= 1024:
        if value % MIB == 0:
            shown.add(f"{value // MIB} MiB")
        elif value % 1024 == 0:
            shown.add(f"{value // 1024} KiB")
    return shown


def test_every_limit_flag_shows_its_default_in_help():
    parser = build_parser()
    formatter = parser._get_formatter()
    (group,) = [g for g in parser._action_groups if g.title == "limits"]
    assert len(group._group_actions) >= 19
    for action in group._group_actions:
        text = " ".join(formatter._expand_help(action).split())
        shown = re.search(r"default: ([^;)]+)[;)]", text)
        assert shown, f"{action.option_strings[0]} shows no default: {text!r}"
        assert shown.group(1).strip() in _shown_default(action.default), (
            f"{action.option_strings[0]} shows {shown.group(1)!r}, its default is "
            f"{action.default!r}")


def test_version_prints_the_package_version(capsys):
    from mlx_voicechat_plugin import __version__

    assert cli_main.main(["--version"]) == 0
    assert capsys.readouterr().out == f"mlx-voicechat {version('mlx-voicechat-plugin')}\n"
    assert __version__ == version("mlx-voicechat-plugin")


# --- deployment files -------------------------------------------------------


def _parse_serve(argv: list[str]) -> argparse.Namespace:
    """``argv`` after ``serve``, parsed by serve's own parser (exits 2 on a bad flag)."""
    return build_parser().parse_args(argv)


def test_the_dockerfile_serves_the_mounted_model_on_the_exposed_port():
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    argv = json.loads(cmd)
    assert argv[:2] == ["mlx-voicechat", "serve"]
    args = _parse_serve(argv[2:])
    assert args.host == "0.0.0.0"
    assert re.findall(r"^EXPOSE (\d+)$", text, re.M) == [str(args.port)]
    assert args.model.startswith("/models/")
    assert re.search(r'^VOLUME \["/models"\]$', text, re.M)
    assert re.search(r'^RUN pip install .*"\.\[server\]"$', text, re.M)
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)


def test_the_dockerfile_comments_name_only_serve_flags():
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    comments = "\n".join(line.lstrip("#") for line in text.splitlines()
                         if line.startswith("#"))
    flags = serve_flags(f"```\n{comments}\n```\n")
    assert "--api-key" in flags and _unknown(flags) == {}


def test_the_systemd_unit_runs_serve_with_known_flags():
    text = (ROOT / "deploy" / "mlx-voicechat.service").read_text(encoding="utf-8")
    (line,) = [ln for ln in _code_lines(text) if ln.startswith("ExecStart=")]
    argv = shlex.split(line.split("=", 1)[1])
    assert argv[0].endswith("/mlx-voicechat") and argv[1] == "serve"
    args = _parse_serve(argv[2:])
    assert args.host == "127.0.0.1" and args.api_key == "${API_KEY}"


def test_the_launchd_agent_runs_serve_with_known_flags():
    with open(ROOT / "deploy" / "com.example.mlx-voicechat.plist", "rb") as f:
        plist = plistlib.load(f)
    shell, dash_c, command = plist["ProgramArguments"]
    assert (shell, dash_c) == ("/bin/sh", "-c")
    argv = shlex.split(command)
    assert argv[0] == "exec" and argv[1].endswith("/mlx-voicechat") and argv[2] == "serve"
    args = _parse_serve(argv[3:argv.index(">>")])
    assert args.host == "127.0.0.1" and args.api_key


def test_the_docs_point_at_the_deployment_files():
    text = docs_text()
    for path in ("Dockerfile", "deploy/mlx-voicechat.service",
                 "deploy/com.example.mlx-voicechat.plist"):
        assert f"`{path}`" in text and (ROOT / path).is_file()


def test_the_license_is_the_apache_2_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


# --- the checkpoint conversion recipe ----------------------------------------


def test_the_readme_quantization_recipe_gives_the_4bit_layout(tiny_ckpt, tiny_q4_ckpt,
                                                              tmp_path):
    """The docs' snippet, run on the bf16 fixture, equals the factory's 4-bit fixture."""
    import mlx.nn as nn
    import numpy as np

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    (snippet,) = [b for b in FENCE.findall(docs_text())
                  if "from mlx_vlm.convert import convert" in b]
    out = tmp_path / "converted-q4"
    code = (snippet.replace('"path/to/bf16-checkpoint"', repr(str(tiny_ckpt)))
                   .replace('"path/to/4bit-checkpoint"', repr(str(out))))
    assert code != snippet
    exec(compile(code, "docs/checkpoints.md", "exec"), {})

    def run(path):
        model, processor = load(path)
        quantized = {p for p, m in model.named_modules()
                     if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
        result = model.create_session(processor).generate(
            question_signal(1.0), extra_decoding_seconds=0.5, seed=0)
        return quantized, result

    (ours_q, ours), (want_q, want) = run(out), run(tiny_q4_ckpt)
    assert ours_q == want_q and ours_q
    assert np.array_equal(np.array(ours.text_tokens), np.array(want.text_tokens))
    assert np.array_equal(np.array(ours.function_tokens), np.array(want.function_tokens))
    assert np.array_equal(np.array(ours.audio_codes), np.array(want.audio_codes))
    assert ours.user_transcript == want.user_transcript
