"""Extraction through the serving engine: the feature shards computed by vLLM instead of this process.

Purpose: with `extract.engine: vllm`, `components.extract.stage.extract` tokenises, counts and writes the manifest as
for local extraction, and hands the shards to `run_in_engine(...)`, which starts vLLM (infra/vllm_extract.py:
`extract_hidden_states` at the fused ids plus the last layer id N, a hidden-states KV connector writing one file per
request under `OUT/engine-hidden-states/`), sends each sequence's token ids exactly as local extraction tokenised
them (`max_tokens` 1, `extract.batch_size` requests in flight), and builds the same shard as local extraction
(components/extract/feature_shards.py `pack_shard`, the same dtypes, fp8 included):
- aux_hidden_states [T, 3H]: the engine's ids k (inputs of decoder layers k), concatenated in ascending order;
- last_hidden_state [T, H]: the engine's id N (the residual before the final norm) through the target's final
  RMSNorm, its weight read by tensor name from the target's safetensors (`target_final_norm`), which is what local
  extraction stores (the decoder's output); the teacher is computed from it with `lm_head` as for local shards.
On the CPU build each engine's KV cache is sized for the requests in flight (`kv_cache_bytes`: `extract.batch_size`
sequences of `max_len + 1` tokens, twice over, at least 256 MiB) instead of vLLM's share of host memory (a quarter:
about 6 GB on a 24 GB machine), so an engine takes about its weights plus 1 GB and several fit one host.
The engine's files of a shard are deleted once the shard's bytes are built, so they take at most one shard's
`seqs_per_shard x T x 4 x H` values of the engine's dtype on disk per engine; a killed run resumes at the shard it
was on (the resume rule of components/extract/stage.py) and clears the files it left. Our process never loads the whole
target: `target_heads` reads the embedding and `lm_head` by name too (the embedding when the weights are tied).
Replicas: `extract.engine_replicas` N > 1 starts N engines, one per Ray actor (`EngineReplica`, the actor pool of
infra/actor_pool.py: a shard per task, the next to whichever replica returns first, on the Ray of
RAY_ADDRESS or a local one started here). Each replica starts its engine at its first shard (its own storage
directory, its own log under the state dir's `vllm/`) and returns each shard's bytes; this process writes them as
with one engine, so the files, the manifest and resume are the same. A replica whose engine dies mid-shard ends
itself; Ray restarts it once (a new engine) and retries that shard, so nothing is lost or written twice. Every
engine runs in its own process group, killed when its actor ends (the leader's parent-death signal) and by
`stop_engines` here on any exit (the engines of this host; on other nodes of a cluster the parent-death signal
alone).
Measured on the tiny fp32 target (tests/test_extract_engine.py, tests/test_extract_replicas.py): features equal to
local extraction's within 1e-5 relative, with one engine or two replicas.
Run: `extract(ExtractConfig(engine="vllm"), ...)`, or `{"extract": {"engine": "vllm", "engine_replicas": 2}}` in a
pipeline config; needs vLLM's venv (`make vllm`) or EAGLE_VLLM_PYTHON.
Not here: the vLLM process (infra/), the shard format (components/extract/feature_shards.py) and resume rule
(components/extract/stage.py), a replica spanning several GPUs (each replica asks Ray for one GPU when `extract.device`
is CUDA), and targets whose final norm is not an RMSNorm (Gemma's (1 + w), LayerNorm with bias: refused).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from components.data.atomic import atomic_write_text
from components.targets.target import TargetError, declared_dtype, read_tensors

STORAGE = "engine-hidden-states"  # under the extraction's out_dir: the engine's per-request files, one shard's worth
MIN_KV_CACHE = 256 << 20  # bytes: the least KV cache an extraction engine is given on the CPU build
DEATH_WAIT_S = 20.0  # after a failed request, how long a replica waits to see whether its engine is dying
PID_FILE = "engine.pid"  # in each engine replica's storage directory: its engine's pid (= process group)
# in the environment of every process of an extraction engine (its children inherit it): its storage directory, so
# that `stop_engines` also finds an engine's processes that outlived their leader (a replica's actor that died while
# its engine ran: the leader dies with its parent, vLLM's EngineCore and workers are left behind)
ENGINE_MARK = "EAGLE_EXTRACT_ENGINE_STORAGE"
NORM, EMBED, LM_HEAD = "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm: weight_H (float32) and eps."""

    weight_H: Any
    eps: float

    def __call__(self, x_TH):
        import torch

        x = x_TH.float()
        return self.weight_H * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def target_final_norm(target_dir: str, config) -> FinalNorm:
    """The final norm of a Llama / Mistral / Qwen2 / Qwen3-family target, read by tensor name."""
    model_type = str(getattr(config, "model_type", ""))
    found = read_tensors(target_dir, [NORM, NORM.replace(".weight", ".bias")])
    if model_type.startswith("gemma") or len(found) != 1 or NORM not in found:
        raise TargetError(
            f"{target_dir}: extraction through the engine needs a final RMSNorm `{NORM}` (no bias, "
            f"Llama/Mistral/Qwen families); this {model_type or 'model'} target has "
            f"{sorted(found) or 'none'}: use extract.engine 'local'"
        )
    return FinalNorm(found[NORM].float(), float(getattr(config, "rms_norm_eps", 1e-6)))


