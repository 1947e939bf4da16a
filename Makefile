# Two commands for a fresh machine (see README.md):
#   make demo   set up a venv, build, run the main demo
#   make test   set up .venv, build (CUDA too when nvcc + a CUDA torch exist), run the tests
#               (the examples' requirements, examples/*/requirements.txt, installed first when missing)
#
# Two venvs, each with the extension built against its own torch:
#   .venv      test, build, test-all; and demo, bench on a machine with a GPU (nvidia-smi works).
#              Where python3 already imports torch (the GPU machine) it uses that torch;
#              otherwise requirements-torch.txt: a CUDA build, so that the CUDA sources compile
#              without a GPU (CI proves the CUDA build that way).
#   .venv-cpu  demo, bench, test-cpu on a machine without a GPU: python3's torch if it has one,
#              else requirements-torch-cpu.txt (a CPU torch, no gigabytes of CUDA libraries), and a
#              C++-only build (FASTLAPSUM_CUDA=0): the first result in minutes.
# GPU=1 / GPU=0 overrides the detection. Both builds put the extension in fastlapsum/ (in place);
# switching between them rebuilds it (objects are kept, so that is mostly a link).
# Objects and caches live outside the source tree, in BUILD_DIR (make clean removes it).
# Build switches (FASTLAPSUM_CUDA, TORCH_CUDA_ARCH_LIST, MAX_JOBS) are documented in setup.py.
PYTHON ?= python3
MAX_JOBS ?= 2
export MAX_JOBS
PYTEST_ARGS ?= -m "not slow"
# extra pip arguments for the CPU torch, e.g. PyTorch's CPU wheel index where pip does not
# already see a CPU build: CPU_TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
CPU_TORCH_PIP_ARGS ?=
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
BUILD_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fastlapsum/$(notdir $(CURDIR))-$(shell printf '%s' '$(CURDIR)' | sha1sum | cut -c1-8)
# compiled-graph caches per checkout, emptied at each build of the extension: a cache shared
# across versions can replay stale fake kernels
INDUCTOR_CACHE := $(BUILD_DIR)/inductor-cache
export TORCHINDUCTOR_CACHE_DIR ?= $(INDUCTOR_CACHE)

VENV := .venv
PY := $(VENV)/bin/python
CPU_VENV := .venv-cpu
CPU_PY := $(CPU_VENV)/bin/python
ifeq ($(GPU),1)
RUN_PY := $(PY)
RUN_BUILD := build
else
RUN_PY := $(CPU_PY)
RUN_BUILD := build-cpu
endif

.PHONY: all venv venv-cpu build build-cpu test test-all test-cpu demo bench clean

all: build

# make-venv DIR TORCH_REQUIREMENTS PIP_ARGS: a venv that sees python3's torch if it has one, else
# one with torch installed; then the build and test needs; then the source tree on its path.
define make-venv
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "using the torch already installed for $(PYTHON)"; \
	  $(PYTHON) -m venv --system-site-packages $(1) && \
	  $(PYTHON) -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" \
	    > "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/system-torch.pth"; \
	else \
	  $(PYTHON) -m venv $(1) && $(1)/bin/pip install -q $(3) -r $(2) -r requirements.txt; \
	fi
	@# offline machines already have these: only reach for pip when one is missing
	$(1)/bin/python -c "import numpy, pytest, setuptools, matplotlib" 2>/dev/null || $(1)/bin/pip install -q -r requirements.txt
	@# make the in-tree package importable from the venv (an editable install without pip)
	$(1)/bin/python -c "import os, sysconfig; open(os.path.join(sysconfig.get_path('purelib'), 'fastlapsum-dev.pth'), 'w').write(os.getcwd() + '\\n')"
	touch $(1)/.ready
endef

$(VENV)/.ready: requirements.txt requirements-torch.txt
	$(call make-venv,$(VENV),requirements-torch.txt,)

$(CPU_VENV)/.ready: requirements.txt requirements-torch-cpu.txt
	$(call make-venv,$(CPU_VENV),requirements-torch-cpu.txt,$(CPU_TORCH_PIP_ARGS))

venv: $(VENV)/.ready
venv-cpu: $(CPU_VENV)/.ready

SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh') setup.py

# build-ext VENV NAME ENV: build fastlapsum/_C*.so in place with VENV's python, objects in
# BUILD_DIR/NAME. The stamp lives in the venv; the other venv's goes, as the .so is no longer its build.
define build-ext
	rm -rf $(VENV)/.built $(CPU_VENV)/.built fastlapsum/_C*.so $(INDUCTOR_CACHE)
	$(3) FASTLAPSUM_BUILD_DIR=$(BUILD_DIR)/$(2) $(1)/bin/python setup.py build_ext --inplace
	touch $(1)/.built
endef

$(VENV)/.built: $(VENV)/.ready $(SOURCES)
	$(call build-ext,$(VENV),cuda,)

$(CPU_VENV)/.built: $(CPU_VENV)/.ready $(SOURCES)
	$(call build-ext,$(CPU_VENV),cpu,FASTLAPSUM_CUDA=0)

build: $(VENV)/.built
build-cpu: $(CPU_VENV)/.built

test: build
	$(PY) tools/ensure_requirements.py
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

test-all: PYTEST_ARGS :=
test-all: test

test-cpu: build-cpu
	$(CPU_PY) tools/ensure_requirements.py $(CPU_TORCH_PIP_ARGS)
	$(CPU_PY) -m pytest tests -q $(PYTEST_ARGS)

demo: $(RUN_BUILD)
	$(RUN_PY) examples/demo.py

bench: $(RUN_BUILD)
	$(RUN_PY) benchmarks/bench_soft_topk.py

clean:
	rm -rf $(BUILD_DIR) fastlapsum/_C*.so build *.egg-info
