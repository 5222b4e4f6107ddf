"""The named pipeline presets, in one place: each a function returning a whole pipeline config as its sections.

Purpose: `PRESETS[name]()` is what `--preset NAME` means everywhere (the CLI, the flows): a mapping of every section
of `PipelineConfig` (section name -> that stage's config); `PipelineConfig.preset(name)` (components/config/pipeline.py)
builds the config from it. The presets build sections only, so this module never imports components/config/pipeline.py
(which imports it: no cycle).
  tiny     the tests' settings: seconds on CPU, in-process training (no Ray)
  default  the demo on 2 CPU cores on the embedded default, the real SmolLM2 (one Ray worker, vLLM measurement)
  gpu      one accelerator, no Ray, MLflow or Prefect: bench/gpu_pipeline.py's run of the components on the
           embedded `gpu` target (in-process training, local evaluation)
"default" means the `default` preset; the stage configs' own dataclass defaults are building blocks, not a preset.
`assignment(text)` parses one `key.path=value` (the value as JSON, at most 64 deep, else as a string) without
importing anything heavy, `assignments_tree` turns them into nested sections for components/config/pipeline.py
`resolve` (the preset, then a JSON file's sections, then the `--set` assignments, each checked by its strict override
machinery).
Run: `eagle-heads config show --preset tiny --set train.steps=5` prints a resolved config as JSON.
Not here: the stage configs' `tiny()` factories (each stage keeps its own, used by these presets and the unit tests)
or the benchmark settings of bench/common.py (their embedded sizes and prompt counts are the benchmarks' own).
This module imports no torch, MLflow, Prefect or Ray at import time (the CLI's parser reads `NAMES`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from components.data.safe_read import loads_json


def tiny_stages() -> dict[str, Any]:
    """The `tiny` preset's stage sections (regenerate, extract, train in-process, evaluate): importable where MLflow
    is not (bench/gpu_pipeline.py --quick)."""
    from components.evaluate.stage import EvaluateConfig
    from components.extract.stage import ExtractConfig
    from components.regenerate.stage import RegenerateConfig
    from components.train.stage import TrainConfig

    return dict(
        regenerate=RegenerateConfig(max_new_tokens=16, batch_size=8, shard_size=8, limit=16),
        extract=ExtractConfig(max_len=192, seqs_per_shard=8),
        train=TrainConfig.tiny(),
        evaluate=EvaluateConfig.tiny(),
    )


def tiny() -> dict[str, Any]:
    """Seconds on CPU: the unit and flow tests' pipeline."""
    from components.data.captured_traffic import CapturedTrafficConfig
    from components.registry.register import RegisterConfig
    from components.serving.monitor import MonitorConfig

    return dict(
        **tiny_stages(),
        register=RegisterConfig(tau_floor=1.0, gate_speedup="off"),  # random heads
        monitor=MonitorConfig.tiny(),
        capture=CapturedTrafficConfig.tiny(),
    )


def default() -> dict[str, Any]:
    """The demo on 2 CPU cores, on the embedded default: SmolLM2-135M-Instruct (30 layers, hidden 576, vocabulary
    49,152, tied embeddings) and its LoRA fine-tune (embedded/real.py).

    Sized so that `make demo` stays near 30 minutes on 2 cores: the target answers 160 conversations in vLLM
    (`regenerate.engine: vllm`, 32 requests in flight), as it is served, and vLLM computes their hidden states
    (`extract.engine: vllm`, production's path); bench/data_curve.py showed the head step-limited at this budget
    (4x the conversations buys +0.13 held-out tau), so steps, not conversations, get the time. Extraction keeps 512
    tokens of each, and the loss scores every token (`train.loss_on: all`): the prompts' positions are the target's
    distribution too, so the same regenerated answers teach twice as many positions.
    One Ray worker with both cores, a step made cheap three ways (4.2x fp32's sequence tokens/s together,
    bench/train_step.py): bf16 where the CPU has bf16 units (`train.autocast: auto`: AMX 1.3x a step, AVX512-BF16 1.68x,
    bench/cpu_autocast.py), batches of like length (`bucket_by_length`: 4% padding instead of 39%), and each
    sequence's teacher (the target's 49k-vocabulary lm_head) computed once and kept (`teacher_cache_mib`).
    A fresh head starts as the target's own layer that its highest fused state enters (`head_init: target-layer`:
    +0.07 and +0.09 held-out tau after 6 minutes on the real model, two runs, bench/ttt_schedule.py --inits).
    A fine-tune's head, warm-started from its base's head, gets half the steps of a fresh one
    (`train.warm_start_steps`), since it starts close.
    Each head is also served by vLLM and measured there (`evaluate.engine: vllm`), as production will run it, one
    request at a time (3-4 interleaved rounds over 6 held-out prompts of up to 64 new tokens) and at 4 concurrent
    requests (`evaluate.load`, K 5 against plain, which gives the K schedule the engine is served with; the schedule
    is derived, not served again: `verify_schedule: false`). Before all that, the K it drafts at batch size 1 is
    measured (`evaluate.pick`: K 2, 3 and 5 beside plain, 4 prompts, 2 rounds; ~1 min): one draft step's cost is the
    machine's, and on 2 Zen 5 cores K 5 served below plain where K 2 paid ~1.2x. Our own decoder still measures τ,
    acceptance and identity, once each way and untimed (`evaluate.time_local: false`). The promotion gate judges the
    served speedup (`register.gate_speedup: served`).
    """
    from components.evaluate.load_config import DepthPickConfig, LoadConfig
    from components.evaluate.speed import SpeedupConfig
    from components.evaluate.stage import EvaluateConfig
    from components.extract.stage import ExtractConfig
    from components.regenerate.stage import RegenerateConfig
    from components.registry.register import RegisterConfig
    from components.train.stage import RayConfig, TrainConfig
    from eagle.run_config import OptimConfig, SpecConfig, TTTConfig

    return dict(
        regenerate=RegenerateConfig(
            max_new_tokens=96, batch_size=32, shard_size=80, limit=160, engine="vllm", endpoint_concurrency=32
        ),
        extract=ExtractConfig(max_len=512, seqs_per_shard=128, engine="vllm"),
        train=TrainConfig(
            steps=160,
            batch_size=8,
            draft_vocab_size=2048,
            checkpoint_every=40,
            log_every=10,
            warm_start_steps=80,
            eval_every=40,
            holdout_seqs=32,
            autocast="auto",
            loss_on="all",
            head_init="target-layer",
            bucket_by_length=True,
            teacher_cache_mib=2048,
            ttt=TTTConfig(ttt_steps=5),
            optim=OptimConfig(lr=3e-3, warmup_steps=10),
            ray=RayConfig(num_workers=1, cpus_per_worker=2),
        ),
        evaluate=EvaluateConfig(
            spec=SpecConfig(method="chain", depth=5, max_new_tokens=64),
            limit=6,
            engine="vllm",
            speed=SpeedupConfig(min_rounds=3, max_rounds=4, budget_s=150.0),
            load=LoadConfig(concurrency=(1, 4), k_values=(5,), requests=8, repeats=1, verify_schedule=False),
            pick=DepthPickConfig(choices=(2, 3, 5)),
            time_local=False,
        ),
        register=RegisterConfig(tau_floor=1.5, gate_tau="engine"),
    )


