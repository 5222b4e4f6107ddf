"""Stage 5, register: heads (and targets) in the MLflow model registry, with lineage and a promotion gate.

Purpose:
- `register_target(store, name, target_dir, role, base_model)`: a target (the base or a fine-tune) as a version of
  registered model `name` (tag kind=causal-lm-target), with tags `weights_sha256`, `base_model`, `role`; once per
  weights hash.
- `register_head(store, cfg, head)`: the exported head directory (vLLM/SGLang format + probe) as a version of the
  registered model `<target>-v<version>-eagle3` (one per target fine-tune), tagged with the target's name,
  version and weights hash, the traffic hash, tau, speedup and whether greedy outputs were identical to the
  target's (`identical`; `identical_of` reads it back, None for sampled runs). Idempotent on `run_key`:
  re-registering a finished run returns the existing version (and sets the alias its gate chose, if a killed run
  never did: `finish_registration`); `registered_run(store, name, run_key)` is that one check, also made by the
  flow before any work. Promotion gate: alias `champion` moves to the new version only if
  tau >= `cfg.tau_floor` and tau >= the current champion's tau measured on the same held-out traffic in the same
  run (`head.champion_tau`); otherwise the version becomes `challenger`. Which τ decides is the run's `TargetRuntime`
  (`cfg.gate_tau`, or `target.runtime: vllm`): "local" (this project's decoding) or "engine" (vLLM's counters, the
  champion served on the same prompts: `head.champion_tau_engine`); both are tagged either way (`tau`,
  `tau_vllm`), and `gate_tau` says which decided.
  Then the served-speedup gate (`cfg.gate_speedup`, "served" by default): a head whose speedup at batch 1 is
  not surely above 1 (the low end of its interval is <= 1) is not made champion, the first head of a target included:
  the head a user would serve must pay. The figure judged (`SPEEDUP_FIGURES`): a retrain on served traffic's shadow
  test figure on the held-out captured requests (what is served now), else vLLM's, else ours. Where no speedup was
  measured the reason says so and the τ gate alone decides ("off": never judged on speed).
  The training step exported (best held-out τ, or the last) is tagged too: `checkpoint_step`, `checkpoint_rule`,
  `heldout_tau`, `heldout_tau_last`.
  Last, a gate decided before registration (`head.extra_gate`: the shadow test of a retrain on served traffic,
  components/evaluate/shadow.py) can keep the alias where it is; its reason joins the gate's, its figures come as
  `notes`.
- `check_head_name(store, target)`: refuses, before any work, a head name taken by a model that is not a head.
Not here: measuring tau (components/evaluate/stage.py); connecting to MLflow (infra/mlflow_store.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.targets.runtime import GATE_TAUS, TargetRuntime
from eagle.config_checks import at_least, finite, one_of
from infra.mlflow_store import CHALLENGER, CHAMPION, MlflowStore, ModelVersionRef

TARGET_KIND = "causal-lm-target"
PROMOTED_TAG = "promoted"  # the gate's decision, so a registration cut short can be finished


@dataclass(frozen=True)
class RegisterConfig:
    tau_floor: float = 1.2
    experiment_suffix: str = "-eagle3"
    gate_tau: str = "local"  # "engine": the gate decides on vLLM's τ (needs evaluate.engine "vllm")
    # also gate on throughput under load: at this concurrency (the users' typical load; 0: no such gate) the served
    # head (with its K schedule) must give at least `gate_min_speedup` x plain's output tokens/s (evaluate.load)
    gate_concurrency: int = 0
    gate_min_speedup: float = 1.0
    # "served": promote only a head whose batch-1 speedup interval lies wholly above 1 (vLLM's figure, else ours)
    gate_speedup: str = "served"

    def __post_init__(self) -> None:
        one_of(self, "gate_tau", GATE_TAUS)
        one_of(self, "gate_speedup", ("served", "off"))
        finite(self, "tau_floor", lambda x: x >= 0, ">= 0")
        at_least(self, {"gate_concurrency": 0})
        finite(self, "gate_min_speedup", lambda x: x > 0, "> 0")


@dataclass(frozen=True)
class TargetRef:
    name: str
    version: int
    weights_sha256: str
    path: str


@dataclass(frozen=True)
class HeadToRegister:
    head_dir: str
    target: TargetRef
    traffic_sha256: str
    run_key: str
    run_id: str  # the pipeline's MLflow run; the head is logged and registered from it
    metrics: dict[str, float]  # tau and speedup (ours), or tau_vllm (the engine alone: target.runtime vllm)
    champion_tau: float | None  # the current champion's tau on the same traffic, same run (None: no champion)
    evaluation_dir: str | None = None
    params: dict[str, Any] | None = None
    init_from: str | None = None  # the head a warm-started run began from (models:/name/version)
    champion_tau_engine: float | None = None  # the champion's τ in vLLM on the same prompts (gate_tau "engine")
    checkpoint: dict[str, Any] | None = None  # which training step was exported and why (TrainResult's choice)
    notes: dict[str, str] | None = None  # free-text tags, e.g. `speedup_note`: why a speedup is unreliable
    # a gate decided before registration (components/evaluate/shadow.py): (ok, why)
    extra_gate: tuple[bool, str] | None = None


@dataclass(frozen=True)
class RegisterResult:
    model_name: str
    version: int
    uri: str
    alias: str
    promoted: bool
    reason: str
    run_id: str


def head_model_name(target: TargetRef, suffix: str = "-eagle3") -> str:
    return f"{target.name}-v{target.version}{suffix}"


def register_target(
    store: MlflowStore,
    name: str,
    target_dir: str,
    role: str,
    base_model: str,
    weights_sha256: str,
    extra_tags: dict[str, str] | None = None,
) -> TargetRef:
    """Register a target directory as a version of `name`; the same weights are registered once.

    `extra_tags` may name the version's traffic (`traffic_train`, `traffic_heldout`): the scheduled retrain and
    the new-fine-tune trigger read them to know what to train and evaluate its head on.
    """
    store.ensure_model(name, kind=TARGET_KIND)
    existing = store.find_versions(name, weights_sha256=weights_sha256)
    if existing:
        return TargetRef(name, existing[0].version, weights_sha256, target_dir)
    with store.run(f"register-target-{name}-{role}", tags={"role": role}) as run_id:
        store.log_dir(run_id, Path(target_dir), "target")
        mv = store.register(
            name,
            run_id,
            "target",
            run_key=f"target:{weights_sha256}",
            kind=TARGET_KIND,
            tags={"weights_sha256": weights_sha256, "base_model": base_model, "role": role, **(extra_tags or {})},
        )
    return TargetRef(name, mv.version, weights_sha256, target_dir)


def check_head_name(store: MlflowStore, target: TargetRef, cfg: RegisterConfig | None = None) -> str:
    """The head model's name for `target`; `RegistryCollision` now (not after training) if a non-head holds it."""
    from infra.mlflow_store import HEAD_KIND

    name = head_model_name(target, (cfg or RegisterConfig()).experiment_suffix)
    store.check_kind(name, HEAD_KIND)
    return name


