"""The bad-input table's argv templates, and its rows of bad config values and of files that are not what they seem.

Purpose: pieces of tests/test_bad_input_table.py, kept here so that the table module stays small: `TRAIN`, `EVAL`,
`SERVE`, `MON` (argv templates over the paths of its `files` fixture) and `argv_with`; `BAD_CONFIGS` (bad values of
the config sections, each in its own `--config` file, `CONFIG_ROWS` among them; those in `CONFIG_ON_EVALUATE` given
to `evaluate` too); issue 49's rows (`FILE_ROWS`:
other encodings, deep or huge JSON, named pipes, devices, sockets, link loops, unreadable files, the vLLM python,
EAGLE_HOME's folders, TMPDIR; `MODEL_ROWS`: real checkpoints the pipeline does not support yet, a family it is not
proven on, no chat template, a context shorter than the settings ask for, quantized weights; `SERVE_ROWS`: serve's
rollback flags), whose inputs tests/helpers_bad_input_files.py makes; `time_limit`, which fails a row whose read blocks
instead of hanging the suite.
Run: imported by tests/test_bad_input_table.py; nothing runs at import.
Not here: the table's other rows and its test functions (tests/test_bad_input_table.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading

EMPTY, REGISTRY = "empty", "registry"
ROW_LIMIT_S = 30  # each row's refusal takes well under a second; a loaded 2-core machine gets slack
TRAIN = ["train", "--target", "{target}", "--traffic", "{traffic}", "--heldout", "{heldout}", "--preset", "tiny"]
EVAL = ["evaluate", "--head", "{head}", "--target", "{target}", "--traffic", "{heldout}", "--preset", "tiny"]
SERVE = ["serve", "--head", "{head}", "--target", "{target}"]
MON = ["monitor", "--metrics-url", "http://127.0.0.1:9/metrics", "--target", "models:/t/1", "--preset", "tiny"]


def argv_with(base: list[str], **opts: str) -> list[str]:
    """`base` with `--key value` replaced or added for each of `opts` (underscores become dashes)."""
    out = list(base)
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


_with = argv_with  # short, for the rows

# settings in a `--config` file, rows of BAD_CONFIGS below (row `train-config-<id>`): id -> (sections, needle)
CONFIG_ROWS: dict[str, tuple[dict, str]] = {
    "train-bucket-not-bool": (
        {"train": {"bucket_by_length": "yes"}},
        "train.bucket_by_length: 'yes' is not of type bool",
    ),
    "train-teacher-cache-negative": ({"train": {"teacher_cache_mib": -1}}, "train.teacher_cache_mib must be"),
    "train-shallow-not-below-ttt": (
        {"train": {"ttt": {"ttt_steps": 3, "shallow_steps": 3, "shallow_fraction": 0.5}}},
        "train.ttt.shallow_steps must be below ttt_steps (3)",
    ),
    "train-shallow-fraction-one": ({"train": {"ttt": {"shallow_fraction": 1}}}, "train.ttt.shallow_fraction must be"),
    "capture-mix-one": ({"capture": {"mix": 1}}, "capture.mix must be a number in (0, 1)"),
    "capture-heldout-zero": ({"capture": {"heldout": 0}}, "capture.heldout must be an integer >= 1, got 0"),
    "capture-trigger-not-int": ({"capture": {"trigger_new": 2.5}}, "capture.trigger_new: 2.5 is not of type int"),
    "capture-unknown-key": ({"capture": {"ratio": 0.5}}, "unknown key capture.ratio"),
}


# Settings in a `--config` file: row id -> (the file's sections, needle). Each is a row `train-config-<id>`, and the
# ids in CONFIG_ON_EVALUATE are also rows `evaluate-config-<id>` (the same file given to `evaluate`).
BAD_CONFIGS: dict[str, tuple[dict, str]] = {
    "speed-min-rounds-zero": ({"evaluate": {"speed": {"min_rounds": 0}}}, "evaluate.speed.min_rounds must be"),
    "train-loss-on-unknown": ({"train": {"loss_on": "prompts"}}, "train.loss_on"),
    "train-head-init-unknown": ({"train": {"head_init": "target"}}, "train.head_init must be one of"),
    "register-gate-speedup-unknown": ({"register": {"gate_speedup": "on"}}, "register.gate_speedup"),
    "speed-max-below-min": (
        {"evaluate": {"speed": {"min_rounds": 5, "max_rounds": 3}}},
        "evaluate.speed.max_rounds must be >= min_rounds (5)",
    ),
    "speed-spread-one": ({"evaluate": {"speed": {"max_spread": 1.0}}}, "evaluate.speed.max_spread must be in (0, 1)"),
    "speed-budget-inf": (
        {"evaluate": {"speed": {"budget_s": float("inf")}}},
        "evaluate.speed.budget_s must be a positive number of seconds, got inf",
    ),
    "speed-other-load-negative": (
        {"evaluate": {"speed": {"max_other_load": -1}}},
        "evaluate.speed.max_other_load must be a number of CPU cores >= 0",
    ),
    "speed-switch-pause-negative": (
        {"evaluate": {"speed": {"switch_pause_s": -1}}},
        "evaluate.speed.switch_pause_s must be a number of seconds >= 0",
    ),
    "load-descending": ({"evaluate": {"load": {"concurrency": [4, 1]}}}, "evaluate.load.concurrency must be ascending"),
    "load-not-a-list": ({"evaluate": {"load": {"concurrency": "1,4"}}}, "evaluate.load.concurrency: '1,4' is not of"),
    "load-k-above-16": ({"evaluate": {"load": {"k_values": [5, 17]}}}, "evaluate.load.k_values must be <= 16"),
    "load-requests-below-top": (
        {"evaluate": {"load": {"concurrency": [1, 32], "requests": 16}}},
        "evaluate.load.requests must be >= the top concurrency 32",
    ),
    "load-margin-above-one": ({"evaluate": {"load": {"margin": 1.5}}}, "evaluate.load.margin must be in [0, 1)"),
    "pick-one-choice": ({"evaluate": {"pick": {"choices": [5]}}}, "evaluate.pick.choices must name at least two K"),
    "pick-descending": ({"evaluate": {"pick": {"choices": [5, 2]}}}, "evaluate.pick.choices must be ascending"),
    "target-unknown-runtime": ({"target": {"runtime": "tpu"}}, "target.runtime must be one of 'local', 'vllm'"),
    "target-tp-zero": ({"target": {"tensor_parallel_size": 0}}, "target.tensor_parallel_size must be an integer >= 1"),
    "target-pp-negative": (
        {"target": {"pipeline_parallel_size": -1}},
        "target.pipeline_parallel_size must be an integer >= 1",
    ),
    "target-dp-fraction": ({"target": {"data_parallel_size": 1.5}}, "target.data_parallel_size: 1.5 is not of type"),
    "target-unknown-backend": (
        {"target": {"distributed_executor_backend": "magic"}},
        "target.distributed_executor_backend must be one of",
    ),
    "target-vllm-online": (
        {"target": {"runtime": "vllm"}, "extract": {"mode": "online"}},
        "target.runtime 'vllm' runs the extract stage in the engine",
    ),
    "extract-unknown-engine": ({"extract": {"engine": "tpu"}}, "extract.engine must be one of 'local', 'vllm'"),
    "train-unknown-variant": (
        {"train": {"variant": "eagle4"}},
        "train.variant must be one of 'eagle3', 'eagle3.1', 'parallel'",
    ),
    "train-variants-twice": ({"train": {"variants": ["eagle3", "eagle3"]}}, "train.variants names a variant twice"),
    "train-unknown-autocast": ({"train": {"autocast": "bf16"}}, "train.autocast must be one of 'gpu', 'auto', 'off'"),
    "edges-descending": ({"evaluate": {"position_edges": [128, 0]}}, "evaluate.position_edges must be >= 2 ascending"),
    "edges-one": ({"evaluate": {"position_edges": [0]}}, "evaluate.position_edges must be >= 2 ascending"),
    "edges-fraction": ({"evaluate": {"position_edges": [0, 1.5]}}, "evaluate.position_edges: [0, 1.5] is not of"),
    "gate-concurrency-negative": (
        {"register": {"gate_concurrency": -1}},
        "register.gate_concurrency must be an integer >= 0",
    ),
    "gate-concurrency-unmeasured": (
        {"register": {"gate_concurrency": 4}},
        "register.gate_concurrency 4 needs the load sweep to measure concurrency 4",
    ),
    "load-repeats-zero": ({"evaluate": {"load": {"repeats": 0}}}, "evaluate.load.repeats must be an integer >= 1"),
    "engine-replicas-zero": (
        {"extract": {"engine": "vllm", "engine_replicas": 0}},
        "extract.engine_replicas must be an integer >= 1",
    ),
    "ignore-eos-not-bool": ({"evaluate": {"ignore_eos": "yes"}}, "evaluate.ignore_eos"),
    "time-local-not-bool": ({"evaluate": {"time_local": 0}}, "evaluate.time_local"),
    "compiled-not-bool": ({"evaluate": {"compiled": "yes"}}, "evaluate.compiled"),
    "eval-threads-negative": ({"evaluate": {"threads": -1}}, "evaluate.threads must be an integer >= 0"),
    "parallel-with-tree": (
        {"train": {"variant": "parallel"}, "evaluate": {"spec": {"method": "tree", "topk": 2, "budget": 8}}},
        "train.variant 'parallel' drafts chains",
    ),
    "gate-speedup-zero": ({"register": {"gate_min_speedup": 0}}, "register.gate_min_speedup must be a finite number"),
    "gate-speedup-nan": (
        {"register": {"gate_min_speedup": float("nan")}},
        "register.gate_min_speedup must be a finite number > 0, got nan",
    ),
    **CONFIG_ROWS,
}
CONFIG_ON_EVALUATE = ("speed-budget-inf", "load-k-above-16", "edges-descending")

# serve's rollback flags (components/serving/monitor.py `RollbackConfig`, flows/commands.py), as the table's ROWS
SERVE_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    "serve-rollback-window-zero": (
        EMPTY,
        _with(SERVE, rollback_window="0"),
        {},
        "argument --rollback-window: '0': the interval must be > 0 seconds",
    ),
    "serve-rollback-floor-below-one": (
        EMPTY,
        _with(SERVE, rollback_floor="0.5"),
        {},
        "monitor.rollback.floor_tau must be a finite number >= 1",
    ),
}

# real checkpoints the pipeline does not support yet (components/targets/target.py `check_target`,
# flows/preflight_context.py `check_context`): id -> (state dir, argv, environment, needle), as the table's ROWS
MODEL_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    "train-target-family-unproven": (
        EMPTY,
        _with(TRAIN, target="{t_phi3}"),
        {},
        "config.json: model_type 'phi3' "
        "(architectures ['Phi3ForCausalLM']) is not a family this pipeline is proven on "
        "(llama, mistral, qwen2, qwen3, qwen3_moe",
    ),
    "train-target-no-chat-template": (
        EMPTY,
        _with(TRAIN, target="{t_nochat}"),
        {},
        "{t_nochat}: the tokenizer has no chat template; add one",
    ),
    "train-target-context-below-extract-max-len": (
        EMPTY,
        _with(TRAIN, target="{t_short}"),
        {},
        "{t_short}/config.json: max_position_embeddings 128 is shorter than extract.max_len 192",
    ),
    "train-evaluate-new-tokens-fill-context": (
        EMPTY,
        [*TRAIN, "--set", "evaluate.spec.max_new_tokens=512"],
        {},
        "max_position_embeddings 512 leaves no room for a prompt beside evaluate.spec.max_new_tokens 512",
    ),
    "evaluate-heldout-prompt-beyond-context": (
        EMPTY,
        _with(EVAL, target="{t_short}", traffic="{heldlong_jsonl}"),
        {},
        "heldlong.jsonl: 1 of the 1 held-out prompts the evaluation takes",
    ),
    "train-target-dtype-float8": (
        EMPTY,
        _with(TRAIN, target="{t_fp8}"),
        {},
        "config.json: dtype 'float8_e4m3fn' is not one the engine runs a target in (float32, bfloat16, float16",
    ),
    "train-target-weights-int32": (
        EMPTY,
        _with(TRAIN, target="{t_int32}"),
        {},
        "model.safetensors: tensor model.layers.0.mlp.down_proj.weight is stored as I32",
    ),
}

# id -> (state dir, argv, environment, needle), as the table's ROWS
FILE_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    # files that are not what they seem (components/data/safe_read.py): encodings, structure, kinds of file, permissions
    "train-config-utf16": (
        EMPTY,
        _with(TRAIN, config="{c_utf16}"),
        {},
        "c_utf16.json: cannot read the config: not "
        "UTF-8 text: it starts with a UTF-16 (little-endian) byte-order mark; re-save it as UTF-8",
    ),
    "train-config-latin1": (
        EMPTY,
        _with(TRAIN, config="{c_latin1}"),
        {},
        "c_latin1.json: cannot read the config: not UTF-8 text: byte 0xe9 at offset",
    ),
    "train-config-utf8-bom-is-read": (
        EMPTY,
        _with(TRAIN, config="{c_bom}"),
        {},
        "c_bom.json: train.ttt.ttt_steps must be",
    ),  # the mark is skipped: the value behind it is what is refused
    "train-config-nested-too-deep": (
        EMPTY,
        _with(TRAIN, config="{c_deep}"),
        {},
        "c_deep.json: cannot read the config: JSON nested deeper than 64 levels",
    ),
    "train-config-a-million-keys": (EMPTY, _with(TRAIN, config="{c_keys}"), {}, "c_keys.json: unknown section 'k0'"),
    "train-config-unreadable": (
        EMPTY,
        _with(TRAIN, config="{c_unreadable}"),
        {},
        "c_unreadable.json: cannot read the config: cannot be read (",
    ),
    "train-config-is-a-fifo": (EMPTY, _with(TRAIN, config="{c_fifo}"), {}, "--config {c_fifo}: not a file"),
    "train-set-value-nested-too-deep": (
        EMPTY,
        [*TRAIN, "--set", "train.steps=" + "[" * 5000 + "]" * 5000],
        {},
        "train.steps: JSON nested deeper than 64 levels",
    ),
    "train-traffic-is-a-fifo": (
        EMPTY,
        _with(TRAIN, traffic="{fifo_jsonl}"),
        {},
        "fifo.jsonl: a named pipe (FIFO), not a regular file: reading it would wait for a writer",
    ),
    "train-heldout-is-a-fifo": (
        EMPTY,
        _with(TRAIN, heldout="{fifo_parquet}"),
        {},
        "fifo.parquet: a named pipe (FIFO), not a regular file",
    ),
    "train-traffic-is-a-device": (
        EMPTY,
        _with(TRAIN, traffic="{zero_jsonl}"),
        {},
        "zero.jsonl: a device, not a regular file",
    ),
    "train-traffic-is-a-socket": (
        EMPTY,
        _with(TRAIN, traffic="{sock_jsonl}"),
        {},
        "sock.jsonl: a socket, not a regular file",
    ),
    "train-traffic-unreadable": (
        EMPTY,
        _with(TRAIN, traffic="{unreadable_jsonl}"),
        {},
        "unreadable.jsonl: cannot be read (",
    ),
    "train-traffic-utf16": (
        EMPTY,
        _with(TRAIN, traffic="{u16_jsonl}"),
        {},
        "u16.jsonl:0: not UTF-8 text: it starts with a UTF-16 (little-endian) byte-order mark; re-save it as UTF-8",
    ),
    "train-traffic-utf16-no-bom": (
        EMPTY,
        _with(TRAIN, traffic="{u16nobom_jsonl}"),
        {},
        "u16nobom.jsonl:0: not UTF-8 text: it holds NUL bytes",
    ),
    "train-traffic-nested-too-deep": (
        EMPTY,
        _with(TRAIN, traffic="{deep_jsonl}"),
        {},
        "deep.jsonl:1: JSON nested deeper than 64 levels",
    ),
    "train-traffic-line-too-long": (
        EMPTY,
        _with(TRAIN, traffic="{huge_jsonl}"),
        {},
        "huge.jsonl:1: line too long: over 64 MiB",
    ),
    "train-traffic-dataset-state-utf16": (
        EMPTY,
        _with(TRAIN, traffic="{ds_u16}"),
        {},
        "state.json: not UTF-8 text: it starts with a UTF-16",
    ),
    "train-traffic-dataset-data-file-fifo": (
        EMPTY,
        _with(TRAIN, traffic="{ds_fifo}"),
        {},
        "data-00000-of-00001.arrow listed in {ds_fifo}/state.json: a named pipe (FIFO)",
    ),
    "evaluate-traffic-is-a-fifo": (EMPTY, _with(EVAL, traffic="{fifo_jsonl}"), {}, "fifo.jsonl: a named pipe"),
    "train-traffic-link-loop": (
        EMPTY,
        _with(TRAIN, traffic="{loop_jsonl}"),
        {},
        "loop.jsonl: a symbolic link loop or a link to nothing; point the link at the file itself",
    ),
    "train-target-config-utf16": (
        EMPTY,
        _with(TRAIN, target="{t_u16}"),
        {},
        "config.json: not UTF-8 text: it starts with a UTF-16 (little-endian) byte-order mark",
    ),
    "train-target-config-utf8-bom": (
        EMPTY,
        _with(TRAIN, target="{t_bom}"),
        {},
        "config.json: starts with a UTF-8 byte-order mark, which transformers, vLLM and the head loader refuse",
    ),
    "train-target-config-nested-too-deep": (
        EMPTY,
        _with(TRAIN, target="{t_deep}"),
        {},
        "config.json: JSON nested deeper than 64 levels",
    ),
    "train-target-tokenizer-latin1": (
        EMPTY,
        _with(TRAIN, target="{t_toklatin1}"),
        {},
        "tokenizer.json: not UTF-8 text: byte 0xe9",
    ),
    "train-target-tokenizer-config-fifo": (
        EMPTY,
        _with(TRAIN, target="{t_fifo}"),
        {},
        "tokenizer_config.json: a named pipe (FIFO)",
    ),
    "evaluate-head-config-utf16": (
        EMPTY,
        _with(EVAL, head="{h_u16}"),
        {},
        "config.json: not UTF-8 text: it starts with a UTF-16",
    ),
    "evaluate-head-meta-nested-too-deep": (
        EMPTY,
        _with(EVAL, head="{h_deep}"),
        {},
        "eagle_head.json: JSON nested deeper than 64 levels",
    ),
    "evaluate-head-weights-fifo": (EMPTY, _with(EVAL, head="{h_fifo}"), {}, "model.safetensors: a named pipe (FIFO)"),
    "evaluate-head-config-link-loop": (EMPTY, _with(EVAL, head="{h_loop}"), {}, "config.json: a symbolic link loop"),
    "serve-head-meta-utf8-bom": (
        EMPTY,
        [*_with(SERVE, head="{h_bom}"), "--print-only"],
        {},
        "eagle_head.json: starts with a UTF-8 byte-order mark",
    ),
    # programs and directories the project runs or writes (infra/settings.py `Settings.check`)
    "vllm-python-missing": (
        EMPTY,
        TRAIN,
        {"EAGLE_VLLM_PYTHON": "/no/such/python"},
        "EAGLE_VLLM_PYTHON=/no/such/python: no such file",
    ),
    "vllm-python-not-executable": (
        EMPTY,
        TRAIN,
        {"EAGLE_VLLM_PYTHON": "{noexec}"},
        "EAGLE_VLLM_PYTHON={noexec}: not executable, mode 644",
    ),
    "vllm-python-is-a-directory": (EMPTY, TRAIN, {"EAGLE_VLLM_PYTHON": "{dir}"}, "a directory, not a program"),
    "eagle-home-parent-is-a-file": ("parent-file", TRAIN, {}, "/a-file is a file, not a directory"),
    "eagle-home-folder-is-a-file": ("folder-file", TRAIN, {}, "its folder runs/ is a file, not a directory"),
    "eagle-home-folder-not-writable": ("folder-ro", TRAIN, {}, "its folder mlartifacts/ is not writable"),
    "tmpdir-missing": (EMPTY, TRAIN, {"TMPDIR": "/no/such/tmp"}, "TMPDIR=/no/such/tmp: no such directory"),
    "tmpdir-is-a-file": (EMPTY, TRAIN, {"TMPDIR": "{traffic}"}, "TMPDIR={traffic}: a file, not a directory"),
    "tmpdir-not-writable": (EMPTY, TRAIN, {"TMPDIR": "/proc"}, "TMPDIR=/proc: not writable"),
    **MODEL_ROWS,
    **SERVE_ROWS,
}


class RowTimedOut(BaseException):
    """Not an Exception: the CLI's catch-all must not turn it into an exit code."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise `RowTimedOut` in this (the main) thread after `seconds`. The signal is sent to this thread itself: one
    sent to the process may land in another of its threads and leave a blocked open() of a named pipe blocked."""

    def expire(signum, frame):
        raise RowTimedOut(f"no answer in {seconds} s: the refusal must come within seconds, before any read blocks")

    previous = signal.signal(signal.SIGALRM, expire)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.get_ident(), signal.SIGALRM))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)
