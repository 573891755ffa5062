# Everything a fresh machine needs: `make demo` builds the tiny demo end to end, `make test` runs the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
QBUILD := $(VENV)/bin/qbuild
DEMO   := .qbuild
export QBUILD_STORE ?= $(CURDIR)/$(DEMO)/store

.PHONY: install demo test test-fast lock-check neuron-check bench clean

install: $(VENV)/.installed

# torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[build,s3,ray,test]'
	touch $@

$(DEMO)/tiny/%/config.json: | install
	$(QBUILD) tiny $* $(DEMO)/tiny/$*

demo: install $(DEMO)/tiny/qwen3_5/config.json $(DEMO)/tiny/qwen3_5_moe/config.json $(DEMO)/tiny/qwen3_next/config.json
	$(QBUILD) plan recipes/tiny/*.yaml --lock $(DEMO)/artifacts.lock
	$(QBUILD) compile recipes/tiny/*.yaml -j 2 --lock $(DEMO)/artifacts.lock
	$(QBUILD) lock check --lock $(DEMO)/artifacts.lock
	$(QBUILD) run recipes/tiny/dense-tp2.yaml --lock $(DEMO)/artifacts.lock --prompt "The quick brown fox" --max-new-tokens 16

# The suite starts hundreds of interpreters (the CLI, its workers): with bytecode writing turned off in the
# environment, each of them would compile qbuild from source again. An empty value turns it back on.
test test-fast lock-check: export PYTHONDONTWRITEBYTECODE =

# loadgroup: the tests of one xdist group (those sharing an expensive module fixture) run on one worker, so the
# fixture is built once; ungrouped tests go to whichever worker is free.
test: install
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15 -q

# The fast lane, for the edit-test loop: everything but the tests marked slow (AOTInductor, the Ray cluster,
# end-to-end builds and S3 round trips, the SIGKILL sweep, fuzzers, peak-memory measurements).
test-fast: install
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow" --durations=10 -q

# The committed artifacts.lock names the tiny recipes' artifacts: a clean machine rebuilds them from nothing (fresh
# checkpoints, an empty store) to exactly what it locks, or this fails naming the first step that would differ.
lock-check: install
	for f in qwen3_5 qwen3_5_moe qwen3_next; do $(QBUILD) tiny $$f $(DEMO)/tiny/$$f --force; done
	QBUILD_STORE=$$(mktemp -d) $(QBUILD) compile recipes/tiny/*.yaml --frozen -j 2

# On a Trainium host with the Neuron SDK in the interpreter that runs it (e.g. make neuron-check PY=/opt/<sdk venv>/bin/
# python) and QBUILD_TEST_PORTS naming the port checkouts: the tiny families compiled, run and checked on the device.
neuron-check:
	$(PY) -m pytest -n 0 -q -rs tests/test_neuron_sdk.py

bench: install
	$(PY) bench/run.py

clean:
	rm -rf $(DEMO)
