"""Flow `demo`: the whole job on the embedded default, as a new user sees it with `make demo`.

Purpose: build (or reuse) the embedded default (the real SmolLM2-135M-Instruct, its LoRA fine-tune, traffic;
`--embedded-preset toy`: the stdlib Llama built here), register the base target as version 1 of `smollm2-135m` (the
toy's: `stdlib-llama`), train/evaluate/register its head through `train-head`, then register
the fine-tune as version 2 and let the trigger path (registry watcher -> `on-new-finetune`) train its head.
The base's features are extracted as the preset says (by vLLM in `default`, production's path; in this process in
`tiny`, so the tests show both paths side by side), the fine-tune's by the serving engine (`extract.engine: vllm`,
through a config file of that one key, `<state>/demo/finetune-extract-<engine>.json`; `finetune_extract` picks it).
Returns a table of both heads (`features`: who computed the head's features, from its registered `extract_engine`
tag; tau measured here: emitted tokens per step, and `tau_raw`, what the rule accepted, as vLLM counts; with
`evaluate.engine: vllm` also tau in vLLM serving the head, equal to `tau_raw`) whose last
line is
`demo: tau=<tau> speedup=<x>x identical=<yes|no> head=<models:/...@alias>` for the fine-tune's head
(the CLI prints it after the flow, so it is the very last line of `make demo`). `speedup=` is the served one (vLLM's,
as a user serving the head gets it; ours where vLLM did not measure); a line above says so when it is unreliable.
Run: `make demo` or `eagle-heads demo [--preset tiny]`.
Not here: any stage logic.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from components.data.atomic import atomic_write_text
from components.registry.register import register_target
from components.targets.target import weights_sha256
from flows.train_head import HeadRun, train_head
from flows.watch import watch_registry
from infra.mlflow_store import MlflowStore
from infra.model_uri import parse_model_uri
from infra.settings import Settings


def _speedup(value: float | None, reliable: bool = True) -> str:
    """A speedup cell: "1.52x", "1.52x?" when unreliable (its rounds disagreed or the machine was busy), "-" when not
    measured."""
    if value is None or value != value:
        return "-"
    return f"{value:.2f}x" + ("" if reliable else "?")


def served_speedup(s: HeadRun) -> tuple[float, bool]:
    """The speedup a user gets and whether it is reliable: vLLM's when measured, else ours."""
    if s.vllm is not None:
        return s.vllm.speedup, s.vllm.speedup_reliable
    if s.speedup_vllm is not None:
        return s.speedup_vllm, True
    return s.speedup, not s.speedup_note


def version_tags(store: MlflowStore, s: HeadRun) -> dict[str, str]:
    """The registered head version's tags ({} for a URI without a version)."""
    name, version, _alias = parse_model_uri(s.head_uri)
    return dict(store.get_version(name, version).tags) if version else {}


def features_of(tags: dict[str, str], configured: str) -> str:
    """Who computed the head's features: its registered `extract_engine` tag; `configured` (the engine of the config
    the run had, part of its run key) for a head registered before that tag existed."""
    return tags.get("extract_engine") or configured


def tau_by_position(tags: dict[str, str]) -> str:
    """tau in the first and the last output-position bucket measured (`tau_by_position`, "0-128:2.81
    128-512:2.50"): "2.81..2.50", one figure when one bucket was reached, "-" when none was tagged."""
    taus = [float(b.rsplit(":", 1)[1]) for b in tags.get("tau_by_position", "").split()]
    return "-" if not taus else f"{taus[0]:.2f}" if len(taus) == 1 else f"{taus[0]:.2f}..{taus[-1]:.2f}"


def extract_config(state_dir: Path, engine: str) -> str:
    """The config file of the fine-tune's run: `{"extract": {"engine": ENGINE}}` over the preset."""
    path = state_dir / "demo" / f"finetune-extract-{engine}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"extract": {"engine": engine}}) + "\n"
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
    return str(path)


def _row(label: str, tags: dict[str, str], features: str, s: HeadRun) -> str:
    alpha = " ".join(f"{a:.2f}" for a in s.acceptance)
    ident = {True: "yes", False: "NO", None: "n/a"}[s.identical]
    tau_vllm = f"{s.tau_vllm:.2f}" if s.tau_vllm is not None else "-"
    tau_raw = f"{s.tau_raw:.2f}" if s.tau_raw is not None else "-"
    vllm = _speedup(*served_speedup(s)) if (s.vllm is not None or s.speedup_vllm is not None) else "-"
    cross = "-" if s.k_schedule is None else (str(s.crossover) if s.crossover is not None else "none")
    return (
        f"{label:<28} {features:<8} {s.head_uri:<36} {s.alias:<10} {s.tau:>5.2f} {tau_by_position(tags):>10} "
        f"{tau_raw:>7} {tau_vllm:>9} "
        f"{_speedup(s.speedup, not s.speedup_note):>8} {vllm:>9} {cross:>9} {ident:>9}  {alpha}"
    )


EMBEDDED = ("smollm2", "toy", "tiny", "gpu")  # smollm2: the real default; the others: the toy stdlib Llama's sizes
TARGET_NAMES = {"smollm2": "smollm2-135m"}  # the toy's: stdlib-llama


