PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_DIR := build/demo

.PHONY: venv install browser test demo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	# Editable installs do not carry the host-pickup .pth line; write it here.
	$(PY) -c "from mlx_voicechat_plugin.hosts.pickup import install_pth; install_pth()"
	touch $@

venv install: $(VENV)/.installed

# Chromium for tests/test_server_browser.py (which skips without it); installed
# only when CI is set, and only when missing.
browser:
	@if [ -n "$$CI" ]; then \
		command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
			|| echo "chromium unavailable: the browser test will skip"; \
	fi

# pytest exits 5 when it collects nothing; treat that as a failure of the
# suite's wiring rather than silently passing.
test: $(VENV)/.installed browser
	$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

demo: $(VENV)/.installed
	$(PY) -m mlx_voicechat_plugin.cli.demo --out $(DEMO_DIR)

clean:
	rm -rf build $(VENV)

.PHONY: soak
SOAK_SESSIONS ?= 200
# 200 sequential sessions on the tiny fixture: resident memory, threads, fds.
soak: $(VENV)/.installed
	$(PY) -m bench.soak --sessions $(SOAK_SESSIONS)