def target_heads(target_dir: str, config) -> dict:
    """{"embed_tokens", "lm_head"} (float32) by tensor name; `lm_head` is the embedding when the weights are tied."""
    found = read_tensors(target_dir, [EMBED, LM_HEAD])
    if EMBED not in found:
        raise TargetError(
            f"{target_dir}: its safetensors have no `{EMBED}`; extraction through the engine reads the "
            "embedding by that name (Llama/Mistral/Qwen families): use extract.engine 'local'"
        )
    if LM_HEAD not in found and not getattr(config, "tie_word_embeddings", False):
        raise TargetError(
            f"{target_dir}: its safetensors have no `{LM_HEAD}` and config.json does not tie it to the "
            "embedding (tie_word_embeddings); the weights are incomplete"
        )
    embed = found[EMBED].float().contiguous()
    return {"embed_tokens": embed, "lm_head": found[LM_HEAD].float().contiguous() if LM_HEAD in found else embed}


def engine_features(hidden_TnH, norm: FinalNorm):
    """(aux_hidden_states [T, 3H], last_hidden_state [T, H]) from the engine's [T, 4, H] (three fused ids, then N)."""
    T, n, H = hidden_TnH.shape
    return hidden_TnH[:, : n - 1].reshape(T, (n - 1) * H), norm(hidden_TnH[:, n - 1])


def engine_shard(server, norm: FinalNorm, part: list, dtype: str, pool: ThreadPoolExecutor) -> bytes:
    """One shard's safetensors bytes from a running engine (the sequences' requests in flight on `pool`'s threads);
    the engine's files of the shard are deleted once its bytes are built."""
    from components.extract.feature_shards import pack_shard
    from infra.vllm_extract import load_hidden_states, remove_hidden_states, request_hidden_states

    paths = list(pool.map(lambda s: request_hidden_states(server, s[0]), part))
    try:
        hidden = (load_hidden_states(p, s) for p, (s, _) in zip(paths, part))
        return pack_shard(part, (engine_features(h, norm) for h in hidden), dtype)
    finally:
        for p in paths:
            remove_hidden_states(p)


@dataclass(frozen=True)
class EngineShape:
    """What every engine of a run is started with: `hidden_states_spec`'s arguments but the storage directory."""

    layer_ids: tuple[int, ...]  # the fused ids, then N
    max_model_len: int
    dtype: str
    context: int | None
    kv_cache_bytes: int  # on the CPU build (a GPU engine takes vLLM's share of its device)

    def spec(self, target_dir: str, storage: Path):
        """The engine writing under `storage`, every process of it marked with that directory (`ENGINE_MARK`)."""
        import dataclasses

        from infra.vllm_extract import hidden_states_spec

        spec = hidden_states_spec(
            target_dir,
            list(self.layer_ids),
            storage,
            self.max_model_len,
            self.dtype,
            context=self.context,
            kv_cache_bytes=self.kv_cache_bytes,
        )
        return dataclasses.replace(spec, env=(*spec.env, (ENGINE_MARK, str(Path(storage).resolve()))))