def build_default(embedded_preset: str, root: Path):
    """The embedded default of `embedded_preset`, built or found in the cache under `root`: the real model
    (embedded/real.py) or the toy stdlib Llama (embedded/build.py; "toy" is its `default` config)."""
    if embedded_preset == "smollm2":
        from embedded.real import build_real

        return build_real(root=root)
    from embedded.build import build_embedded
    from embedded.config import EmbeddedConfig

    return build_embedded(EmbeddedConfig.preset("default" if embedded_preset == "toy" else embedded_preset), root)


@flow(name="demo", log_prints=True)
def demo(
    preset: str = "default",
    embedded_preset: str = "smollm2",
    target_name: str | None = None,
    finetune_extract: str = "vllm",
) -> dict:
    from components.config.pipeline import PipelineConfig

    settings = Settings.from_env()
    base_extract = PipelineConfig.load(None, preset).runtime.engine_of("extract")
    tuned_cfg = extract_config(settings.state_dir, finetune_extract)  # checked (strictly) before any work
    if PipelineConfig.load(tuned_cfg, preset).runtime.extracts_in_engine:
        from infra.vllm_server import vllm_python

        vllm_python(settings)  # no vLLM venv: its one line now, not after the base head is trained
    print(f"[1/4] embedded default ({embedded_preset}): build or reuse under {settings.state_dir / 'embedded'}")
    emb = build_default(embedded_preset, settings.state_dir / "embedded")
    target_name = target_name or TARGET_NAMES.get(embedded_preset, "stdlib-llama")
    store = MlflowStore.connect(settings)
    t, f = emb.target_traffic, emb.finetune_traffic
    base = register_target(
        store,
        target_name,
        str(emb.target_dir),
        role="base",
        base_model="",
        weights_sha256=weights_sha256(emb.target_dir),
        extra_tags={"traffic_train": str(t.train), "traffic_heldout": str(t.heldout)},
    )
    print(
        f"[2/4] base target registered as models:/{target_name}/{base.version}; training its head "
        f"(features: {base_extract})"
    )
    r1 = train_head(f"models:/{target_name}/{base.version}", str(t.train), str(t.heldout), preset)
    tuned = register_target(
        store,
        target_name,
        str(emb.finetune_dir),
        role="finetune",
        base_model=f"{target_name}/{base.version}",
        weights_sha256=weights_sha256(emb.finetune_dir),
        extra_tags={"traffic_train": str(f.train), "traffic_heldout": str(f.heldout)},
    )
    print(
        f"[3/4] fine-tune registered as models:/{target_name}/{tuned.version}; the registry watcher picks it up "
        f"(features: {finetune_extract}, {tuned_cfg})"
    )
    triggered = watch_registry(dispatch="local", preset=preset, config_path=tuned_cfg)
    r2 = triggered.get(f"{target_name}/{tuned.version}")
    if not isinstance(r2, HeadRun):  # already had a head from an earlier demo: the run is idempotent
        r2 = train_head(f"models:/{target_name}/{tuned.version}", str(f.train), str(f.heldout), preset, tuned_cfg)
    print("[4/4] done")
    name = r2.head_uri.split("/")[1]
    alias = r2.alias or "champion"
    ident = "yes" if r2.identical else "no"
    table = [
        "results (held-out traffic, greedy, outputs checked identical to plain decoding):",
        f"{'target':<28} {'features':<8} {'head':<36} {'alias':<10} {'tau':>5} {'tau_pos':>10} {'tau_raw':>7} "
        f"{'tau(vLLM)':>9} "
        f"{'speedup':>8} {'sp(vLLM)':>9} {'crossover':>9} {'identical':>9}  alpha_1..k",
        "(features: who computed the hidden states the head was trained on, this process (local) or the serving "
        "engine (vllm); tau_pos: tau in the first..last output-position bucket reached (evaluate.position_edges); "
        "speedup: median of interleaved rounds, ours ('-': not timed, evaluate.time_local) and in vLLM, one "
        "request at a time; '?' marks an "
        "unreliable figure (its rounds disagreed, or other processes used the cores); crossover: the first "
        "concurrency where plain decoding out-serves the head in vLLM, where the registered K schedule stops "
        "drafting)",
        *(
            _row(label, tags, features_of(tags, configured), r)
            for label, r, configured, tags in (
                (f"{target_name} v{base.version} (base)", r1, base_extract, version_tags(store, r1)),
                (f"{target_name} v{tuned.version} (fine-tune)", r2, finetune_extract, version_tags(store, r2)),
            )
        ),
        *(
            []
            if served_speedup(r2)[1]
            else [
                "the served speedup below is unreliable (its rounds disagreed or the "
                "machine was busy): re-run `eagle-heads evaluate` on quiet cores"
            ]
        ),
        f"demo: tau={r2.tau:.2f} speedup={served_speedup(r2)[0]:.2f}x identical={ident} head=models:/{name}@{alias}",
    ]
    return {"base": r1, "finetune": r2, "lines": table}
