"""Two pipelines on one machine, each on its own local Ray: neither finds the other's Ray nor prints its errors.

Purpose: two tiny Ray Train runs at once, in two processes that each start a local Ray through
`infra.ray_cluster.ray_session` (one worker, 1 CPU, 4 steps on shared features). Each waits until both Rays are up
before it trains, so the runs overlap while two Ray instances live on the machine: the case where Ray Train's
placement-group cleaner, asking Ray's State API about its controller without an address, auto-detected "the" Ray,
found both, and printed `ConnectionError: Found multiple active Ray instances` with its traceback into the run's
output. Both runs must export a head, and neither's stdout or stderr may show that error, the cleaner, RAY_ADDRESS
or any traceback.
Run: `python -m pytest tests/test_ray_side_by_side.py` (about 1.5 min on 2 busy cores; marked live: it starts two
Rays).
Not here: a Ray cluster at RAY_ADDRESS (tests/test_ray_multinode.py), training results (tests/test_extract_train.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

# One run: start a local Ray, say so, wait for the other's, train, print the head's path.
RUN = textwrap.dedent("""
    import dataclasses, sys, time
    from pathlib import Path
    from components.train.stage import RayConfig, TrainConfig, TrainSetup, train
    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    extract_dir, work, me, other = sys.argv[1:]
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=4, checkpoint_every=2, eval_every=2, batch_size=2,
                              ray=RayConfig(num_workers=1, cpus_per_worker=1, max_failures=0))
    settings = Settings.local(Path(work) / me / ".eagle", ray_auth_mode="disabled")
    with ray_session(settings, num_cpus=1):
        (Path(work) / f"{me}.up").write_text("")
        deadline = time.monotonic() + 120
        while not (Path(work) / f"{other}.up").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        res = train(cfg, extract_dir, str(Path(work) / me / "train"),
                    setup=TrainSetup(storage_dir=str(settings.ray_storage_dir)))
    print("HEAD", res.head_dir)
""")

FOREIGN = ("multiple active Ray instances", "PlacementGroupCleaner", "Traceback", "RAY_ADDRESS")


@pytest.fixture(scope="module")
def features(tiny_embedded, tmp_path_factory) -> str:
    """Offline features of a few regenerated conversations of the tiny embedded default (~5 s)."""
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate

    root = tmp_path_factory.mktemp("side-by-side")
    quiet = dict(progress=lambda s: None)
    regenerate(
        RegenerateConfig(max_new_tokens=16, batch_size=8, shard_size=8, limit=8, seed=0),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(root / "regen"),
        **quiet,
    )
    extract(
        ExtractConfig(max_len=160, dtype="float32", seqs_per_shard=8),
        tiny_embedded.target_dir,
        str(root / "regen"),
        str(root / "extract"),
        **quiet,
    )
    return str(root / "extract")


def test_two_local_rays_side_by_side_each_keep_to_their_own(features, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    root = Path(__file__).resolve().parents[1]
    runs = {
        me: subprocess.Popen(
            [sys.executable, "-c", RUN, features, str(tmp_path), me, other],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, other in (("a", "b"), ("b", "a"))
    }
    outputs = {me: p.communicate(timeout=300) for me, p in runs.items()}
    for me, (out, err) in outputs.items():
        assert runs[me].returncode == 0, f"run {me} failed:\n{out}\n{err}"
        head = Path(out.split("HEAD ")[-1].strip())
        assert head == tmp_path / me / "train" / "head" and (head / "config.json").is_file(), out
        shown = [word for word in FOREIGN if word in out + err]
        assert not shown, f"run {me} printed {shown}:\n{out}\n{err}"