def _gate(cfg: RegisterConfig, tau: float, champion_tau: float | None) -> tuple[bool, str]:
    if tau < cfg.tau_floor:
        return False, f"tau {tau:.3f} < floor {cfg.tau_floor}"
    if champion_tau is not None and tau < champion_tau:
        return False, f"tau {tau:.3f} < champion's {champion_tau:.3f} on the same traffic"
    if champion_tau is None:
        return True, f"tau {tau:.3f} >= floor {cfg.tau_floor}; no champion yet"
    return True, f"tau {tau:.3f} >= floor {cfg.tau_floor} and >= champion's {champion_tau:.3f}"


def _load_gate(cfg: RegisterConfig, metrics: dict[str, float], promoted: bool, reason: str) -> tuple[bool, str]:
    """The τ gate's verdict, and the throughput gate at `cfg.gate_concurrency` (`speedup_at_<c>` of the sweep)."""
    c, key = cfg.gate_concurrency, f"speedup_at_{cfg.gate_concurrency}"
    if key not in metrics:
        raise ValueError(
            f"register.gate_concurrency is {c} but the load sweep did not measure concurrency {c}: add "
            f"it to evaluate.load.concurrency (with evaluate.engine 'vllm')"
        )
    x = float(metrics[key])
    if x < cfg.gate_min_speedup:
        return False, f"{reason}; but at concurrency {c} it serves {x:.2f}x plain < {cfg.gate_min_speedup}"
    return promoted, f"{reason}; at concurrency {c} it serves {x:.2f}x plain >= {cfg.gate_min_speedup}"


