# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo lora-evidence test test-slow test-deploy test-all docs setup clean

# (setuptools' notice that an editable install follows this folder says what we want: it is not shown)
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e '.[dev,docs]'
	$(BIN)/python -m fedflat.engine.native  # builds the native MLP gradient once (~15 s; the Python one runs without it)
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

# Seven methods on the quickstart split, then the comparison table (rerunning skips finished cells).
demo: $(STAMP)
	$(BIN)/fedflat sweep configs/demo_sweep.yaml
	$(BIN)/fedflat report runs/sweeps/demo --target-acc 0.85 0.9 --plot runs/sweeps/demo/plots --output runs/sweeps/demo/table.md

# docs/lora_evidence.md: pretrain the ViT, fine-tune it federated (69 runs, hours on 2 cores), the tables.
# Rerunning skips finished runs and resumes interrupted ones.
lora-evidence: $(STAMP)
	$(BIN)/fedflat sweep configs/lora_fmnist_pretrain.yaml
	$(BIN)/fedflat sweep configs/lora_fmnist_sweep.yaml --workers 2
	$(BIN)/fedflat report runs/sweeps/lora_fmnist --target-acc 0.7 0.8 --output runs/sweeps/lora_fmnist/report.md
	$(BIN)/python scripts/lora_table.py runs/sweeps/lora_fmnist --target-acc 0.7 0.8 | tee runs/sweeps/lora_fmnist/table.md

# The site: README, docs/ and the API reference from the docstrings, into docs/_build/html (warnings are errors).
# Sphinx reports its progress (reading, then writing each page: a few minutes, most of it the reference).
docs: $(STAMP)
	rm -rf docs/reference/generated  # (autosummary's pages of modules since renamed or removed would fail the build)
	@echo "docs: building the site from README, docs/ and every module's docstrings (a few minutes)"
	$(BIN)/python -m sphinx -b html -W --keep-going docs docs/_build/html
	@echo "site: docs/_build/html/index.html"

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The secure deployment (TLS, SuperNode authentication, strangers refused) on 127.0.0.1: slow tests CI runs too.
test-deploy: $(STAMP)
	$(BIN)/python -m pytest -q -m deploy

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

clean:
	rm -rf $(VENV) runs .pytest_cache *.egg-info docs/_build docs/reference/generated
