# Two commands do all set-up on a fresh machine:  `make demo` (the main job) and `make test`.
# .venv is created if absent; on a machine without a CUDA GPU it gets the CPU torch==2.13.0 wheel,
# on a machine with one it reuses that machine's CUDA torch and triton (system site packages).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shadowprefill-installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
SOURCES := setup.py pyproject.toml CMakeLists.txt $(wildcard csrc/*.h csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu)

.PHONY: install test demo bench clean

install: $(STAMP)

$(PY):
ifeq ($(HAS_GPU),1)
	python3 -m venv --system-site-packages $(VENV)
else
	python3 -m venv $(VENV)
endif

$(STAMP): $(PY) $(SOURCES)
ifneq ($(HAS_GPU),1)
	$(PY) -m pip install -q torch==2.13.0 triton==3.9.0
endif
	$(PY) -m pip install -q setuptools wheel pybind11 cmake ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m shadowprefill.cli demo

bench: $(STAMP)
	$(PY) -m pytest -q bench --benchmark-only --benchmark-columns=median,ops

clean:
	rm -rf build *.egg-info shadowprefill/*.so

include mk/vllm.mk
include mk/ray.mk