# the figure the served-speedup gate judges: the first measured of these. A retrain on served traffic judges its
# shadow test's (the held-out captured requests: what is served now) before the engine evaluation's on the registered
# held-out traffic; else vLLM's figure, else ours
SPEEDUP_FIGURES = (
    ("speedup_shadow", "served in vLLM on the held-out captured requests (shadow test)"),
    ("speedup_vllm", "served in vLLM"),
    ("speedup", "in our decoder"),
)


def _speedup_gate(metrics: dict[str, float], promoted: bool, reason: str) -> tuple[bool, str]:
    """The τ gate's verdict, and whether the head pays at batch 1: the low end of its speedup interval above 1 (the
    first of `SPEEDUP_FIGURES` measured: the shadow test's, vLLM's, ours; a figure without interval stands for both
    ends)."""
    for key, who in SPEEDUP_FIGURES:
        x = metrics.get(key)
        if x is None or x != x:  # not measured, or untimed (nan)
            continue
        lo, hi = metrics.get(f"{key}_lo", x), metrics.get(f"{key}_hi", x)
        figure = f"{who} {x:.2f}x plain at batch 1 [{lo:.2f}, {hi:.2f}]"
        if lo <= 1.0:
            return False, f"{reason}; but {figure} is not surely above 1: a user serving it would not gain"
        return promoted, f"{reason}; {figure}"
    return promoted, f"{reason}; speedup not measured (the served-speedup gate could not judge)"


def _gate_inputs(runtime: TargetRuntime, head: HeadToRegister) -> tuple[float, float | None]:
    """(the head's τ, the champion's τ) the gate compares: ours, or vLLM's on the same prompts."""
    if not runtime.gate_on_engine:
        return float(head.metrics["tau"]), head.champion_tau
    if "tau_vllm" not in head.metrics:
        raise ValueError(
            "register.gate_tau is 'engine' but the head was not measured in vLLM: set evaluate.engine to 'vllm'"
        )
    return float(head.metrics["tau_vllm"]), head.champion_tau_engine


def finish_registration(store: MlflowStore, name: str, version: int) -> ModelVersionRef:
    """The version, with the alias its gate decided set if a killed run created it but never moved the alias.

    The gate's decision is the version's `promoted` tag. The alias moves only forward: a newer version that holds
    it (a later run) keeps it. Versions with an alias, or superseded ones, are returned unchanged.
    """
    v = store.get_version(name, version)
    if CHAMPION in v.aliases or CHALLENGER in v.aliases or PROMOTED_TAG not in v.tags:
        return v
    alias = CHAMPION if v.tags[PROMOTED_TAG] == "true" else CHALLENGER
    current = store.get_alias(name, alias)
    if current is None or current.version < v.version:
        store.set_alias(name, alias, v.version)
        v = store.get_version(name, version)
    return v


