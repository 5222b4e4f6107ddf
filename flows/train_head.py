"""Flow `train-head`: one target version -> one registered, evaluated EAGLE-3 head.

Purpose: resolve the target (a Hugging Face directory, registered on the fly, or `models:/name/version`),
then regenerate -> extract -> train (Ray) -> evaluate (against the current champion, same traffic, same run)
-> register with the promotion gate. A fine-tune's head (the target version's `base_model` tag names its base)
warm-starts from the base target's champion head when there is one (`train.warm_start`, with
`train.warm_start_steps` steps). A run's identity (`run_key`) is the hash of the target's weights, the
traffic files and the config: its work directory is `<state>/runs/<target>-v<version>/<run_key[:12]>`, so a
re-run after a crash resumes there (stages cached by Prefect, shards and checkpoints resumed by the components)
and a re-run of a finished run registers nothing new (a run killed mid-registration is finished: its alias is
set). One run per target at a time (a lock under the state dir); registering a target directory is locked too,
so two runs started at once for a new target register it once. Inputs (traffic files, target directory, config,
head model name, Ray address) are checked before anything is written (`check_inputs`; once: the CLI's `train`
checked them in its preflight and hands the flow its config and inputs, `CheckedInputs`). A stage that refuses its
input later (`BadInput`, e.g. every second turn too long for the context) before any stage finished takes back
what this run made (`forget_refused_run`): its run directory, and the target version if this run registered it;
with a finished stage both stay, for the re-run to resume. The flow returns a `HeadRun` (its `asdict` is the run's
`summary.json`).
With `train.variants` (two or more head variants), train -> evaluate runs once per variant on the same features
(`train-<variant>/`, `evaluate-<variant>/` in the work directory) and the variant with the best served speedup is
registered (components/registry/variant_choice.py: vLLM's when measured, ties to the simpler), every variant's figures
as tags on that version (`variant_<v>_...`, `variant_choice`); the gate judges the chosen head as it would a lone one.
Where each stage runs the target is the config's `runtime` (components/targets/runtime.py), handed to the stages.
With `target.runtime: vllm` the target is never loaded here: regeneration, extraction and evaluation are vLLMs the
stages start (every one with `target`'s scale settings, which `runtime.engine_settings` puts in
`Settings.engine_scale`), the local evaluation is skipped and the gate decides on vLLM's τ (the HeadRun's own
`tau`/`speedup` are nan, its `vllm` holds the figures).
With `capture_plan` (a retrain on served traffic, flows/retrain_capture.py: components/data/captured_traffic.py) the run
trains on the captured conversations as they were served beside the registered traffic's share it regenerates,
warm-starts from the target's own champion, tags the plan's lineage, and, when a champion exists, runs the shadow
test (components/evaluate/shadow.py) before registering: an extra gate on the alias.
Run: `eagle-heads train --target DIR|models:/name/version --traffic FILE --heldout FILE`, or as a deployment
(prefect.yaml). The run resolved before its stages (target version, warm-start head, run key): flows/run_spec.py.
Not here: any algorithm; see components/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config.pipeline import PipelineConfig
from components.data.atomic import atomic_write_text
from components.data.captured_traffic import CapturePlan
from components.data.traffic_io import traffic_sha256
from components.evaluate.engine import EngineEvalResult
from components.evaluate.shadow import shadow_test
from components.evaluate.stage import HeadEval
from components.extract.stage import ExtractResult
from components.regenerate.reuse import earlier, mark, source_key
from components.regenerate.stage import RegenerateResult, link_twins
from components.registry.register import (
    HeadToRegister,
    RegisteredRun,
    RegisterResult,
    TargetRef,
    check_head_name,
    head_model_name,
    identical_of,
    register_head,
    registered_run,
    tag_float,
)
from components.registry.variant_choice import VariantSink, choose_variant, variant_tags
from components.targets.gguf import default_target_name, materialize_target
from components.targets.runtime import TargetRuntime
from components.train.stage import CHOICE_KEYS, TrainResult
from eagle.errors import BadInput
from flows.evaluate_head import EvalPlan, Figures, evaluate_head
from flows.preflight import check_inputs
from flows.run_spec import ParentHead, RunSpec, parent_head, resolve_target, run_key_of
from flows.tasks import TASKS, TrainJob, extract_task, fresh_if_missing, regenerate_task, train_task, transient
from infra.locks import target_lock
from infra.metrics_sink import MlflowSink
from infra.mlflow_health import store_errors
from infra.mlflow_store import CHAMPION, MlflowStore
from infra.settings import Settings


@dataclass(frozen=True)
class HeadRun:
    """What one `train-head` run produced (or, `created` False, what its run key had already registered: the
    figures read back from the version's tags, no stage results). `asdict` of it is the run's `summary.json`."""

    head_uri: str
    alias: str  # "champion", "challenger" or "none"
    promoted: bool
    gate: str  # the gate's reason
    tau: float  # tokens emitted per verification step (this project's decoder; nan with target.runtime vllm)
    tau_raw: float | None  # what the rule accepted per step, also past EOS: comparable with vLLM's counters
    tau_vllm: float | None  # None: not measured in vLLM
    speedup: float  # the median of the local evaluation's rounds (nan with target.runtime vllm: see `vllm`)
    speedup_vllm: float | None  # the same in vLLM, what a user serving the head gets (None: not measured)
    identical: bool | None  # None when sampling: outputs not comparable
    acceptance: list[float]
    per_segment: dict[str, dict[str, float]] | None
    vllm: EngineEvalResult | None
    train: TrainResult | None
    regenerate: RegenerateResult | None
    extract: ExtractResult | None
    created: bool  # False: the run key was already registered, nothing was done
    work_dir: str
    init_from: str | None  # the head a warm-started run began from
    speedup_note: str = ""  # why the local speedup is unreliable ("" when it is reliable)
    crossover: int | None = None  # first concurrency where plain decoding wins in vLLM (None: not measured/none)
    k_schedule: list[list[int]] | None = None  # vLLM's num_speculative_tokens_per_batch_size from the load sweep
    variant_choice: str = ""  # why this variant was registered, when `train.variants` listed several ("": one)

    @classmethod
    def from_registered(cls, done: RegisteredRun, work: Path) -> HeadRun:
        """The result of a run whose key is already registered: the figures from the version's tags."""
        v, reg = done.version, done.result()
        return cls(
            head_uri=reg.uri,
            alias=reg.alias,
            promoted=reg.promoted,
            gate=reg.reason,
            tau=float(v.tags.get("tau", "nan")),
            tau_raw=float(v.tags["tau_raw"]) if "tau_raw" in v.tags else None,
            tau_vllm=float(v.tags["tau_vllm"]) if "tau_vllm" in v.tags else None,
            speedup=tag_float(v.tags, "speedup") or tag_float(v.tags, "speedup_median") or float("nan"),
            speedup_vllm=tag_float(v.tags, "speedup_vllm"),
            identical=identical_of(v),
            acceptance=[float(a) for a in v.tags.get("acceptance", "").split()],
            per_segment=None,
            vllm=None,
            train=None,
            regenerate=None,
            extract=None,
            created=False,
            work_dir=str(work),
            init_from=v.tags.get("init_from"),
            speedup_note=v.tags.get("speedup_note", ""),
            crossover=int(v.tags["crossover"]) if v.tags.get("crossover", "none").isdigit() else None,
            k_schedule=json.loads(v.tags["k_schedule"]) if "k_schedule" in v.tags else None,
            variant_choice=v.tags.get("variant_choice", ""),
        )


@task(name="register", retries=2, retry_delay_seconds=3, retry_condition_fn=transient)
def register_task(
    settings: Settings, cfg, head: HeadToRegister, runtime: TargetRuntime | None = None
) -> RegisterResult:
    """`runtime` (the run's components.targets.runtime.TargetRuntime) says whose τ the gate decides on."""
    with store_errors(settings, f"registering the head of run {head.run_key[:12]}"):
        return register_head(MlflowStore.connect(settings), cfg, head, runtime)


shadow_task = task(name="shadow", cache_policy=NO_CACHE, retries=1, retry_condition_fn=transient)(shadow_test)


class CheckedInputs:
    """The CLI's `train` hands the flow what its preflight resolved and checked (flows/preflight.py `check_train`):
    the config, and the target and traffic files `check_inputs` passed with it; the flow then resolves and checks them
    once, not twice. A plain class, not a dataclass: Prefect accepts only an instance for this parameter, so a
    deployment's JSON parameters cannot skip the checks."""

    __slots__ = ("config", "inputs")

    def __init__(self, config: PipelineConfig, target: str, traffic: str, heldout: str) -> None:
        self.config, self.inputs = config, (target, traffic, heldout)


@flow(name="train-head", log_prints=True)
def train_head(
    target: str,
    traffic: str,
    heldout: str,
    preset: str = "default",
    config_path: str | None = None,
    target_name: str | None = None,
    capture_plan: str | None = None,
    checked: CheckedInputs | None = None,
) -> HeadRun:
    """`checked`: the config `preset` and `config_path` resolve to, with these inputs already checked (the CLI's);
    None: the flow resolves and checks them itself (deployments, other flows)."""
    log = get_run_logger()
    plan = CapturePlan.read(capture_plan) if capture_plan else None
    cfg = checked.config if checked is not None else PipelineConfig.load(config_path, preset)
    cfg = plan.applied(cfg) if plan else cfg
    settings = cfg.runtime.engine_settings(Settings.from_env())  # the target's scale, for each vLLM of the run
    if checked is None or checked.inputs != (target, traffic, heldout):
        check_inputs(target, traffic, heldout, cfg, settings)
    gguf, target = target, materialize_target(target, settings.state_dir, log.info)  # a GGUF file: converted once
    if gguf != target:
        check_inputs(target, traffic, heldout, cfg, settings)  # the directory it became
        target_name = target_name or default_target_name(gguf)
    store = MlflowStore.connect(settings)
    tref, registered = resolve_target(store, target, target_name, settings)
    check_head_name(store, tref, cfg.register)  # a head name taken by another kind of model: refuse before the work
    parent = parent_head(store, tref, cfg, settings.trust_remote_code, own=plan is not None)
    if parent is not None:
        log.info(f"warm start from {parent.uri} (the base target's champion head)")
        if cfg.train.warm_start_steps:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=cfg.train.warm_start_steps))
    key = run_key_of(tref, traffic, heldout, cfg, parent, plan)
    work = settings.state_dir / "runs" / f"{tref.name}-v{tref.version}" / key[:12]
    made_work = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    log.info(f"target {tref.name} v{tref.version} ({tref.path}); run {key[:12]} in {work}")
    with target_lock(settings, f"{tref.name}-v{tref.version}"):
        try:
            return _run(cfg, settings, store, RunSpec(tref, key, work, traffic, heldout, parent, plan))
        except BadInput:
            if not _resumable(work):  # a refusal before any stage finished: take back what this run made
                try:
                    forget_refused_run(store, settings, tref if registered else None, work if made_work else None)
                except Exception as e:  # noqa: BLE001 (the refusal is the error to report)
                    log.warning(f"could not remove what the refused run made: {type(e).__name__}: {e}")
            raise


