# make test : create .venv when missing, install, run the test suite
# make demo : all set-up, then the main job on the embedded default
PY ?= python3
# torch's OpenMP threads busy-wait by default; on shared or busy cores that collapses throughput (measured:
# 93 -> 694 tokens/s for one training step under load). Passive waiting costs little on a quiet machine.
export OMP_WAIT_POLICY ?= PASSIVE
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install bench-ttt-memory clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

demo: $(STAMP)
	$(BIN)/eagle-heads demo

bench-ttt-memory: $(STAMP)
	$(BIN)/python bench/ttt_memory.py

clean:
	rm -rf .eagle
