# The two commands of the README, plus the long test target.
# A virtualenv in .venv holds everything; on machines without CUDA the CPU build of torch goes in
# first, so that the unpinned `torch` requirement never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# e.g. TORCH_PIP_ARGS="--index-url <your CPU wheel index>" where no CPU wheel of torch is at hand
TORCH_PIP_ARGS ?=
export PYTHONHASHSEED := 0
export OMP_NUM_THREADS ?= 2

.PHONY: install demo test test-matrix test-long lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: installing torch from the default index"; \
		$(BIN)/python -m pip install --quiet "torch>=2.4"; \
	else \
		echo "no CUDA: installing the CPU build of torch $(TORCH_VERSION)"; \
		$(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .

# The main job: build the demo shards, then train the demo model with 2 DeepSpeed ranks on CPU.
demo: install
	$(BIN)/python -m data_pipeline.build --input "data/demo/train/*.txt" --output data/shards/demo/train --tokenizer bytes --shard-tokens 262144
	$(BIN)/python -m data_pipeline.build --input "data/demo/valid/*.txt" --output data/shards/demo/valid --tokenizer bytes
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/deepspeed --num_gpus 2 launch/pretrain.py --config configs/demo.yaml

# The test command (CI runs exactly this): lint, then the fast suite on two pytest-xdist workers, a
# test file to a worker (module-level fixtures and caches stay in one process), with the slowest
# tests listed. pytest exits 5 when it collects nothing; that is a failure here like any other code.
PYTEST_WORKERS ?= 2
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile --durations=25

# The fast suite under each CPU kernel set x thread count (docs/training.md, "The suite on other CPUs");
# a capability the CPU lacks falls back to the best one it has.
test-matrix: install
	@for cap in default avx2 avx512; do for omp in 1 2 4; do \
	  echo "== ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=$$omp"; \
	  ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=$$omp $(BIN)/python -m pytest -q -m "not slow" || exit 1; \
	done; done

test-long: install
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs data/shards