def _resumable(work: Path) -> bool:
    """Whether the run directory holds work a re-run would resume: a regenerated shard marked done (the first
    stage's; every later stage starts from it)."""
    return any((work / "regenerate").glob("shard-*.json"))


def forget_refused_run(store: MlflowStore, settings: Settings, tref: TargetRef | None, work: Path | None) -> None:
    """After a stage refused the run's input with nothing to resume: remove the run directory `work` (and its
    target's folder under `runs/` once empty), and the target version `tref` with its registration run's copy of
    the target (and the registered model, when that version was its only one). Only what the caller says this run
    made (None: keep); the refusal itself is the caller's to raise."""
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: another run's directory is there
            work.parent.rmdir()
        print(f"refused: removed this run's directory {work}")
    if tref is None:
        return
    version = store.get_version(tref.name, tref.version)
    store.client.delete_model_version(tref.name, str(tref.version))
    if version.run_id:  # the registration run holds a copy of the target's files
        artifacts = store.client.get_run(version.run_id).info.artifact_uri or ""
        store.client.delete_run(version.run_id)
        local = Path(urlsplit(artifacts).path).parent if artifacts.startswith("file:") else None
        if local is not None and local.name == version.run_id and local.is_relative_to(settings.state_dir):
            shutil.rmtree(local, ignore_errors=True)
    if not store.find_versions(tref.name):
        store.client.delete_registered_model(tref.name)
    print(f"refused: removed target version {tref.name}/{tref.version}, which this run registered")


