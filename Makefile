# Two entry points (README quick start): `make run` and `make test`.
# Both create .venv, install the pinned torch build first, then the project with its extras.
#
#   TORCH_SPEC   torch requirement installed before everything else (default: the CPU 2.13.0 build
#                that this machine carries as a local wheel; on other machines pip picks the
#                platform default, which on Linux is a CUDA build).
#   TORCH_INDEX  optional extra index for torch (e.g. PyTorch's CPU or cu12x wheel index).
#   PYTHON       interpreter used to create the venv.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean sysdeps sysdeps-test

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

sysdeps:
	@bash scripts/system-deps.sh

sysdeps-test:
	@bash scripts/system-deps.sh --test

run: sysdeps $(STAMP)
	$(PY) main.py $(ARGS)

test: sysdeps-test $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) main.py bench $(ARGS)

clean:
	rm -rf $(VENV)