def _alphas(metrics: dict[str, float], prefix: str) -> list[float]:
    keys = [k for k in metrics if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return [metrics[k] for k in sorted(keys, key=lambda k: int(k[len(prefix) :]))]


def _by_position(metrics: dict[str, float], prefix: str) -> list[tuple[int, int, float]]:
    """(lo, hi, value) of the `<prefix><lo>_<hi>` metrics, by lo."""
    out = []
    for k, v in metrics.items():
        lo, _, hi = k[len(prefix) :].partition("_") if k.startswith(prefix) else ("", "", "")
        if lo.isdigit() and hi.isdigit():
            out.append((int(lo), int(hi), v))
    return sorted(out)


def _acceptance_tags(metrics: dict[str, float]) -> dict[str, str]:
    """Per-position acceptance (alpha_1..alpha_k) and `identical` ("true"/"false"; absent when sampling: outputs
    are not comparable) as measured here, `tau_raw` (what the rule accepted, also past EOS: an engine's counting),
    and the engine's figures when it measured them (`tau_vllm`,
    `speedup_vllm`, `identical_vllm`, `acceptance_vllm`); `tau_by_position` (and `_vllm`): tau per non-empty
    output-position bucket, "0-128:2.8100 128-512:2.5012" (from the `tau_pos_<lo>_<hi>` metrics)."""
    tags = {}
    for name, prefix in (("tau_by_position", "tau_pos_"), ("tau_by_position_vllm", "tau_vllm_pos_")):
        if buckets := _by_position(metrics, prefix):
            tags[name] = " ".join(f"{lo}-{hi}:{float(v):.4f}" for lo, hi, v in buckets)
    for name, prefix in (
        ("acceptance", "alpha_"),
        ("acceptance_raw", "alpha_raw_"),
        ("acceptance_vllm", "alpha_vllm_"),
    ):
        if alphas := _alphas(metrics, prefix):
            tags[name] = " ".join(f"{a:.4f}" for a in alphas)
    for k in ("tau_raw", "tau_vllm"):
        if k in metrics:
            tags[k] = f"{float(metrics[k]):.4f}"
    for k in ("speedup", "speedup_vllm"):
        if k in metrics:
            tags.update(speedup_tags(metrics, k))
    for k in ("identical", "identical_vllm"):
        if k in metrics:
            tags[k] = "true" if metrics[k] else "false"
    if "engine_compiled" in metrics:  # how vLLM ran where it was measured (evaluate.compiled): `serve` runs it so
        tags["compiled"] = "true" if metrics["engine_compiled"] else "false"
    if "picked_depth" in metrics:  # the K measured best at batch size 1 (evaluate.pick): evaluated and served at it
        tags["depth"] = str(int(metrics["picked_depth"]))
        if "picked_depth_speedup" in metrics:
            tags["depth_pick_speedup"] = f"{float(metrics['picked_depth_speedup']):.4f}"
    return tags


def speedup_tags(metrics: dict[str, float], key: str) -> dict[str, str]:
    """`<key>` (the median of the evaluation's rounds, or "unreliable" when its rounds disagreed, the machine was busy,
    or too few fitted in the time budget: then `<key>_median` keeps the number for reference), `<key>_lo`/`<key>_hi`
    (the median's interval) and `<key>_rounds`, from the metrics of components/evaluate/speed.py."""
    tags = {}
    reliable = bool(metrics.get(f"{key}_reliable", 1.0))
    tags[key] = f"{float(metrics[key]):.4f}" if reliable else "unreliable"
    if not reliable:
        tags[f"{key}_median"] = f"{float(metrics[key]):.4f}"
    for part in ("lo", "hi"):
        if f"{key}_{part}" in metrics:
            tags[f"{key}_{part}"] = f"{float(metrics[f'{key}_{part}']):.4f}"
    if f"{key}_rounds" in metrics:
        tags[f"{key}_rounds"] = str(int(metrics[f"{key}_rounds"]))
    return tags


def tag_float(tags: dict[str, str], key: str) -> float | None:
    """A numeric tag as a float; None when absent or not a number (e.g. an "unreliable" speedup)."""
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None


def _checkpoint_tags(choice: dict[str, Any]) -> dict[str, str]:
    """The exported checkpoint: `checkpoint_step`, `checkpoint_rule` (the reason, e.g. "best held-out tau at step
    80 of 120 (3.12 vs last 3.05)"), `heldout_tau` (selected) and `heldout_tau_last`, when training chose one, and
    `heldout_tau_warm_start` (a warm-started head before its first step: the base head on its fine-tune's features)."""
    tags = {}
    if choice.get("selected_step"):
        tags["checkpoint_step"] = str(choice["selected_step"])
    if choice.get("selection_rule"):
        tags["checkpoint_rule"] = str(choice["selection_rule"])
    for tag, key in (
        ("heldout_tau", "selected_heldout_tau"),
        ("heldout_tau_last", "last_heldout_tau"),
        ("heldout_tau_warm_start", "warm_start_heldout_tau"),
    ):
        if choice.get(key) is not None:
            tags[tag] = f"{float(choice[key]):.4f}"
    return tags


def identical_of(version: ModelVersionRef) -> bool | None:
    """The `identical` tag of a registered head: True/False, None when absent (a sampled evaluation)."""
    return {"true": True, "false": False}.get(version.tags.get("identical", ""))


@dataclass(frozen=True)
class RegisteredRun:
    """The head version a run key already registered (its tags hold the run's figures) and the alias it holds:
    "champion", "challenger" or "none" (superseded)."""

    version: ModelVersionRef
    alias: str

    @property
    def uri(self) -> str:
        return self.version.uri

    def result(self) -> RegisterResult:
        v = self.version
        return RegisterResult(
            v.name,
            v.version,
            v.uri,
            self.alias,
            self.alias == CHAMPION,
            "already registered for this run key",
            v.run_id or "",
        )


def registered_run(store: MlflowStore, name: str, run_key: str) -> RegisteredRun | None:
    """The version of head model `name` registered for `run_key` (None: not registered yet), with the alias its
    gate chose set if a killed run never set it (`finish_registration`)."""
    existing = store.find_versions(name, run_key=run_key)
    if not existing:
        return None
    v = finish_registration(store, name, existing[0].version)
    alias = next((a for a in (CHAMPION, CHALLENGER) if a in v.aliases), "none")
    return RegisteredRun(v, alias)


def register_head(
    store: MlflowStore, cfg: RegisterConfig, head: HeadToRegister, runtime: TargetRuntime | None = None
) -> RegisterResult:
    """Register the head (once per run key) and move the alias its gate decides; the gate's τ is the engine's where
    `runtime` (components/targets/runtime.py; None: the one `cfg` alone says) gates on it."""
    runtime = runtime or TargetRuntime.from_sections(register=cfg)
    name = head_model_name(head.target, cfg.experiment_suffix)
    store.ensure_model(name)
    if (done := registered_run(store, name, head.run_key)) is not None:
        return done.result()
    tau = head.metrics.get("tau")  # ours; None when only the engine measured the head (target.runtime vllm)
    gate_tau, champion_tau = _gate_inputs(runtime, head)
    champion = store.get_alias(name, CHAMPION)
    if champion_tau is None and champion is not None:
        raise ValueError(
            f"{name} has a champion (version {champion.version}) but no champion τ was given for the "
            f"{runtime.gate_tau} gate: evaluate the champion on the same held-out traffic"
        )
    promoted, reason = _gate(cfg, gate_tau, champion_tau)
    if runtime.gate_on_engine:
        reason = f"vLLM {reason}" + (f" (local tau {tau:.3f})" if tau is not None else " (no local evaluation)")
    if cfg.gate_concurrency:
        promoted, reason = _load_gate(cfg, head.metrics, promoted, reason)
    if cfg.gate_speedup == "served":
        promoted, reason = _speedup_gate(head.metrics, promoted, reason)
    if head.extra_gate is not None:
        promoted, reason = promoted and head.extra_gate[0], f"{reason}; {head.extra_gate[1]}"
    tags = {
        "target_name": head.target.name,
        "target_version": str(head.target.version),
        "target_weights_sha256": head.target.weights_sha256,
        "traffic_sha256": head.traffic_sha256,
        "gate": reason,
        "gate_tau": runtime.gate_tau,
        PROMOTED_TAG: str(promoted).lower(),
        **({"tau": f"{tau:.4f}"} if tau is not None else {}),
    }
    if head.init_from:
        tags["init_from"] = head.init_from
    tags.update(_acceptance_tags(head.metrics))
    tags.update(_checkpoint_tags(head.checkpoint or {}))
    tags.update({k: v for k, v in (head.notes or {}).items() if v})
    run_id = head.run_id
    store.log_params(
        run_id,
        {
            "target": f"{head.target.name}/{head.target.version}",
            **{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in (head.params or {}).items()},
        },
    )
    store.log_metrics(run_id, head.metrics)
    if head.evaluation_dir:
        store.log_dir(run_id, Path(head.evaluation_dir), "evaluation")
    store.log_dir(run_id, Path(head.head_dir), "head")
    mv = store.register(name, run_id, "head", run_key=head.run_key, tags=tags)
    if promoted:
        store.set_alias(name, CHAMPION, mv.version)
        alias = CHAMPION
    else:
        store.set_alias(name, CHALLENGER, mv.version)
        alias = CHALLENGER
    return RegisterResult(name, mv.version, f"models:/{name}/{mv.version}", alias, promoted, reason, run_id)