def _run(cfg: PipelineConfig, settings: Settings, store: MlflowStore, run: RunSpec) -> HeadRun:
    tref, key, work, traffic, heldout, parent, plan = (
        run.tref,
        run.key,
        run.work,
        run.traffic,
        run.heldout,
        run.parent,
        run.plan,
    )
    name = head_model_name(tref, cfg.register.experiment_suffix)
    if (done := registered_run(store, name, key)) is not None:
        print(f"run {key[:12]} already registered as {done.uri}; nothing to do")
        return HeadRun.from_registered(done, work)
    regen_dir, ext_dir = str(work / "regenerate"), str(work / "extract")
    trust = settings.trust_remote_code
    regen_step = fresh_if_missing(regenerate_task, regen_dir)
    answers = source_key(tref.weights_sha256, traffic_sha256(traffic), cfg.regenerate_fingerprint())
    link_twins(cfg.regenerate, traffic, regen_dir, earlier(regen_dir, answers, work.parent))  # another run's answers
    regen = regen_step(cfg.regenerate, tref.path, traffic, regen_dir, trust, ray_settings=settings, runtime=cfg.runtime)
    mark(regen_dir, answers)
    print(f"regenerate: {regen.ok} ok, {regen.failed} failed, {regen.skipped} skipped of {regen.total}")
    if plan is not None:  # the target's own served answers, beside the regenerated ones: nothing to regenerate
        print(f"capture: {plan.add_to(regen_dir)} captured conversations as served ({plan.greedy} greedy)")
    ext = fresh_if_missing(extract_task, Path(ext_dir) / "manifest.json")(
        cfg.extract, tref.path, regen_dir, ext_dir, trust, ray_settings=settings, runtime=cfg.runtime
    )
    with store.run(f"{name}-{key[:12]}", tags={"run_key": key, "target": f"{tref.name}/{tref.version}"}) as run_id:
        lineage = {
            "target_name": tref.name,
            "target_version": tref.version,
            "target_weights_sha256": tref.weights_sha256,
            "traffic_sha256": traffic_sha256(traffic),
            "run_key": key,
            **({"init_from": parent.uri} if parent else {}),
            **(plan.tags() if plan else {}),
        }
        champion = store.get_alias(name, CHAMPION)
        job = HeadJob(
            cfg,
            settings,
            tref,
            work,
            heldout,
            lineage,
            MlflowSink(store.tracking_uri, run_id),
            parent,
            str(store.resolve(champion.uri)) if champion else None,
        )
        chosen, choice_tags = _choose([_train_and_evaluate(job, v) for v in cfg.train.variants or (None,)])
        tr, fig, eval_dir = chosen.train, chosen.figures, chosen.eval_dir
        ev, engine, sweep = fig.local, fig.engine, fig.sweep
        head = HeadToRegister(
            head_dir=tr.head_dir,
            target=tref,
            traffic_sha256=traffic_sha256(traffic),
            run_key=key,
            run_id=run_id,
            metrics=fig.metrics,
            champion_tau=ev.baseline_tau if ev else None,
            evaluation_dir=eval_dir,
            params={"config": cfg.to_dict()},
            init_from=parent.uri if parent else None,
            champion_tau_engine=engine.baseline_tau if engine else None,
            checkpoint={k: getattr(tr, k, None) for k in CHOICE_KEYS},
            notes={
                "speedup_note": ev.speedup_note if ev else "",
                "speedup_vllm_note": engine.speedup_note if engine else "",
                "target_runtime": cfg.runtime.tag(),
                "extract_engine": cfg.runtime.engine_of("extract"),  # who computed the features
                **(sweep.tags() if sweep else {}),
                **choice_tags,
                **(plan.tags() if plan else {}),
            },
        )
        if plan is not None and champion is not None:  # the shadow test: an extra gate before the alias moves
            shadow = shadow_task(
                cfg.evaluate,
                HeadEval(tref.path, tr.head_dir, plan.heldout_file, str(work / "shadow"), job.champ_dir),
                settings,
                champion.uri,
            )
            head = dataclasses.replace(
                head,
                extra_gate=shadow.gate(),
                notes={**head.notes, **shadow.tags()},
                metrics={**head.metrics, **shadow.metrics()},  # the served-speedup gate judges the shadow's figure
            )
        reg = register_task(settings, cfg.register, head, cfg.runtime)
    nan = float("nan")  # a figure of this project's decoding, not measured when vLLM runs the target
    summary = HeadRun(
        head_uri=reg.uri,
        alias=reg.alias,
        promoted=reg.promoted,
        gate=reg.reason,
        tau=ev.tau if ev else nan,
        tau_raw=ev.tau_raw if ev else None,
        tau_vllm=engine.tau if engine else None,
        speedup=ev.speedup if ev else nan,
        speedup_vllm=engine.speedup if engine else None,
        identical=ev.identical if ev else None,
        acceptance=ev.acceptance if ev else [],
        per_segment=ev.per_segment if ev else None,
        vllm=engine,
        train=tr,
        regenerate=regen,
        extract=ext,
        created=True,
        work_dir=str(work),
        init_from=parent.uri if parent else None,
        speedup_note=ev.speedup_note if ev else "",
        crossover=sweep.crossover if sweep else None,
        k_schedule=sweep.schedule if sweep else None,
        variant_choice=choice_tags.get("variant_choice", ""),
    )
    atomic_write_text(work / "summary.json", json.dumps(asdict(summary), indent=2, default=str) + "\n")
    print(f"registered {reg.uri} as {reg.alias}: {reg.reason}")
    return summary


