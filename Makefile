# make demo: set up and run the main job. make test: set up and run the tests.
PY ?= python3
VENV ?= .venv
# CPU machines get the CPU wheel. A GPU user brings their own: `make setup TORCH_SPEC=` skips the
# torch install when the venv (e.g. created with --system-site-packages) already imports torch.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
# With the CPU torch, also vLLM's CPU build (the vLLM ring runs on it); a GPU user brings their own.
comma := ,
EXTRAS ?= $(if $(TORCH_SPEC),test$(comma)mooncake$(comma)redis$(comma)vllm,test$(comma)mooncake$(comma)redis)
# CUDA builds pip pulls in beside vLLM's CPU build; they break `import vllm` and nothing here needs them.
CUDA_ONLY_EXTRAS := torchvision torchaudio torchcodec
BIN := $(VENV)/bin

# Debian packages: libibverbs1 (Mooncake's libraries link it even for TCP) and redis-server for the store
# tests; libxxhash-dev, xxHash's header the native tree core is built with (without it the install builds
# the reference core, docs/development.md). Installed as root when missing; without root, setup says what
# to install.
SYSTEM_PACKAGES ?= libibverbs1 redis-server libxxhash-dev

.PHONY: setup system-packages demo test lint bench clean setup-sglang test-sglang

setup: system-packages $(VENV)/.installed

system-packages:
	@missing=""; \
	for pkg in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "ok installed" || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian packages:$$missing (about a minute)"; \
		apt-get -o DPkg::Lock::Timeout=300 update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
		echo "warning: missing system packages:$$missing (the Mooncake and Redis store tests need them, docs/guides/storage.md; the native tree core needs libxxhash-dev, docs/development.md)" >&2; \
	fi

$(VENV)/.installed: pyproject.toml tpcache/io/_rowcopy.c $(wildcard protocol/_*.c protocol/_*.h tpcache/core/_*.c tpcache/core/_*.h)
	@echo "setup: a virtual environment in $(VENV) with$(if $(TORCH_SPEC), $(TORCH_SPEC) (CPU build)$(comma),) tpcache (its C extensions built here) and the extras [$(EXTRAS)]:"
	@echo "  $(if $(findstring vllm,$(EXTRAS)),vLLM's CPU build$(comma) )the Mooncake and Redis clients$(comma) pytest and ruff (about 3 minutes on a fresh machine)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! $(BIN)/python -c "import torch" 2>/dev/null && [ -n "$(TORCH_SPEC)" ]; then \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip uninstall -q -y $(CUDA_ONLY_EXTRAS) 2>/dev/null || true; fi
	touch $@
	@echo "setup: done ($(VENV)/bin/python)"

# SGLang (tpcache.integrations.sglang and its test ring) in a venv of its own: SGLang 0.5.23's pins
# (torch 2.14.1, compressed-tensors, numba, openai, outlines, xgrammar) clash with vLLM's CPU build.
# The CPU torch first, then SGLang's dependencies that run without CUDA with torch held at that
# version, then sglang itself without its dependencies, then tpcache editable into this venv with
# its store clients (Redis, Mooncake).
# `make test SGLANG_RING=0` leaves the SGLang ring (and this venv) out.
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_RING ?= 1
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_HOLD := $(if $(TORCH_SPEC),-c $(SGLANG_VENV)/torch-constraint.txt)

setup-sglang: system-packages $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: pyproject.toml tests/sglang/requirements.txt
	test -x $(SGLANG_BIN)/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	echo "$(TORCH_SPEC)" > $(SGLANG_VENV)/torch-constraint.txt
	if [ -n "$(TORCH_SPEC)" ]; then $(SGLANG_BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(SGLANG_BIN)/python -m pip install -q $(SGLANG_HOLD) -r tests/sglang/requirements.txt
	$(SGLANG_BIN)/python -m pip install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_BIN)/python -m pip install -q $(SGLANG_HOLD) -e ".[test,redis,mooncake]"
	touch $@

demo: setup
	$(BIN)/python -m launcher demo

test: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --timeout 900
	if [ "$(SGLANG_RING)" = 1 ]; then $(MAKE) --no-print-directory test-sglang; fi

# The SGLang ring (tests/sglang) with SGLang's venv; the main venv skips those tests.
test-sglang: setup-sglang
	$(SGLANG_BIN)/python -m pytest -q --timeout 900 tests/sglang

lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

bench: setup
	$(BIN)/python scripts/replay.py --trace ../shared/data/mooncake/conversation_trace.jsonl --device-tokens 3000000 --json

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
