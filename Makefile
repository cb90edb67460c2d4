# Newcomer entry points: `make demo` and `make test` (both work on a fresh CPU machine).
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m-instruct

.PHONY: install demo test fetch clean

$(VENV)/.installed: setup.py requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e '.[test,cutedsl]'
	touch $@

install: $(VENV)/.installed

fetch: install
	$(PY) -m tensorrt_llm.tools.fetch_model $(MODEL)

demo: fetch
	$(PY) examples/demo.py

test: fetch
	$(PY) -m pytest -q -p no:cacheprovider tests/unittest

clean:
	rm -rf $(VENV) build *.egg-info
