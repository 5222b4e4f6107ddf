"""The offline reference of one serving-loop cycle: a fresh head trained on the cycle's captured shifted traffic.

Purpose: issue 48's goal compares the τ one cycle reaches with what a head trained offline on the same shifted traffic
reaches. After bench/serving_loop.py's cycle (serve stopped), `offline_plan` copies the retrain's capture plan
with the registered share cut to 1 conversation (a plan needs at least one: `regenerate.limit` >= 1; the captured
conversations and the held-out requests are the retrain's own), and `run_offline` trains a head on it through
`train-head` with `train.warm_start` off, so the head starts fresh and gets the preset's full `train.steps` (the
retrain: warm-started, `train.warm_start_steps`). Its shadow test runs against the champion, which `run_offline`
points at the retrained head first, so both heads are measured by the same vLLM on the same held-out captured
requests that neither was trained on (`shadow_tau` and `shadow_champion_tau`, served speedups with intervals). Then
the alias goes back to where the cycle left it. `summary` returns what serving_loop.json keeps:
- `retrained_over_offline`: the retrained head's shadow τ over the offline head's (the like-for-like ratio);
- `live_over_offline`: the live τ after the swap (vLLM's counters on fresh shifted traffic) over the offline head's
  shadow τ (different prompts: the goal's literal wording).
Run: `python bench/serving_loop.py` (on by default; `--no-offline` skips it). The child is `--child offline`.
Not here: the cycle itself (bench/serving_loop.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

OFFLINE_REGISTERED = 1  # the registered conversations of the offline plan: the fewest a plan may hold


def offline_plan(plan_path: str | Path, out_dir: Path) -> Path:
    """A copy of the retrain's plan (`plan.json`) that trains on its captured conversations and one registered
    conversation; its own `sha256`, so the run key is its own. Returns the copy's path."""
    plan = json.loads(Path(plan_path).read_text())
    captured = int(plan["captured"])
    plan |= {
        "registered": OFFLINE_REGISTERED,
        "mix": round(captured / (captured + OFFLINE_REGISTERED), 4),
        "sha256": hashlib.sha256(f"{plan['sha256']}:offline:{OFFLINE_REGISTERED}".encode()).hexdigest(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "plan.json"
    out.write_text(json.dumps(plan, indent=2) + "\n")
    return out


def offline_config(config: dict, out: Path) -> Path:
    """The cycle's pipeline config with warm start off (a fresh head, the preset's full `train.steps`)."""
    train = {**config.get("train", {}), "warm_start": False}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**config, "train": train}, indent=1) + "\n")
    return out


def child(p: dict) -> dict:
    """`--child offline`: train-head on the offline plan; the registered head's shadow tags."""
    from flows.on_new_finetune import version_traffic
    from flows.train_head import train_head
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    store = MlflowStore.connect(Settings.from_env())
    traffic, heldout = version_traffic(store, p["name"], int(p["version"]))
    run = train_head(
        f"models:/{p['name']}/{p['version']}", traffic, heldout, p["preset"], p["config"], capture_plan=p["plan"]
    )
    out = {"head_uri": run.head_uri, "alias": run.alias, "gate": run.gate, "tau": run.tau, "tau_vllm": run.tau_vllm}
    if run.head_uri:
        name, version = run.head_uri.removeprefix("models:/").split("/")
        tags = store.get_version(name, int(version)).tags
        out["tags"] = {k: v for k, v in tags.items() if k.startswith(("shadow", "init_from", "capture_"))}
    return out


def run_offline(run_child, store, p: dict, retrained_uri: str) -> dict:
    """Points the champion alias at `retrained_uri`, runs the offline child, puts the alias back; the child's result.
    `p`: name, version, preset, config (the offline config) and plan (the offline plan)."""
    head_name, retrained = retrained_uri.removeprefix("models:/").split("/")
    before = store.get_alias(head_name, "champion")
    store.set_alias(head_name, "champion", int(retrained))
    try:
        return run_child("offline", p)
    finally:
        if before is not None:
            store.set_alias(head_name, "champion", int(before.version))


def reference(run_child, store, work: Path, sizes, target: tuple[str, int], retrain: dict, spans: dict) -> dict:
    """The offline head of one cycle and its summary (`target`: the served target's name and version; `retrain`: the
    retrain child's result, with its plan and head); {"error": ...} when it failed (the cycle's figures stay)."""
    try:
        p = {
            "name": target[0],
            "version": int(target[1]),
            "preset": sizes.preset,
            "config": str(offline_config(sizes.config, work / "pipeline.json")),
            "plan": str(offline_plan(retrain["plan"], work / "plan")),
        }
        return summary(run_offline(run_child, store, p, retrain["head_uri"]), spans["after_swap"]["tau"])
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _num(tags: dict, key: str) -> float | None:
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None


def summary(result: dict, live_after_swap: float | None) -> dict:
    """The offline comparison serving_loop.json keeps (see the module doc)."""
    tags = result.get("tags", {})
    offline, retrained = _num(tags, "shadow_tau"), _num(tags, "shadow_champion_tau")
    return {
        "head_uri": result.get("head_uri"),
        "offline_shadow_tau": offline,
        "retrained_shadow_tau": retrained,
        "retrained_over_offline": round(retrained / offline, 3) if offline and retrained else None,
        "live_after_swap_tau": live_after_swap,
        "live_over_offline": round(live_after_swap / offline, 3) if offline and live_after_swap else None,
        "shadow_prompts": tags.get("shadow_prompts"),
        "offline_speedup": tags.get("shadow_speedup"),
        "retrained_speedup": tags.get("shadow_champion_speedup"),
        "tags": tags,
    }


def line(s: dict) -> str:
    """One printed line: both ratios against the goal (>= 0.95)."""
    if s.get("offline_shadow_tau") is None:
        return f"offline head: no shadow figures ({s.get('head_uri')})"
    parts = [
        f"offline head {s['head_uri']}: shadow tau {s['offline_shadow_tau']:.2f} on {s['shadow_prompts']} held-out "
        f"captured prompts; the retrained head {s['retrained_shadow_tau']:.2f} on the same "
        f"({s['retrained_over_offline']:.2f}x offline)"
    ]
    if s.get("live_over_offline") is not None:
        parts.append(f"live tau after the swap {s['live_after_swap_tau']:.2f} ({s['live_over_offline']:.2f}x offline)")
    return "; ".join(parts) + " (goal >= 0.95x)"
