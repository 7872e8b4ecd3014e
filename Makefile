# Two entry points (README quick start): `make run` and `make test`.
# Both create .venv, install the pinned torch build first, then the project with its extras.
#
#   TORCH_SPEC   torch requirement installed before everything else (default: the CPU 2.13.0 build
#                that this machine carries as a local wheel; on other machines pip picks the
#                platform default, which on Linux is a CUDA build).
#   TORCH_INDEX  optional extra index for torch (e.g. PyTorch's CPU or cu12x wheel index).
#   PYTHON       interpreter used to create the venv.
#
# `make run` installs the app (`pip install -e .`; the musicnn weights ship in assets/musicnn/);
# `make test` adds the dev and ray extras. Two packages are installed *without* their
# dependencies, for data only:
#   resampy==0.2.2  its kaiser_best filter table, into $(VENV)/vendor/ (torchvggish needs a current
#                   resampy in site-packages; only `extract --frontend musicnn` reads this one)
#   musicnn==0.1.0  (tests only) its TF1 checkpoint, which the test of scripts/convert_musicnn.py
#                   converts again to compare with the shipped weights

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup run test test-fast tolerances bench assets accuracy clean sysdeps sysdeps-test

# Tests run in pytest-xdist workers, one per core (one torch thread each, tests/conftest.py); each
# test is independent of the others (a JACK test runs its own JACK server, a Ray test class its own
# Ray session); a module's tests run in one worker (loadfile), so that its module-scoped set-up is
# made once.
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/vendor/resampy-0.2.2 resampy==0.2.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,ray]"
	$(PY) -m pip install --quiet --no-deps musicnn==0.1.0
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

sysdeps:
	@PYTHON=$(PYTHON) bash scripts/system-deps.sh

sysdeps-test:
	@PYTHON=$(PYTHON) bash scripts/system-deps.sh --test

# `prepare` builds the compiled forms once per machine (a minute or two the first time, seconds after)
run: sysdeps $(STAMP)
	$(PY) main.py prepare
	$(PY) main.py $(ARGS)

test: sysdeps-test $(TEST_STAMP)
	$(PY) main.py prepare --precision float32 --precision bf16 --threads 1
	$(PYTEST) --durations=15 $(ARGS)

# The developer loop: no shared data, JACK, Xvfb, Qt window or long tests (`make test
# ARGS=tests/gui` for the window).
test-fast: $(TEST_STAMP)
	$(PYTEST) -m "not shared and not jack and not display and not gui and not slow" $(ARGS)

# Every float tolerance's worst observed error over 20 seeds, and its margin (goal >= 3).
tolerances: $(TEST_STAMP)
	rm -f bench_results/margins.jsonl
	mkdir -p bench_results
	$(PYTEST) --seeds 20 --margins bench_results/margins.jsonl -m "not slow" \
		tests/models tests/app/test_engine.py tests/app/test_frontends_engine.py $(ARGS)
	$(PY) scripts/tolerance_margins.py bench_results/margins.jsonl

bench: $(STAMP)
	$(PY) main.py bench $(ARGS)

# The trained models shipped in assets/models/ (needs ../shared/data/gtzan_musicnn_tokens).
assets: $(STAMP)
	bash scripts/build_assets.sh

# Genre accuracy from audio on the shared GTZAN excerpts -> docs/audio_accuracy/.
accuracy: $(STAMP)
	$(PY) main.py accuracy --audio ../shared/data/gtzan_excerpts --out docs/audio_accuracy

clean:
	rm -rf $(VENV)
