"""Build the embedded default offline: tokenizer, Llama target, its fine-tune and traffic, cached by content hash.

Purpose: `build_embedded(config, root)` reads the interpreter's standard library (`corpus.py`), and writes under
`root/<hash>/` (default root `.eagle/embedded` in the working directory):
  tokenizer/   byte-level BPE + chat template (`AutoTokenizer.from_pretrained` loads it)
  target/      the base Llama target (`AutoModelForCausalLM.from_pretrained`), with tokenizer + generation config
  finetune/    the target after continued training on the test-suite domain, saved the same way
  traffic/     target-{train,heldout}.jsonl and finetune-{train,heldout}.jsonl (OpenAI `messages` JSONL) of the
               kind `traffic.kind` names ("chat" by default; "long": `long_traffic.py`)
  report.json  the `EmbeddedResult`: paths, weight hashes, measured metrics
The hash covers the corpus files (paths, contents, split), the config, the code of the modules that shape the output
(`OUTPUT_MODULES`, docstrings and comments left out), the traffic writer's version and the versions of
torch/transformers/tokenizers; a finished build (its report.json exists) is returned without work. A build is
written to `<hash>.partial-<pid>` and renamed when complete, so an interrupted build leaves no half directory.
Run: `python -m embedded --preset default` (see `__main__.py`).
Not here: EAGLE heads, MLflow registration, Prefect; bitwise reproducibility across machines or thread counts
(the same machine, config and seed give the same data, tokenizer and initial weights; float reductions may vary).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from components.data.traffic_io import WRITER_VERSION, Conversation, write_openai_jsonl
from eagle.target_path import cpu_threads
from embedded import corpus as corpus_mod
from embedded import lm_train
from embedded.config import EmbeddedConfig, LMTrainConfig
from embedded.corpus import Domain
from embedded.long_traffic import long_conversations
from embedded.result import (
    REPORT,
    Continuation,
    DomainInfo,
    EmbeddedResult,
    Metrics,
    TrafficFiles,
    load_result,
    write_report,
)
from embedded.tokenizer import BOS, encode_texts, render_chat, train_tokenizer
from embedded.traffic import domain_conversations, sample_traffic

log = logging.getLogger(__name__)
DEFAULT_ROOT = Path(".eagle/embedded")
HASH_CHARS = 16


@dataclass(frozen=True)
class DomainData:
    """One domain's conversation pools and tokenised documents (chat samples and raw chunks) per split."""

    domain: Domain
    pools: dict[str, list[Conversation]]  # "train" | "heldout"
    chat_ids: dict[str, list[list[int]]]
    raw_ids: dict[str, list[list[int]]]


def load_domains(cfg: EmbeddedConfig) -> tuple[Domain, Domain]:
    base = corpus_mod.split_domain("stdlib", corpus_mod.base_files(cfg.corpus), cfg.corpus.heldout_fraction)
    name, files, is_code = corpus_mod.finetune_files(cfg.corpus)
    return base, corpus_mod.split_domain(name, files, cfg.corpus.heldout_fraction, is_code)


# the modules whose code shapes what a build writes; config.py is left out (the config's values are hashed, its checks
# change nothing written), as are __init__.py and the CLI
OUTPUT_MODULES = ("build.py", "corpus.py", "lm_train.py", "long_traffic.py", "result.py", "tokenizer.py", "traffic.py")


def code_digest(source: str) -> bytes:
    """A module's code without its docstrings and comments: what `code_sha256` hashes, so that editing prose does
    not throw away every build (and the benchmarks' heads cached under its hash)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False).encode()


def code_sha256() -> str:
    """sha256 of the code (`code_digest`) of `OUTPUT_MODULES` and of the traffic writer's version number (the
    loaders in `components/data/traffic_io.py` can change without changing a byte of what the build writes)."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in OUTPUT_MODULES:
        h.update(name.encode() + b"\0" + code_digest((here / name).read_text()))
    h.update(f"traffic_io.WRITER_VERSION={WRITER_VERSION}".encode())
    return h.hexdigest()