@dataclass(frozen=True)
class HeadJob:
    """What training and evaluating a head of the run needs (once, or once per variant of `train.variants`)."""

    cfg: PipelineConfig
    settings: Settings
    tref: TargetRef
    work: Path
    heldout: str
    lineage: dict[str, Any]
    sink: MlflowSink  # the run's training metrics
    parent: ParentHead | None
    champ_dir: str | None  # the current champion head, evaluated beside it


@dataclass(frozen=True)
class Candidate:
    """A trained and evaluated head: its variant (None: `train.variant`, no choice), training, figures."""

    variant: str | None
    train: TrainResult
    figures: Figures
    eval_dir: str


def _train_and_evaluate(job: HeadJob, variant: str | None) -> Candidate:
    """Train a head on the run's features and evaluate it; `variant` (of `train.variants`) in place of
    `train.variant`, in its own `train-<variant>`/`evaluate-<variant>` directories, its metrics as `<variant>/...`."""
    cfg, suffix = job.cfg, f"-{variant}" if variant else ""
    train_cfg = dataclasses.replace(cfg.train, variant=variant, variants=()) if variant else cfg.train
    train_dir, eval_dir = str(job.work / f"train{suffix}"), str(job.work / f"evaluate{suffix}")
    tr = fresh_if_missing(train_task, Path(train_dir) / "head" / "model.safetensors")(
        train_cfg,
        TrainJob(
            str(job.work / "extract"), train_dir, job.tref.path, job.lineage, job.parent.path if job.parent else None
        ),
        job.settings,
        sinks=(VariantSink(job.sink, variant) if variant else job.sink,),
    )
    head = HeadEval(job.tref.path, tr.head_dir, job.heldout, eval_dir, job.champ_dir, tr.history_file)
    fig = evaluate_head(cfg, head, job.settings, EvalPlan.of_run(cfg, eval_dir), TASKS)
    return Candidate(variant, tr, fig, eval_dir)


def _choose(candidates: list[Candidate]) -> tuple[Candidate, dict[str, str]]:
    """The head to register and the tags its choice adds: the one candidate and none, or the variant
    `choose_variant` picks and every variant's figures (`variant_tags`)."""
    if len(candidates) == 1:
        return candidates[0], {}
    metrics = {c.variant: c.figures.metrics for c in candidates if c.variant}
    choice = choose_variant(metrics)
    print(f"variant: {choice.reason}")
    return next(c for c in candidates if c.variant == choice.variant), variant_tags(metrics, choice)
