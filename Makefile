# Two entry points, each creating .venv on first use:
#   make run   - the main job: generate text with the embedded default model
#   make test  - lint and the test suite
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel; an unpinned torch would pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	.venv/bin/rsmem generate "ROMEO:" -n 160 --seed 1

lint: $(STAMP)
	.venv/bin/ruff check src tests bench scripts
	.venv/bin/ruff format --check src tests bench scripts
	.venv/bin/mypy  # src/rsmem; settings in pyproject.toml [tool.mypy] (batch/ and memory/ strict)

test: $(STAMP) lint
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/memory_bookkeeping.py
	.venv/bin/rsmem bench

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
