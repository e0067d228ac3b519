# Two entry points, each creating .venv on first use:
#   make run        - the main job: generate text with the embedded default model
#   make test       - lint and the whole test suite (what CI runs), the 25 slowest tests listed
# and, for editing:
#   make test-fast  - the tests that are not slow, subprocess, fuzz or compiled (markers in pyproject.toml)
#   make lint       - ruff (check and format --check) and mypy; make fmt - ruff format and ruff check --fix
#   make typecheck  - mypy alone
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: run test test-fast lint fmt typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel; an unpinned torch would pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	.venv/bin/rsmem generate "ROMEO:" -n 160 --seed 1

LINTED := src tests bench scripts

lint: $(STAMP) typecheck
	.venv/bin/ruff check $(LINTED)
	.venv/bin/ruff format --check $(LINTED)

fmt: $(STAMP)
	.venv/bin/ruff check --fix $(LINTED)
	.venv/bin/ruff format $(LINTED)

typecheck: $(STAMP)
	.venv/bin/mypy  # src/rsmem; settings in pyproject.toml [tool.mypy]

test: $(STAMP) lint
	$(PY) -m pytest --durations=25

FAST := not slow and not subprocess and not fuzz and not compiled

test-fast: $(STAMP)
	$(PY) -m pytest -m "$(FAST)"

bench: $(STAMP)
	$(PY) bench/memory_bookkeeping.py
	.venv/bin/rsmem bench

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