def kv_cache_bytes(config, n_ids: int, max_model_len: int, requests: int, dtype: str) -> int:
    """The KV cache an extraction engine needs: `requests` sequences of `max_model_len` tokens in flight, each token
    holding K and V of every decoder layer and the cached hidden states (n_ids x H, as K and V), twice over (block
    rounding, the scheduler's slack); at least MIN_KV_CACHE. A share of host memory (vLLM's CPU default) is GBs."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    width = 2 * int(config.num_hidden_layers) * kv_heads * head_dim + 2 * n_ids * hidden
    return max(MIN_KV_CACHE, 2 * width * (4 if dtype == "float32" else 2) * max_model_len * requests)


@dataclass(frozen=True)
class CaptureTarget:
    """The target whose hidden states the engine captures: its directory, its config (transformers'), and the layer
    ids whose inputs the head fuses."""

    target_dir: str
    config: Any
    layer_ids: list[int]


def run_in_engine(
    cfg,
    target: CaptureTarget,
    pending: dict[int, list],
    finish: Callable[[int, bytes, float], None],
    out: Path,
    settings=None,
    progress: Callable[[str], None] = print,
) -> None:
    """Compute every pending shard (index -> sequences (input_ids, loss_mask)) in one vLLM started here, or in
    `cfg.engine_replicas` engines on Ray (`run_on_replicas`); `finish(shard, bytes, seconds)` writes each.
    `settings`: infra.settings.Settings (None: from the environment)."""
    from infra.settings import Settings
    from infra.vllm_server import VllmServer

    target_dir, config, layer_ids = target.target_dir, target.config, target.layer_ids
    settings = settings or Settings.from_env()
    norm = target_final_norm(target_dir, config)
    storage = out / STORAGE
    stop_engines(storage)  # engines and files a killed run left
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    replicas = min(cfg.engine_replicas, len(pending))
    ids, dtype = (*layer_ids, int(config.num_hidden_layers)), declared_dtype(target_dir)
    shape = EngineShape(
        ids,
        cfg.max_len + 1,
        dtype,
        getattr(config, "max_position_embeddings", None),
        kv_cache_bytes(config, len(ids), cfg.max_len + 1, cfg.batch_size, dtype),
    )
    if replicas > 1:
        progress(
            f"extract (vLLM): {replicas} engine replicas on Ray for layer ids {list(ids)} ({len(pending)} "
            f"shards; their logs under {settings.state_dir / 'vllm'})"
        )
        try:
            run_on_replicas(
                ReplicaSetup(cfg, target_dir, norm, shape, str(storage), settings), replicas, pending, finish, progress
            )
        finally:
            stop_engines(storage)
    else:
        progress(f"extract (vLLM): starting the engine for layer ids {list(ids)} ({len(pending)} shards)")
        with (
            VllmServer(shape.spec(target_dir, storage), settings) as server,
            ThreadPoolExecutor(max_workers=cfg.batch_size) as pool,
        ):
            for k, part in pending.items():
                t0 = time.perf_counter()
                finish(k, engine_shard(server, norm, part, cfg.dtype, pool), time.perf_counter() - t0)
    shutil.rmtree(storage, ignore_errors=True)


@dataclass(frozen=True)
class ReplicaPool:
    """The actors `infra.actor_pool.run_on_ray` starts for engine replicas: how many, the CPUs of each, and
    `device` (CUDA: one GPU each, the engine's)."""

    num_workers: int
    cpus_per_worker: int
    device: str


@dataclass(frozen=True)
class ReplicaSetup:
    """What every `EngineReplica` starts its engine from: the extract config, the target, its final norm, the
    engine's shape, the storage root (a directory of its own below it per replica), the settings."""

    cfg: Any
    target_dir: str
    norm: FinalNorm
    shape: EngineShape
    storage: str
    settings: Any


class EngineReplica:
    """A Ray actor's state: one vLLM of its own, started at its first shard with a storage directory of its own
    under `setup.storage` (its engine's process group recorded there, `PID_FILE`), and the target's final norm."""

    def __init__(self, pool: ReplicaPool, setup: ReplicaSetup):
        self.cfg, self.target_dir, self.norm, self.shape, self.settings = (
            setup.cfg,
            setup.target_dir,
            setup.norm,
            setup.shape,
            setup.settings,
        )
        self.storage = Path(setup.storage) / f"replica-{uuid.uuid4().hex[:12]}"
        self.requests = ThreadPoolExecutor(max_workers=setup.cfg.batch_size)
        self.server = None

    def run(self, shard: int, seqs: list) -> bytes:
        from infra.vllm_server import EngineError

        if self.server is None:  # in the first task, so a start error is that task's error, raised as itself
            self.storage.mkdir(parents=True, exist_ok=True)
            spec = self.shape.spec(self.target_dir, self.storage)
            server = _recorded_server(spec, self.settings, self.storage / PID_FILE)
            try:
                self.server = server.start()
            except EngineError:
                if server.proc is not None and (server.proc.returncode or 0) < 0:  # killed by a signal while starting:
                    kill_group(server.proc.pid)  # a death, not a bad setup; Ray restarts the replica once, as below
                    os._exit(1)
                raise
        try:
            return engine_shard(self.server, self.norm, list(seqs), self.cfg.dtype, self.requests)
        except EngineError:
            proc = self.server.proc
            if proc is not None and _exits(proc, DEATH_WAIT_S):  # its engine died mid-shard: the replica ends too,
                kill_group(proc.pid)  # and Ray restarts it once (a new engine) and retries this shard
                os._exit(1)
            raise


def _recorded_server(spec, settings, pid_file: Path):
    """A VllmServer that writes its engine's pid (= process group) to `pid_file` as soon as the engine is spawned,
    before waiting for it to be healthy, so that `stop_engines` also finds an engine still starting."""
    from infra.vllm_server import VllmServer

    class Recorded(VllmServer):
        def _wait_healthy(self) -> None:  # VllmServer.start calls it right after spawning the engine
            atomic_write_text(pid_file, str(self.proc.pid))  # `stop_engines` may read it at any moment
            super()._wait_healthy()

    return Recorded(spec, settings)


def _exits(proc, wait_s: float) -> bool:
    """Whether the process ends within `wait_s` (a killed engine's connections reset before it has exited)."""
    try:
        proc.wait(wait_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def run_on_replicas(
    setup: ReplicaSetup,
    replicas: int,
    pending: dict[int, list],
    finish: Callable[[int, bytes, float], None],
    progress: Callable[[str], None],
) -> None:
    """Every pending shard computed by `replicas` `EngineReplica` actors (`setup.cfg.cpus_per_worker` CPUs each), a
    shard per task, on the Ray of `setup.settings` (a local one started here when RAY_ADDRESS is unset); `finish` in
    this process as each shard returns, so the files and the resume rule are those of one engine."""
    from infra.actor_pool import run_on_ray

    from ray.exceptions import RayTaskError

    pool = ReplicaPool(replicas, setup.cfg.cpus_per_worker, setup.cfg.device)
    try:
        run_on_ray(pool, EngineReplica, (setup,), pending, finish, "extract", setup.settings, progress)
    except RayTaskError as e:  # an error inside a replica (an engine that cannot start): raised as itself
        raise (e.cause if isinstance(e.cause, Exception) else e) from None


def stop_engines(storage: Path, wait_s: float = 30.0) -> None:
    """Kill the process group of every replica's engine recorded under `storage` (those of this host), and wait up
    to `wait_s` for the groups to be gone (reaped), so their memory is free for what runs next."""
    pids = []
    for f in storage.glob(f"*/{PID_FILE}"):
        pids.append(int(f.read_text()))
        kill_group(pids[-1])
        f.unlink(missing_ok=True)
    for pid in marked_processes(storage):  # what outlived its group's leader (see ENGINE_MARK)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while (pids or marked_processes(storage)) and time.monotonic() < deadline:
        pids = [p for p in pids if _group_exists(p)]
        time.sleep(0.2)


def marked_processes(storage: Path) -> list[int]:
    """The live processes of this host whose environment marks them as an engine writing under `storage` or a
    directory below it (`ENGINE_MARK`); [] where /proc is not there."""
    root = str(Path(storage).resolve()).encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        for var in env.split(b"\0"):
            if var.startswith(ENGINE_MARK.encode() + b"=") and state != "Z":
                value = var.split(b"=", 1)[1]
                if value == root or value.startswith(root + b"/"):
                    found.append(int(entry.name))
                break
    return found


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by the engine `pid`, unless that pid now belongs to another program (a pid is
    not reused while its group has members, so a missing leader still means our group)."""
    proc = Path(f"/proc/{pid}")
    try:
        if (
            proc.exists()
            and b"vllm" not in (proc / "cmdline").read_bytes()
            and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        ):
            return
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, FileNotFoundError, PermissionError):
        pass
