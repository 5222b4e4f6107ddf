#!/usr/bin/env bash
# The one command of a lent accelerator: `bash bench/gpu.sh [--quick | --more] [more bench/gpu_pipeline.py options]`.
# --more (a second call, ideally on the still-warm machine so the stages' outputs are re-used): no self-check, and
# the pipeline evaluates a tree, sampling and batch 1-64 instead of the greedy chain.
# Runs `python -m eagle.selfcheck --device cuda` (skipped with --quick; its report lands in $OUT/selfcheck.json), then
# bench/gpu_pipeline.py: the real pipeline's components on the device (build the embedded `gpu` target, regenerate,
# extract, train in-process without Ray, evaluate: tau, acceptance, speedup, identical outputs), under a hard
# `timeout` (460 s here; --quick 160 s; TERM first: gpu_pipeline.py still writes what it measured). Writes
# gpu_pipeline.json, gpu.log and the evaluation's PNG plots into $OUT when set (the device tool brings back at most 8
# files, so the self-check's exported models stay in .eagle/), else into bench/results/ (--quick: .eagle/bench/
# results-quick/). Python: $PYTHON, else .venv/bin/python when present, else python3 (the
# device's, with torch, transformers, safetensors, tokenizers; no Ray, MLflow or Prefect needed).
# Not here: anything gpu_pipeline.py does; this only picks the interpreter, the output directory and the hard limit.
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0 more=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; [ "$a" = "--more" ] && more=1; done
if [ -n "${OUT:-}" ]; then out="$OUT"; elif [ "$quick" = 1 ]; then out=.eagle/bench/results-quick; else out=bench/results; fi
mkdir -p "$out"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
# full run: selfcheck (<= 60 s) + the pipeline (<= 460 s, then TERM, 15 s grace) = 535 s, under the 540 s of the
# documented device call and within one machine start of the device's 15-minute budget
hard=$([ "$quick" = 1 ] && echo 160 || echo 460)

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  echo "gpu.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), python $py, output $out, hard limit ${hard}s"
  git log -1 --format='gpu.sh: commit %h %s' 2>/dev/null
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c 'import torch, transformers; print("gpu.sh: torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "transformers", transformers.__version__)'
  if [ "$quick" = 0 ] && [ "$more" = 0 ]; then  # the EAGLE-3 core's self-check on the accelerator (~20 s on 1 CPU thread)
    timeout --signal=TERM --kill-after=5 60 "$py" -m eagle.selfcheck --device cuda --out .eagle/gpu-selfcheck
    echo "gpu.sh: selfcheck exit $?"
    cp .eagle/gpu-selfcheck/report.json "$out/selfcheck.json" 2>/dev/null
  fi
  timeout --signal=TERM --kill-after=15 "$hard" "$py" bench/gpu_pipeline.py --out "$out" "$@"
  rc=$?
  if [ "$more" = 1 ]; then for d in evaluate_tree evaluate_sampled; do
      for f in .eagle/gpu-pipeline/runs/gpu/$d/acceptance_by_position.png; do [ -f "$f" ] && cp "$f" "$out/${d}_acceptance.png"; done
    done
  elif [ "$quick" = 0 ]; then cp .eagle/gpu-pipeline/runs/gpu/evaluate/*.png "$out/" 2>/dev/null; fi
  echo "gpu.sh: exit $rc"
  exit $rc
} 2>&1 | tee "$out/gpu.log"