def build_hash(cfg: EmbeddedConfig, base: Domain, finetune: Domain) -> str:
    payload = {
        "config": cfg.to_dict(),
        "corpus": [base.sha256, finetune.sha256],
        "code": code_sha256(),
        "versions": [torch.__version__, transformers.__version__, tokenizers.__version__],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_embedded(
    config: EmbeddedConfig | None = None, root: Path | str = DEFAULT_ROOT, *, force: bool = False, progress: bool = True
) -> EmbeddedResult:
    """Build (or find in the cache) the embedded default; see the module docstring for what lands where."""
    cfg = config or EmbeddedConfig.default()
    start = time.perf_counter()
    base, finetune = load_domains(cfg)
    full_hash = build_hash(cfg, base, finetune)
    out = Path(root) / full_hash[:HASH_CHARS]
    if not force and (out / REPORT).is_file():
        log.info("embedded build %s found in %s; skipping", full_hash[:HASH_CHARS], out)
        return load_result(out, cached=True)

    def build(tmp: Path) -> None:
        with cpu_threads(cfg.train.num_threads):  # evaluation too; the fine-tune sets its own
            _build_into(tmp, cfg, base, finetune, full_hash, start, progress)

    build_whole(out, build)
    return load_result(out, cached=False)


def build_whole(out: Path, build) -> None:
    """`build(tmp)` into `<out>.partial-<pid>`, renamed to `out` once complete: an interrupted build leaves no half
    directory (the partial one is removed on any exception, Ctrl-C included)."""
    tmp = out.parent / f"{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _build_into(
    tmp: Path, cfg: EmbeddedConfig, base: Domain, finetune: Domain, full_hash: str, start: float, progress: bool
) -> EmbeddedResult:
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(
        [f.text for f in base.train], cfg.tokenizer, progress, model_max_length=cfg.target.max_position_embeddings
    )
    tokenizer_seconds = time.perf_counter() - t0
    tokenizer.save_pretrained(tmp / "tokenizer")
    data = [_domain_data(d, cfg, tokenizer, progress) for d in (base, finetune)]

    target = lm_train.make_target(cfg.target, tokenizer, cfg.seed)
    target_stats = _train_on(target, data[0], cfg.train, cfg.seed, "target", progress)
    weights = {"target": lm_train.save_target(target, tokenizer, tmp / "target")}
    tuned = LlamaForCausalLM.from_pretrained(tmp / "target", dtype=torch.float32)
    finetune_stats = _train_on(tuned, data[1], cfg.finetune, cfg.seed + 1, "finetune", progress)
    weights["finetune"] = lm_train.save_target(tuned, tokenizer, tmp / "finetune")

    traffic = [
        _write_traffic(tmp / "traffic", role, d, cfg, tokenizer)
        for role, d in (("target", data[0]), ("finetune", data[1]))
    ]
    loss, agreement = _evaluate(target, tuned, data, cfg)
    heldout = sum(loss["target"][base.name].values()) / len(loss["target"][base.name])
    continuations = _continuations(target, tuned, tokenizer, data, cfg)
    metrics = Metrics(
        build_seconds=round(time.perf_counter() - start, 1),
        tokenizer_seconds=round(tokenizer_seconds, 2),
        target_train=target_stats,
        finetune_train=finetune_stats,
        heldout_loss=heldout,
        heldout_perplexity=math.exp(heldout),
        loss=loss,
        top1_agreement=agreement,
        continuations=tuple(continuations),
    )
    result = EmbeddedResult(
        build_dir=tmp,
        build_hash=full_hash,
        cached=False,
        tokenizer_dir=tmp / "tokenizer",
        target_dir=tmp / "target",
        finetune_dir=tmp / "finetune",
        target_traffic=traffic[0],
        finetune_traffic=traffic[1],
        weights_sha256=weights,
        domains=tuple(DomainInfo(d.name, len(d.train), len(d.heldout), d.sha256) for d in (base, finetune)),
        metrics=metrics,
        config=cfg,
        environment=_environment(cfg),
    )
    write_report(result)
    return result


