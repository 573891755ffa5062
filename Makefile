# Everything a fresh machine needs: `make demo` builds the tiny demo end to end, `make test` runs the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
QBUILD := $(VENV)/bin/qbuild
DEMO   := .qbuild
export QBUILD_STORE ?= $(CURDIR)/$(DEMO)/store

.PHONY: install system-packages test-packages constraints demo test test-fast stress lock-check neuron-check bench \
	clean

install: system-packages $(VENV)/.installed

# Debian packages, installed only where missing, and only as root with apt-get; elsewhere a line names what is
# missing. Graphviz's `dot` draws `qbuild report`'s DAG (without it the report is written without its drawing): the
# demo and the tests need it. Chromium is the browser the report's page test drives (Playwright's own browser download
# is not used): only the test lane that runs that test installs it (`make test`, which CI runs), never the demo;
# without it the page test is skipped outside CI.
SYSTEM_PACKAGES := graphviz
TEST_PACKAGES := chromium
define APT_INSTALL
missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | \
    grep -q 'ok installed' || echo $$p; done); \
if [ -z "$$missing" ]; then exit 0; fi; \
if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
    echo "apt-get install $$missing"; \
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
else echo "not installed: $$missing (Debian packages; install them as root)" >&2; fi
endef
system-packages:
	@$(call APT_INSTALL,$(SYSTEM_PACKAGES))
test-packages:
	@$(call APT_INSTALL,$(TEST_PACKAGES))

# torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build.
# constraints.txt pins every other distribution to the versions that built artifacts.lock (their versions are in the
# keys): without it, a library's new release would make a fresh machine's lock-check fail.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[build,s3,ray,serve,report,test]'
	touch $@

# After an upgrade on purpose: write the venv's versions back, then rebuild the lock and commit both.
constraints: install
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable | sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

$(DEMO)/tiny/%/config.json: | install
	$(QBUILD) tiny $* $(DEMO)/tiny/$*

# The served recipe is the dense one with long prompts and an encoder: demo/serve_client.py sends it a long prompt
# twice (cold, then warm from the prefix cache: time to the first token and cached_tokens) and an image chat, and
# writes what it got for the report.
DEMO_SERVED := recipes/tiny/dense-tp2-long.yaml
demo: install $(DEMO)/tiny/qwen3_5/config.json $(DEMO)/tiny/qwen3_5_moe/config.json $(DEMO)/tiny/qwen3_next/config.json
	$(QBUILD) plan recipes/tiny/*.yaml --lock $(DEMO)/artifacts.lock
	$(QBUILD) compile recipes/tiny/*.yaml -j 2 --lock $(DEMO)/artifacts.lock
	$(QBUILD) lock check --lock $(DEMO)/artifacts.lock
	$(QBUILD) run recipes/tiny/dense-tp2.yaml --lock $(DEMO)/artifacts.lock --prompt "The quick brown fox" --max-new-tokens 16
	rm -f $(DEMO)/serve.url
	$(QBUILD) serve $(DEMO_SERVED) --lock $(DEMO)/artifacts.lock --port 0 --ready-file $(DEMO)/serve.url & \
	pid=$$!; trap 'kill -INT $$pid 2>/dev/null' EXIT; \
	for i in $$(seq 600); do [ -s $(DEMO)/serve.url ] && break; kill -0 $$pid 2>/dev/null || exit 1; sleep 0.5; done; \
	[ -s $(DEMO)/serve.url ] || { echo "qbuild serve did not answer within 300 s" >&2; exit 1; }; \
	$(PY) demo/serve_client.py "$$(cat $(DEMO)/serve.url)" --out $(DEMO)/serve-demo.json && kill -INT $$pid && wait $$pid
	$(QBUILD) bench recipes/tiny/dense-tp2.yaml --lock $(DEMO)/artifacts.lock --repeats 3 --out $(DEMO)/bench-dense-tp2.json
	@echo "the demo's report, to open in a browser:"
	$(QBUILD) report --lock $(DEMO)/artifacts.lock --bench $(DEMO)/bench-dense-tp2.json --serve $(DEMO)/serve-demo.json \
	    --out $(DEMO)/report.html

# The suite starts hundreds of interpreters (the CLI, its workers): with bytecode writing turned off in the
# environment, each of them would compile qbuild from source again. An empty value turns it back on.
test test-fast stress lock-check: export PYTHONDONTWRITEBYTECODE =

# loadgroup: the tests of one xdist group (those sharing an expensive module fixture) run on one worker, so the
# fixture is built once; ungrouped tests go to whichever worker is free.
test: install test-packages
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15 -q

# The fast lane, for the edit-test loop: everything but the tests marked slow (AOTInductor, the Ray cluster,
# end-to-end builds and S3 round trips, the SIGKILL sweep, fuzzers, peak-memory measurements).
test-fast: install
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow" --durations=10 -q

# The store's concurrency and fault tests (gc, store verify --repair and builds racing, processes killed) N times over:
# each test's failure rate, and a failure if any run failed. Not part of `make test` (20 runs: about 30 min on 2 cores).
N ?= 20
stress: install
	$(PY) tests/stress.py $(N)

# The committed artifacts.lock names the tiny recipes' artifacts: a clean machine rebuilds them from nothing (fresh
# checkpoints, an empty store) to exactly what it locks, or this fails naming the first step that would differ.
lock-check: install
	for f in qwen3_5 qwen3_5_moe qwen3_next; do $(QBUILD) tiny $$f $(DEMO)/tiny/$$f --force; done
	QBUILD_STORE=$$(mktemp -d) $(QBUILD) compile recipes/tiny/*.yaml --frozen -j 2

# On a Trainium host with the Neuron SDK in the interpreter that runs it (e.g. make neuron-check PY=/opt/<sdk venv>/bin/
# python) and QBUILD_TEST_PORTS naming the port checkouts: the tiny families compiled, run and checked on the device,
# served through vLLM, and a tiny VL bundle's image chat through qbuild's server.
neuron-check:
	$(PY) -m pytest -n 0 -q -rs tests/test_neuron_sdk.py tests/test_neuron_serve.py::test_serve_a_tiny_neuron_bundle_with_vllm \
		tests/test_neuron_vl_serve.py::test_serve_an_image_chat_from_a_tiny_vl_bundle_on_neuron

bench: install
	$(PY) bench/run.py

clean:
	rm -rf $(DEMO)
