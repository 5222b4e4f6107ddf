"""bench/gpu.py runs where only torch, transformers, safetensors and their dependencies are installed.

Purpose: the device machine has no Prefect, MLflow, Ray, matplotlib or datasets, and one try.
This runs `bench/gpu.py --quick --device cpu` (the same code path on the tiny embedded preset, 1 torch thread) in a
subprocess where every installed package outside the dependency closure of torch, transformers, safetensors and
tokenizers (read from the installed packages' metadata), and the project's infra/ and flows/, cannot be imported
(`sys.modules[name] = None`: `import` raises ImportError and `importlib.util.find_spec` says absent, as on the device;
optional imports such as transformers' of PIL or huggingface_hub's of h2 then fall back as they do there). It checks
that gpu.json has every figure, that greedy speculative outputs equal plain decoding, that the MFU figures are
positive, and that what the run imported from site-packages lies within that closure.
Run: `python -m pytest tests/test_bench_gpu_quick.py` (about 15-20 s on 2 shared cores).
Not here: the GPU figures themselves (bench/README.md says how to get them on the device).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALWAYS_BLOCKED = ("prefect", "mlflow", "ray", "matplotlib", "datasets", "infra", "flows")
DEVICE_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers")
PROJECT = "eagle-heads"  # its editable install maps eagle/ and components/ (which the device has: the working tree)
RUNNER = """
import atexit, json, runpy, sys, sysconfig
for name in json.load(open({blocked!r})):
    sys.modules[name] = None
site = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
def dump():
    mods = {{n.split(".")[0]: getattr(m, "__file__", None) or "" for n, m in list(sys.modules.items()) if m is not None}}
    third = sorted(n for n, f in mods.items() if f.startswith(site))
    open({imports!r}, "w").write(json.dumps(third))
atexit.register(dump)
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def dependency_closure(roots: tuple[str, ...]) -> set[str]:
    """Normalised names of `roots` and everything they require (extras off, markers evaluated here)."""
    from packaging.requirements import Requirement

    seen, todo = set(), [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_norm(r.name))
    return seen


def not_on_the_device() -> list[str]:
    """Top-level import names of installed packages outside the device's closure, and the always-blocked ones."""
    allowed = dependency_closure(DEVICE_PACKAGES) | {PROJECT}
    names = {name for name, dists in metadata.packages_distributions().items()
             if not {_norm(d) for d in dists} & allowed and not name.startswith(("__editable__", "_distutils_hack"))}
    return sorted(names | set(ALWAYS_BLOCKED))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str], str]:
    tmp = tmp_path_factory.mktemp("gpu-quick")
    imports, blocked = tmp / "imports.json", tmp / "blocked.json"
    blocked.write_text(json.dumps(not_on_the_device()))
    runner = RUNNER.format(blocked=str(blocked), imports=str(imports), script=str(ROOT / "bench" / "gpu.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", runner, "--quick", "--device", "cpu", "--out", str(tmp / "out"),
                           "--work", str(tmp / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"bench/gpu.py --quick failed:\n{log}"
    return json.loads((tmp / "out" / "gpu.json").read_text()), json.loads(imports.read_text()), log


def test_gpu_json_has_every_figure(quick_run: tuple[dict, list[str], str]) -> None:
    r, _, log = quick_run
    assert r["status"] == "complete", log
    assert set(r["phases_s"]) == {"build", "regenerate", "extract", "train", "mfu", "measure"}
    assert all(s >= 0 for s in r["phases_s"].values())
    assert {"device", "device_name", "torch", "transformers", "date"} <= set(r["environment"])
    assert r["config"]["embedded"]["target"]["hidden_size"] == 64  # the tiny preset
    assert r["build"]["target_train"]["tokens_per_second"] > 0
    assert r["regenerate"]["sequences"] > 0 and r["regenerate"]["trained_tokens"] > 0
    assert r["train"]["steps"] == r["train"]["planned_steps"] and r["train"]["final_metrics"]["loss"] > 0
    assert r["measure"]["errors"] == {}
    for batch, rows in ((k, v["rows"]) for k, v in r["measure"].items() if k.startswith("batch_")):
        assert set(rows) == {"plain", "chain", "tree"}, batch
        assert all(row["mismatch"] == 0 for row in rows.values()), (batch, rows)
        assert all(row["tok_s"] > 0 and row["x_plain"] > 0 for row in rows.values()), (batch, rows)
        assert all(1.0 <= rows[m]["tau"] <= len(rows[m]["alpha"]) + 1 for m in ("chain", "tree")), (batch, rows)
    assert {"batch_1", "batch_64"} <= set(r["measure"])


def test_mfu_is_plausible(quick_run: tuple[dict, list[str], str]) -> None:
    m = quick_run[0]["mfu"]
    assert m["peak_bf16_tflops"] is None and m["head_ttt_step"]["mfu"] is None  # a CPU has no entry in the table
    assert m["matmul_bf16_tflops_measured"] > 0
    for part in ("head_ttt_step", "target_train_step"):
        assert m[part]["achieved_tflops"] > 0
        assert 0 < m[part]["mfu_vs_matmul"] < 2, m[part]  # a model step never beats a large matmul by much
    assert m["head_ttt_step"]["flops_per_step"] > 0 and m["target_train_step"]["flops_per_token"] > 0


def test_imports_stay_within_what_the_device_has(quick_run: tuple[dict, list[str], str]) -> None:
    allowed = dependency_closure(DEVICE_PACKAGES) | {PROJECT}
    owners = metadata.packages_distributions()
    outside = {m: owners.get(m, ["?"]) for m in quick_run[1]
               if not m.startswith(("__editable__", "_distutils_hack")) and not {_norm(d) for d in owners.get(m, [])}
               & allowed}
    assert not outside, f"bench/gpu.py imported packages the device does not have: {outside}"
    assert not set(quick_run[1]) & set(ALWAYS_BLOCKED)
    assert {"torch", "transformers", "tokenizers"} <= set(quick_run[1])


def test_head_flops_formula_counts_what_it_says() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu import head_step_flops

    from eagle.config import DraftConfig

    cfg = DraftConfig.tiny()  # H 64, 4 heads x 16, 2 kv heads, I 128, Vd 128
    H, dq, dkv, I, Vd = 64, 64, 32, 128, 128
    n, K = 10, 2
    dense = 2 * (2 * H * (dq + 2 * dkv) + dq * H + 3 * H * I + H * Vd)
    attn = 4 * dq * (n * (n + 1) / 2) + 4 * dq * (n * (n + 1) / 2 + n)
    assert head_step_flops(cfg, [n], K) == 3 * (n * 6 * H * H + K * n * dense + attn)
    assert head_step_flops(cfg, [n, n], K) == 2 * head_step_flops(cfg, [n], K)
