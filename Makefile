# Two commands for a fresh machine (see README.md):
#   make demo   set up .venv, build, run the main demo
#   make test   set up .venv, build (CUDA too when nvcc + a CUDA torch exist), run the tests
# Build switches (FASTLAPSUM_CUDA, TORCH_CUDA_ARCH_LIST, MAX_JOBS) are documented in setup.py.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MAX_JOBS ?= 2
export MAX_JOBS
PYTEST_ARGS ?= -m "not slow"
# compiled-graph caches per checkout: a cache shared across versions can replay stale fake kernels
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache

.PHONY: all venv build test test-all demo bench clean

all: build

# A venv that sees an already installed torch (the GPU machine), else one with torch installed.
$(VENV)/.ready: requirements.txt requirements-torch.txt
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "using the torch already installed for $(PYTHON)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV) && \
	  $(PYTHON) -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" \
	    > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/system-torch.pth"; \
	else \
	  $(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q -r requirements-torch.txt; \
	fi
	@# offline machines already have these: only reach for pip when one is missing
	$(PY) -c "import numpy, pytest, setuptools, matplotlib" 2>/dev/null || $(VENV)/bin/pip install -q -r requirements.txt
	@# make the in-tree package importable from the venv (an editable install without pip)
	$(PY) -c "import os, sysconfig; open(os.path.join(sysconfig.get_path('purelib'), 'fastlapsum-dev.pth'), 'w').write(os.getcwd() + '\\n')"
	touch $@

venv: $(VENV)/.ready

SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh') setup.py

build/.built: $(VENV)/.ready $(SOURCES)
	$(PY) setup.py build_ext --inplace
	@mkdir -p build && touch $@

build: build/.built

test: build
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

test-all: PYTEST_ARGS :=
test-all: test

demo: build
	$(PY) examples/demo.py

bench: build
	$(PY) benchmarks/bench_soft_topk.py

clean:
	rm -rf build fastlapsum/_C*.so *.egg-info