def _environment(cfg: EmbeddedConfig) -> dict[str, str]:
    """What the timings depend on. The CPU count is the machine's; other processes may share those cores."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": cfg.train.device,
        "torch_threads": str(torch.get_num_threads()),
        "cpu_count": str(os.cpu_count()),
        "load_average_1m": f"{os.getloadavg()[0]:.2f}",
    }


def _domain_data(domain: Domain, cfg: EmbeddedConfig, tokenizer: PreTrainedTokenizerBase, progress: bool) -> DomainData:
    pools, chat, raw = {}, {}, {}
    for split, files in (("train", domain.train), ("heldout", domain.heldout)):
        pools[split] = domain_conversations(files, domain.name, domain.is_code, cfg.corpus, cfg.traffic, cfg.seed)
        texts = [render_chat([{"role": m.role, "content": m.content} for m in c.messages]) for c in pools[split]]
        chat[split] = encode_texts(tokenizer, texts, f"{domain.name}/{split} chat", progress)
        chunks = [BOS + c for f in files for c in corpus_mod.raw_chunks(f, cfg.corpus.chunk_lines)]
        raw[split] = encode_texts(tokenizer, chunks, f"{domain.name}/{split} raw", progress)
    return DomainData(domain, pools, chat, raw)


def _train_on(
    model: LlamaForCausalLM, data: DomainData, tcfg: LMTrainConfig, seed: int, desc: str, progress: bool
) -> lm_train.TrainStats:
    windows_NT = lm_train.pack_windows(
        data.chat_ids["train"],
        data.raw_ids["train"],
        tcfg.steps * tcfg.batch_size,
        tcfg.seq_len,
        tcfg.raw_fraction,
        seed,
    )
    stats = lm_train.train(model, windows_NT, tcfg, seed, f"{desc} ({data.domain.name})", progress)
    log.info(
        "%s: %d steps, %.0f tokens/s, loss %.3f -> %.3f",
        desc,
        stats.steps,
        stats.tokens_per_second,
        stats.first_loss,
        stats.last_loss,
    )
    return stats


def _write_traffic(
    out: Path, role: str, data: DomainData, cfg: EmbeddedConfig, tokenizer: PreTrainedTokenizerBase
) -> TrafficFiles:
    pools = data.pools if cfg.traffic.kind == "chat" else _long_pools(data.domain, cfg, tokenizer)
    train = sample_traffic(pools["train"], cfg.traffic.train_conversations, cfg.seed, f"{role}-train")
    held = sample_traffic(pools["heldout"], cfg.traffic.heldout_conversations, cfg.seed, f"{role}-heldout")
    paths = out / f"{role}-train.jsonl", out / f"{role}-heldout.jsonl"
    shas = write_openai_jsonl(paths[0], train), write_openai_jsonl(paths[1], held)
    return TrafficFiles(paths[0], paths[1], shas[0], shas[1], len(train), len(held))


def _long_pools(
    domain: Domain, cfg: EmbeddedConfig, tokenizer: PreTrainedTokenizerBase
) -> dict[str, list[Conversation]]:
    """The `long` kind's conversations per split; an error when a split has none (the context is too short for
    `long_min_new_tokens`, or no file is long enough)."""
    t = cfg.traffic
    pools = {
        split: long_conversations(files, domain.name, tokenizer, t, cfg.target.max_position_embeddings, cfg.seed)
        for split, files in (("train", domain.train), ("heldout", domain.heldout))
    }
    for split, pool in pools.items():
        if not pool:
            raise ValueError(
                f"traffic.kind 'long': no {split} file of {domain.name!r} has an answer of "
                f">= {t.long_min_new_tokens} tokens after its first {t.long_prompt_lines} lines "
                f"within the target's {cfg.target.max_position_embeddings} positions; lower "
                "traffic.long_min_new_tokens or raise target.max_position_embeddings"
            )
    return pools


def _evaluate(
    target: LlamaForCausalLM, tuned: LlamaForCausalLM, data: list[DomainData], cfg: EmbeddedConfig
) -> tuple[dict, dict[str, float]]:
    """Held-out losses of both models per domain and kind, and their top-1 agreement per domain."""
    loss: dict[str, dict[str, dict[str, float]]] = {"target": {}, "finetune": {}}
    agreement = {}
    n, seq = cfg.eval.eval_windows, cfg.train.seq_len
    for d in data:
        agree_by_kind = []
        for kind, docs in (("raw", d.raw_ids["heldout"]), ("chat", d.chat_ids["heldout"])):
            if not docs:
                continue
            windows_NT = lm_train.pack_windows([], docs, n, seq, 1.0, cfg.seed)
            la, lb, agree = lm_train.compare(target, tuned, windows_NT, cfg.train)
            loss["target"].setdefault(d.domain.name, {})[kind] = la
            loss["finetune"].setdefault(d.domain.name, {})[kind] = lb
            agree_by_kind.append(agree)
        agreement[d.domain.name] = sum(agree_by_kind) / len(agree_by_kind)
    return loss, agreement


def _continuations(
    target: LlamaForCausalLM,
    tuned: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    data: list[DomainData],
    cfg: EmbeddedConfig,
) -> list[Continuation]:
    out = []
    for d in data:
        pool = sorted(d.pools["heldout"], key=lambda c: (c.segment != "complete", c.id))
        for conv in pool[: cfg.eval.continuations]:
            last_user = max(i for i, m in enumerate(conv.messages) if m.role == "user")
            prompt = [{"role": m.role, "content": m.content} for m in conv.messages[: last_user + 1]]
            ids = tokenizer(render_chat(prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            reference = conv.messages[last_user + 1].content if last_user + 1 < len(conv.messages) else ""
            gen = [lm_train.greedy(m, tokenizer, ids, cfg.eval.max_new_tokens) for m in (target, tuned)]
            out.append(Continuation(d.domain.name, conv.segment or "", prompt[-1]["content"], reference, *gen))
    return out
