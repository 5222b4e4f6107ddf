"""bench/gpu_pipeline.py runs the real components where only torch, transformers, safetensors are installed.

Purpose: the device machine has no Prefect, MLflow, Ray, matplotlib or datasets, and one try. This runs
`bench/gpu_pipeline.py --quick --device cpu` (build the tiny embedded target, then regenerate -> extract -> train
(in-process, `train.ray.num_workers` 0) -> evaluate with the components themselves, 1 torch thread) in a subprocess
where every installed package outside the dependency closure of torch, transformers, safetensors and tokenizers
(read from the installed packages' metadata), and the project's flows/, cannot be imported
(`sys.modules[name] = None`: `import` raises ImportError and `importlib.util.find_spec` says absent, as on the device;
optional imports such as transformers' of PIL or huggingface_hub's of h2 then fall back as they do there). It checks
that every stage ran and wrote its result, that greedy speculative outputs equal plain decoding, and that what the
run imported from site-packages lies within that closure.
Then `--more` in the same work dir (the second device call: the stages re-used, a tree, sampling and batches evaluated).
Run: `python -m pytest tests/test_bench_gpu_quick.py` (about 40 s on 2 shared cores).
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
ALWAYS_BLOCKED = ("prefect", "mlflow", "ray", "matplotlib", "datasets", "flows")  # infra/ is in the tree:
# its modules that need MLflow, Ray or Prefect fail to import here as there (components/regenerate/stage.py reads
# infra/settings.py, which is standard library only)
DEVICE_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers")
PROJECT = "eagle-heads"  # its editable install maps eagle/ and components/ (which the device has: the working tree)
RUNNER = """
import atexit, json, runpy, sys, sysconfig
for name in json.load(open({blocked!r})):
    sys.modules[name] = None
site = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
def dump():
    mods = {{n.split(".")[0]: getattr(m, "__file__", None) or ""
             for n, m in list(sys.modules.items()) if m is not None}}
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
    names = {
        name
        for name, dists in metadata.packages_distributions().items()
        if not {_norm(d) for d in dists} & allowed and not name.startswith(("__editable__", "_distutils_hack"))
    }
    return sorted(names | set(ALWAYS_BLOCKED))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str], str, dict]:
    """The quick run, then `--more` in the same work dir (the second device call): (first JSON, first run's
    third-party imports, log, second JSON)."""
    tmp = tmp_path_factory.mktemp("gpu-quick")
    imports, blocked = tmp / "imports.json", tmp / "blocked.json"
    blocked.write_text(json.dumps(not_on_the_device()))
    runner = RUNNER.format(blocked=str(blocked), imports=str(imports), script=str(ROOT / "bench" / "gpu_pipeline.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = []
    for more in ((), ("--more",)):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                runner,
                "--quick",
                "--device",
                "cpu",
                "--out",
                str(tmp / "out"),
                "--work",
                str(tmp / "work"),
                *more,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        log = proc.stdout[-3000:] + proc.stderr[-4000:]
        assert proc.returncode == 0, f"bench/gpu_pipeline.py --quick {' '.join(more)} failed:\n{log}"
        runs.append((json.loads(imports.read_text()), log))
    return (
        json.loads((tmp / "out" / "gpu_pipeline.json").read_text()),
        runs[0][0],
        runs[0][1],
        json.loads((tmp / "out" / "gpu_pipeline_more.json").read_text()),
    )


def test_every_stage_ran_through_the_components(quick_run: tuple[dict, list[str], str, dict]) -> None:
    r, _, log, _ = quick_run
    assert r["status"] == "complete", log
    assert list(r["stages"]) == ["build", "regenerate", "extract", "train", "evaluate"]
    assert all(s["seconds"] >= 0 for s in r["stages"].values())
    assert {"device", "device_name", "torch", "date"} <= set(r["environment"])
    assert r["config"]["train"]["ray"]["num_workers"] == 0  # in-process: the device has no Ray
    st = {k: v["result"] for k, v in r["stages"].items()}
    assert st["regenerate"]["ok"] > 0 and st["train"]["steps"] == r["config"]["train"]["steps"]
    assert st["evaluate"]["identical"] is True and st["evaluate"]["n_samples"] == r["config"]["evaluate"]["limit"]
    s = r["summary"]
    assert 1.0 <= s["tau"] <= r["config"]["evaluate"]["spec"]["depth"] + 1 and s["speedup"] > 0


def test_more_reuses_the_stages_and_evaluates_a_tree_and_sampling(quick_run: tuple[dict, list[str], str, dict]) -> None:
    """The second device call: build, regeneration, extraction and training come from the first call's outputs;
    the tree is greedy (outputs identical to plain), sampling is not compared token for token."""
    first, more = quick_run[0], quick_run[3]
    assert more["status"] == "complete", quick_run[2]
    assert list(more["stages"]) == [
        "build",
        "regenerate",
        "extract",
        "train",
        "evaluate_tree",
        "evaluate_sampled",
        "batch",
    ]
    st = {k: v["result"] for k, v in more["stages"].items()}
    assert st["build"]["cached"] is True and st["regenerate"]["skipped"] == st["regenerate"]["total"]
    assert st["train"]["resumed_from_step"] == first["stages"]["train"]["result"]["steps"]
    limit = max(2, first["config"]["evaluate"]["limit"] // 2)
    assert st["evaluate_tree"]["identical"] is True and st["evaluate_tree"]["n_samples"] == limit
    assert st["evaluate_sampled"]["identical"] is None and st["evaluate_sampled"]["n_samples"] == limit
    assert all(more["summary"][n]["tau"] >= 1.0 for n in ("evaluate_tree", "evaluate_sampled"))
    batch = st["batch"]  # greedy chains at batch 1 and 4: every row equal to plain decoding's
    assert list(batch) == ["1", "4"] and all(b["mismatch_rows"] == 0 and b["ratio"] > 0 for b in batch.values())


def test_imports_stay_within_what_the_device_has(quick_run: tuple[dict, list[str], str, dict]) -> None:
    allowed = dependency_closure(DEVICE_PACKAGES) | {PROJECT}
    owners = metadata.packages_distributions()
    outside = {
        m: owners.get(m, ["?"])
        for m in quick_run[1]
        if not m.startswith(("__editable__", "_distutils_hack")) and not {_norm(d) for d in owners.get(m, [])} & allowed
    }
    assert not outside, f"bench/gpu_pipeline.py imported packages the device does not have: {outside}"
    assert not set(quick_run[1]) & set(ALWAYS_BLOCKED)
    assert {"torch", "transformers", "tokenizers"} <= set(quick_run[1])