def gpu_stages() -> dict[str, Any]:
    """The `gpu` preset's stage sections (regenerate, extract, train, evaluate), without the registry's and the
    monitor's: bench/gpu_pipeline.py runs them where MLflow is not installed (and so `RegisterConfig` is not)."""
    from components.evaluate.stage import EvaluateConfig
    from components.extract.stage import ExtractConfig
    from components.regenerate.stage import RegenerateConfig
    from components.train.stage import RayConfig, TrainConfig
    from eagle.run_config import OptimConfig, SpecConfig, TTTConfig

    return dict(
        regenerate=RegenerateConfig(max_new_tokens=128, batch_size=64, shard_size=256, limit=1024, device="cuda"),
        extract=ExtractConfig(max_len=512, seqs_per_shard=256, device="cuda"),
        train=TrainConfig(
            steps=600,
            batch_size=16,
            draft_vocab_size=4096,
            checkpoint_every=200,
            log_every=25,
            eval_every=100,
            holdout_seqs=32,
            ttt=TTTConfig(ttt_steps=7),
            optim=OptimConfig(lr=2e-3, warmup_steps=30),
            ray=RayConfig(num_workers=0, use_gpu=True),
        ),
        evaluate=EvaluateConfig(spec=SpecConfig(method="chain", depth=5, max_new_tokens=128), limit=32, device="cuda"),
    )


def gpu() -> dict[str, Any]:
    """One accelerator, in-process (no Ray), evaluated locally: bench/gpu_pipeline.py's run on the embedded `gpu`
    target within a few minutes of device time (its `--quick` runs `tiny`'s sections on CPU)."""
    from components.registry.register import RegisterConfig

    return dict(**gpu_stages(), register=RegisterConfig(tau_floor=1.5))


PRESETS = {"tiny": tiny, "default": default, "gpu": gpu}  # name -> the function returning its sections
NAMES = tuple(PRESETS)


def assignment(text: str) -> tuple[str, Any]:
    """`key.path=value` -> ("key.path", value): the value parsed as JSON (5, 0.1, true, null, [1, 2], "s"), else
    taken as the string itself (`evaluate.engine=vllm`). ValueError when there is no `=` or no key."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ValueError(f"{text!r}: expected KEY.PATH=VALUE, e.g. train.steps=50")
    try:
        value = loads_json(raw)
    except json.JSONDecodeError:
        value = raw
    except ValueError as e:  # nested deeper than any config value (json.loads alone would recurse out)
        raise ValueError(f"{key.strip()}: {e}") from None
    return key.strip(), value


def assignments_tree(assignments: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """[("train.optim.lr", 0.1), ("train.steps", 5)] -> {"train": {"optim": {"lr": 0.1}, "steps": 5}}; a later
    assignment of the same key wins. A key that is both a value and a section keeps the last one given."""
    tree: dict[str, Any] = {}
    for key, value in assignments:
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            if not isinstance(node.get(s), dict):
                node[s] = {}
            node = node[s]
        node[leaf] = value
    return tree
