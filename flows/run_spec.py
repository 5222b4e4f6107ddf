"""A `train-head` run resolved before its stages: the target version, the head it warm-starts from, its run key.

Purpose: `resolve_target(store, target, ...)` gives the target's registry identity and local directory (an HF
directory is registered on the fly, under a lock so that two runs register it once; a GGUF file's lineage tagged);
`parent_head(store, tref, cfg, ...)` the head a fine-tune's run warm-starts from (`ParentHead`: the champion head of
the version's `base_model`, or with `own` of this very version, when `train.warm_start` is on and that head fits the
target's shapes and fused layers; else None, a fresh head); `run_key_of(...)` the run's identity (the hash of the
target's weights, the traffic files, the config, the parent head's weights and the capture plan); `RunSpec` all of
it, as flows/train_head.py `_run` takes it.
Run: through flows/train_head.py `train_head`.
Not here: the stages and registration (flows/train_head.py), the registry's own rules
(components/registry/register.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger

from components.config.pipeline import PipelineConfig
from components.data.atomic import file_sha256
from components.data.captured_traffic import CapturePlan
from components.data.traffic_io import traffic_sha256
from components.registry.register import TargetRef, head_model_name, register_target
from components.targets.gguf import gguf_lineage
from components.targets.target import weights_sha256
from infra.locks import target_lock
from infra.mlflow_store import CHAMPION, MlflowStore, parse_model_uri
from infra.settings import Settings


def resolve_target(
    store: MlflowStore, target: str, name: str | None = None, settings: Settings | None = None
) -> tuple[TargetRef, bool]:
    """A local directory and registry identity for `target` (registering an HF directory if needed), and whether
    this call registered it (a new version)."""
    if target.startswith("models:/"):
        model, version, _alias = parse_model_uri(target)
        path = store.resolve(target)
        if version is None:
            version = store.get_alias(model, _alias).version  # type: ignore[union-attr]
        sha = store.get_version(model, version).tags.get("weights_sha256") or weights_sha256(path)
        return TargetRef(model, version, sha, str(path)), False
    path = Path(target).resolve()
    sha = weights_sha256(path)
    name = name or path.name
    with target_lock(settings or store.settings, f"register-target-{name}"):  # two runs at once: one version
        known = store.find_versions(name, weights_sha256=sha)
        return register_target(
            store, name, str(path), role="user", base_model="", weights_sha256=sha, extra_tags=gguf_lineage(path)
        ), not known  # converted from GGUF: which file


@dataclass(frozen=True)
class ParentHead:
    """The head a warm-started run starts from: its registry URI, local directory and weights hash."""

    uri: str
    path: str
    weights_sha256: str


def parent_head(
    store: MlflowStore, tref: TargetRef, cfg: PipelineConfig, trust_remote_code: bool = False, own: bool = False
) -> ParentHead | None:
    """The champion head of the target this version was fine-tuned from (its `base_model` tag, "name/version"; `own`:
    of this very version), when warm start is on and that head fits this target's shapes; else None (a fresh head)."""
    if not cfg.train.warm_start:
        return None
    base = (
        f"{tref.name}/{tref.version}"
        if own  # `resolve_target` registered the version and its base_model tag
        else store.get_version(tref.name, tref.version).tags.get("base_model", "")
    )
    if not base or "/" not in base:
        return None
    base_name, base_version = base.rsplit("/", 1)
    if not base_version.isdigit():
        return None
    head_name = head_model_name(TargetRef(base_name, int(base_version), "", ""), cfg.register.experiment_suffix)
    champion = store.get_alias(head_name, CHAMPION)
    if champion is None:
        return None
    path = store.resolve(champion.uri)
    from transformers import AutoConfig

    from eagle.config import DraftConfig, default_aux_layer_ids
    from eagle.export import HeadMismatchError, check_head_fits, read_head_meta

    target_config = AutoConfig.from_pretrained(tref.path, trust_remote_code=trust_remote_code)
    parent_cfg = read_head_meta(path)["draft_config"]
    ids = list(cfg.extract.aux_layer_ids or default_aux_layer_ids(target_config.num_hidden_layers))
    try:
        if list(parent_cfg.get("aux_layer_ids", [])) != ids:  # e.g. a head that fuses (2, 3, 3)
            raise HeadMismatchError(f"it fuses layers {parent_cfg.get('aux_layer_ids')}, this run fuses {ids}")
        check_head_fits(DraftConfig.from_dict(parent_cfg), target_config, where=champion.uri)
    except HeadMismatchError as e:
        get_run_logger().warning(f"no warm start from {champion.uri}: {e}; training a fresh head")
        return None
    return ParentHead(
        f"models:/{head_name}/{champion.version}", str(path), file_sha256(Path(path) / "model.safetensors")
    )


def run_key_of(
    target: TargetRef,
    traffic: str,
    heldout: str,
    cfg: PipelineConfig,
    parent: ParentHead | None = None,
    plan: CapturePlan | None = None,
) -> str:
    parts = [target.weights_sha256, traffic_sha256(traffic), traffic_sha256(heldout), cfg.fingerprint()]
    if parent is not None:  # a warm-started head depends on the head it started from
        parts.append(parent.weights_sha256)
    if plan is not None:  # and a head trained on captured traffic on what was captured
        parts.append(plan.sha256)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class RunSpec:
    """One run of the flow, resolved: the target version, the run key and its work directory, the traffic files, the
    head it warm-starts from and the capture plan it trains on (None: none)."""

    tref: TargetRef
    key: str
    work: Path
    traffic: str
    heldout: str
    parent: ParentHead | None = None
    plan: CapturePlan | None = None
