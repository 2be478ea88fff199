PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_DIR := build/demo

.PHONY: venv install browser haproxy livekit test test-real demo clean

$(VENV)/.installed: pyproject.toml
	@echo "==> creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing mlx-voicechat-plugin and its dev dependencies (MLX, mlx-vlm, mlx-audio, ...): a few minutes the first time"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@echo "==> letting mlx-vlm and mlx-audio's own commands run VoiceChat checkpoints (host pickup)"
	# Editable installs do not carry the host-pickup .pth line; write it here.
	$(PY) -c "from mlx_voicechat_plugin.hosts.pickup import install_pth; install_pth()"
	@echo "==> installed"
	touch $@

venv install: $(VENV)/.installed

# Chromium for tests/test_server_browser.py and tests/test_console_webrtc.py (which
# skip without it); installed only when CI is set, and only when missing. The
# console test also needs `unshare` (util-linux, always there on Debian) and
# brings loopback up itself (an ioctl, no iproute2).
browser:
	@if [ -n "$$CI" ]; then \
		command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
			|| echo "chromium unavailable: the browser test will skip"; \
	fi

# HAProxy for tests/test_replicas_haproxy.py (which skips without it); installed
# only when CI is set, and only when missing.
haproxy:
	@if [ -n "$$CI" ]; then \
		command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] \
			|| (apt-get update -qq && apt-get install -y -qq haproxy) \
			|| echo "haproxy unavailable: the replicas test will skip"; \
	fi

# LiveKit agents-js's GPTLiveModel for tests/test_server_live.py (which skips without
# it): installed into build/livekit where Node is present, once.
LIVEKIT_DIR := build/livekit
LIVEKIT_PACKAGES := @livekit/agents@1.9.0 @livekit/agents-plugin-openai@1.9.0 \
	@livekit/rtc-node@0.13.35 zod@3.25.76
livekit:
	@if command -v npm >/dev/null; then \
		[ -d $(LIVEKIT_DIR)/node_modules/@livekit/agents-plugin-openai ] || ( \
			mkdir -p $(LIVEKIT_DIR) && cd $(LIVEKIT_DIR) \
			&& ( [ -f package.json ] || echo '{"private": true}' > package.json ) \
			&& npm install -q --no-audit --no-fund $(LIVEKIT_PACKAGES) ) \
			|| echo "LiveKit agents-js unavailable: its test will skip"; \
	else echo "Node unavailable: the LiveKit test will skip"; fi

# pytest exits 5 when it collects nothing; treat that as a failure of the
# suite's wiring rather than silently passing. The files run in parallel, one
# worker a core (pytest-xdist; TEST_WORKERS=0 runs them in this process), each
# file whole on one worker so its module fixtures (servers, models) start once.
TEST_WORKERS ?= auto
test: $(VENV)/.installed browser haproxy livekit
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

# The real-checkpoint tests (tests/test_real_checkpoint.py): load, offline and
# streaming 2 s, one server session. Needs MLX_VOICECHAT_CHECKPOINT.
test-real: $(VENV)/.installed
	@if [ -z "$$MLX_VOICECHAT_CHECKPOINT" ]; then \
		echo "set MLX_VOICECHAT_CHECKPOINT to a checkpoint directory (e.g. NemotronLabs-VoiceChat-11B-4bit)"; \
		exit 2; \
	fi
	$(PY) -m pytest -q -s -m real_checkpoint tests/test_real_checkpoint.py

demo: $(VENV)/.installed
	@echo "==> the demo: a tiny checkpoint with random weights answers a synthetic question;"
	@echo "    its words are gibberish by design (no weights are downloaded), the pipeline is the real one"
	$(PY) -m mlx_voicechat_plugin.cli.demo --out $(DEMO_DIR)

clean:
	rm -rf build $(VENV)

.PHONY: soak
SOAK_SESSIONS ?= 200
# 200 sessions on the tiny fixture, one at a time and then 4 at a time
# (--max-sessions 4), then 200 drop-and-resume cycles: resident memory,
# threads, fds at start, middle, end.
soak: $(VENV)/.installed
	$(PY) -m bench.soak --sessions $(SOAK_SESSIONS)
	$(PY) -m bench.soak --sessions $(SOAK_SESSIONS) --concurrency 4
	$(PY) -m bench.soak --resume-cycles $(SOAK_SESSIONS)
