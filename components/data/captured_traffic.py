"""Served traffic as training data: captured requests of one target version -> a plan for its next head's run.

Purpose: `prepare_capture_plan(cfg, capture_root, target_name, target_version, registered_traffic, out_dir,
regenerate_limit) -> CapturePlan` reads the capture files `eagle-heads serve --capture` wrote
(components/serving/capture.py, rows as components/data/capture_records.py describes them) and decides what the next
head of that target trains on:
- **Which rows.** Only rows the target being trained served: a file whose metadata names another target name or
  version is skipped whole (its rows counted under "served by NAME/VERSION, not ..."), and so are rows that cannot be
  a chat to train on (a /v1/completions request, an empty completion, a finish reason other than stop/length, messages
  the traffic rules refuse); every skip is counted by its reason (`CapturePlan.skipped`).
- **As they are.** A captured completion is the target's own output (speculative decoding is lossless), so nothing is
  regenerated: a greedy request (temperature 0) is exactly what regeneration would write, a sampled one is a sample
  of the target. Either way the head's teacher is the target's own distribution at every position, computed at
  extraction, so an earlier assistant turn the client wrote itself is context, not a label.
- **Held out.** The newest `cfg.heldout` distinct prompts (the messages before the served answer) are held out for
  the shadow test (components/evaluate/shadow.py) and never trained on: a training conversation with the same prompt as
  a held-out one is dropped too (`split_heldout`). The same conversation captured twice is trained on once.
- **Mixed.** The training conversations are `cfg.mix` captured and the rest the target version's registered traffic
  (its first conversations, regenerated as in any run), so the head does not forget what it was trained for
  (`mix_counts`: the newest captured are kept when the registered traffic is the shorter side).
`CapturePlan` (written as `plan.json` beside `captured.jsonl` and `heldout.jsonl` in `out_dir`) is what the
`train-head` flow takes (`capture_plan`): `applied(cfg)` sets `regenerate.limit` to the registered share, `add_to(
regen_dir)` writes the captured conversations beside the regenerated shards (`shard-captured.jsonl`, the form
components/regenerate/stage.py writes, so extraction reads both), `tags()` is the lineage the registry gets (which
capture files, how many conversations of each kind, the newest capture time used), and `sha256` enters the run key.
`new_conversations(root, name, version, after_ms)` counts what the target served since a time: the retrain trigger.
Run: `eagle-heads`' `retrain-on-capture` flow (flows/retrain_capture.py).
Not here: writing captures (components/serving/capture.py), measuring heads (components/evaluate/shadow.py), training
(flows/).
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from components.data.atomic import atomic_write_text
from components.data.capture_records import capture_files, file_target, read_rows
from components.data.traffic_io import Conversation, load_traffic, parse_record
from eagle.config_checks import NOT_IDENTITY, FieldError, at_least
from eagle.errors import BadInput

SEGMENT = "captured"
SHARD = "shard-captured.jsonl"  # beside regenerate's shards, read with them: components/data/regenerated.py


class CaptureError(BadInput):
    """Captured traffic that cannot make a run: too few conversations of the target, or no registered traffic."""


@dataclass(frozen=True)
class CapturedTrafficConfig:
    """Section `capture`: how a retrain on served traffic uses it (flows/retrain_capture.py)."""

    # what these three select enters the run key through the plan's hash, not through the config's
    mix: float = field(default=0.5, metadata=NOT_IDENTITY)  # share of captured conversations in training, (0, 1)
    heldout: int = field(default=16, metadata=NOT_IDENTITY)  # newest captured prompts held out for the shadow test
    trigger_new: int = field(default=256, metadata=NOT_IDENTITY)  # new captured conversations that start a retrain

    def __post_init__(self) -> None:
        if isinstance(self.mix, bool) or not 0.0 < self.mix < 1.0:
            raise FieldError(
                self,
                "mix",
                f"must be a number in (0, 1): the share of captured conversations in "
                f"training, the rest registered traffic so the head does not forget it; "
                f"got {self.mix!r}",
            )
        at_least(self, {"heldout": 1, "trigger_new": 1})

    @classmethod
    def tiny(cls) -> "CapturedTrafficConfig":
        return cls(mix=0.5, heldout=3, trigger_new=4)


@dataclass(frozen=True)
class Selection:
    """The usable captured conversations of one target version (oldest first) and what was left out, by reason."""

    conversations: list[Conversation]
    greedy: set[str]  # ids of the conversations whose request was greedy (temperature 0)
    times: dict[str, int]  # id -> arrival time (UTC, ms)
    limits: dict[str, int]  # id -> new tokens the target produced when served (else the request's max_tokens)
    files: list[str]  # capture files that held at least one row of this target version
    skipped: dict[str, int]


def select_captured(root: str | Path, target_name: str, target_version: int | str) -> Selection:
    """Every captured conversation that `target_name`/`target_version` served, as training conversations."""
    want = (target_name, str(target_version))
    skipped: collections.Counter = collections.Counter()
    convs, greedy, times, limits, files = [], set(), {}, {}, []
    for path in capture_files(root):
        try:
            name, version, n_rows = file_target(path)
        except (ValueError, OSError) as e:
            skipped[f"unreadable file ({type(e).__name__})"] += 1
            continue
        if (name, version) != want:
            skipped[f"served by {name}/{version or '?'}, not {want[0]}/{want[1]}"] += n_rows
            continue
        files.append(str(path))
        for row in read_rows(path):
            conv, reason = row_conversation(row, path.name)
            if conv is None:
                skipped[reason] += 1
                continue
            convs.append(conv)
            times[conv.id] = _ms(row.get("time"))
            if (n := row.get("completion_tokens") or row.get("max_new_tokens")) and n > 0:
                limits[conv.id] = int(n)
            if row.get("temperature") == 0:
                greedy.add(conv.id)
    convs.sort(key=lambda c: (times[c.id], c.id))
    return Selection(convs, greedy, times, limits, files, dict(skipped))


def row_conversation(row: dict[str, Any], source: str) -> tuple[Conversation | None, str]:
    """(the training conversation of a captured row, "") or (None, why it cannot be one)."""
    if row.get("endpoint") != "chat" or not row.get("messages"):
        return None, "a /v1/completions request (no chat messages)"
    if row.get("finish_reason") not in ("stop", "length"):
        return None, f"finish reason {row.get('finish_reason')!r}"
    if not row.get("completion"):
        return None, "empty completion"
    try:
        conv = parse_record(
            {"id": row["id"], "messages": row["messages"], "segment": SEGMENT, "source_file": source}, 0, "openai"
        )
    except Exception as e:  # noqa: BLE001 (traffic_io's per-row error: the row is skipped, its reason counted)
        return None, f"not a valid chat ({str(e).split(':')[0]})"
    if conv.messages[-1].role != "assistant":
        return None, "no served answer"
    return conv, ""


def prompt_key(conv: Conversation) -> str:
    """A hash of what was asked: the messages before the served answer."""
    asked = [(m.role, m.content) for m in conv.messages[:-1]]
    return hashlib.sha256(json.dumps(asked).encode()).hexdigest()


def split_heldout(convs: list[Conversation], n: int) -> tuple[list[Conversation], list[Conversation]]:
    """(training, held-out) of conversations ordered oldest first: the held-out are the newest `n` distinct prompts
    (newest first); training is the rest, less any conversation whose prompt is held out and less repeats of the
    same conversation (the first kept), oldest first."""
    held, held_keys = [], set()
    for c in reversed(convs):
        if len(held) == n:
            break
        if (k := prompt_key(c)) not in held_keys:
            held.append(c)
            held_keys.add(k)
    train, seen = [], set()
    for c in convs:
        whole = hashlib.sha256(json.dumps([(m.role, m.content) for m in c.messages]).encode()).hexdigest()
        if prompt_key(c) in held_keys or whole in seen:
            continue
        seen.add(whole)
        train.append(c)
    return train, held


def mix_counts(captured: int, registered: int, mix: float) -> tuple[int, int]:
    """(captured, registered) conversations to train on so that captured / (captured + registered) ≈ `mix`, from
    `captured` and `registered` available (each >= 1): all captured when the registered traffic has enough, else
    all registered and as many captured as the ratio allows (at least one of each)."""
    want = max(1, round(captured * (1.0 - mix) / mix))
    if want <= registered:
        return captured, want
    return max(1, min(captured, round(registered * mix / (1.0 - mix)))), registered


@dataclass(frozen=True)
class CapturePlan:
    """What a retrain on captured traffic trains and tests on (see the module doc); `plan.json` in its folder."""

    target_name: str
    target_version: str
    captured_file: str  # captured.jsonl: the training conversations, used as they are
    heldout_file: str  # heldout.jsonl: the newest captured requests, for the shadow test only
    registered_traffic: str  # the target version's registered traffic (its first `registered` are regenerated)
    registered: int
    captured: int
    greedy: int
    sampled: int
    heldout: int
    mix: float
    files: list[str]
    skipped: dict[str, int]
    newest_ms: int  # arrival time of the newest captured request the plan uses (trained on or held out)
    sha256: str = ""

    @classmethod
    def read(cls, path: str | Path) -> "CapturePlan":
        return cls(**json.loads(Path(path).read_text()))

    def applied(self, cfg: Any) -> Any:
        """The pipeline config with `regenerate.limit` the registered share of the mix."""
        return replace(cfg, regenerate=replace(cfg.regenerate, limit=self.registered))

    def add_to(self, regen_dir: str | Path) -> int:
        """The captured conversations written beside the regenerated shards (as regenerate writes its shards), once;
        returns how many."""
        lines = Path(self.captured_file).read_text()
        out = Path(regen_dir) / SHARD
        if not out.is_file() or out.read_text() != lines:
            atomic_write_text(out, lines)
        return self.captured

    def tags(self) -> dict[str, str]:
        """The registry's lineage of a head trained on this plan."""
        names = " ".join(Path(f).name for f in self.files)
        if len(names) > 4000:  # a tag holds 5000 characters; the whole list is in plan.json, logged with the run
            names = f"{len(self.files)} files, {Path(self.files[0]).name} .. {Path(self.files[-1]).name}"
        return {
            "capture_files": names,
            "capture_conversations": str(self.captured),
            "capture_greedy": str(self.greedy),
            "capture_sampled": str(self.sampled),
            "capture_heldout": str(self.heldout),
            "capture_registered": str(self.registered),
            "capture_mix": f"{self.mix:g}",
            "capture_until_ms": str(self.newest_ms),
            "capture_skipped": "; ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none",
            "capture_plan_sha256": self.sha256,
        }


def prepare_capture_plan(
    cfg: CapturedTrafficConfig,
    capture_root: str | Path,
    target_name: str,
    target_version: int | str,
    registered_traffic: str,
    out_dir: str | Path,
    regenerate_limit: int | None = None,
) -> CapturePlan:
    """The plan of the next head of `target_name`/`target_version` from what it served (see the module doc);
    `regenerate_limit`: the config's `regenerate.limit` (the registered share never exceeds it). CaptureError when
    fewer than `cfg.heldout` + 1 usable conversations were captured."""
    sel = select_captured(capture_root, target_name, target_version)
    train, held = split_heldout(sel.conversations, cfg.heldout)
    if len(held) < cfg.heldout or not train:
        raise CaptureError(
            f"{capture_root}: {len(sel.conversations)} usable captured conversations of "
            f"{target_name}/{target_version} ({_skips(sel.skipped)}); the newest capture.heldout "
            f"{cfg.heldout} distinct prompts are held out for the shadow test, so at least one more "
            "is needed to train on: capture more, or lower capture.heldout"
        )
    available = len(load_traffic(registered_traffic).conversations)
    n_cap, n_reg = mix_counts(len(train), min(available, regenerate_limit or available), cfg.mix)
    train = train[len(train) - n_cap :]  # the newest
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(_record(c)) + "\n" for c in train)
    atomic_write_text(out / "captured.jsonl", lines)
    atomic_write_text(out / "heldout.jsonl", "".join(json.dumps(_record(c, sel.limits.get(c.id))) + "\n" for c in held))
    used = [*train, *held]
    plan = CapturePlan(
        target_name,
        str(target_version),
        str(out / "captured.jsonl"),
        str(out / "heldout.jsonl"),
        str(registered_traffic),
        n_reg,
        n_cap,
        sum(c.id in sel.greedy for c in train),
        sum(c.id not in sel.greedy for c in train),
        len(held),
        cfg.mix,
        sorted({f for f in sel.files if any(Path(f).name == c.source_file for c in used)}),
        sel.skipped,
        max(sel.times[c.id] for c in used),
    )
    digest = hashlib.sha256(
        json.dumps(
            {**asdict(plan), "captured_file": lines, "heldout_file": (out / "heldout.jsonl").read_text()},
            sort_keys=True,
        ).encode()
    ).hexdigest()
    plan = replace(plan, sha256=digest)
    atomic_write_text(out / "plan.json", json.dumps(asdict(plan), indent=2) + "\n")
    return plan


def _record(c: Conversation, max_new_tokens: int | None = None) -> dict[str, Any]:
    """A shard line, as components/regenerate/endpoint.py `conversation_record` writes an answered conversation
    (with `max_new_tokens`: a held-out request's served length)."""
    rec = {
        "id": c.id,
        "segment": c.segment,
        "source_file": c.source_file,
        "messages": [{"role": m.role, "content": m.content} for m in c.messages],
    }
    return {**rec, "max_new_tokens": max_new_tokens} if max_new_tokens else rec


def _skips(skipped: dict[str, int]) -> str:
    return "skipped: " + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())) if skipped else "none skipped"


def _ms(t: Any) -> int:
    if isinstance(t, dt.datetime):
        return round(t.timestamp() * 1000)
    return int(t or 0)


def new_conversations(root: str | Path, target_name: str, target_version: int | str, after_ms: int) -> int:
    """Usable conversations `target_name`/`target_version` served after `after_ms` (UTC ms): the retrain trigger's
    count (files of other targets are not read)."""
    sel = select_captured(root, target_name, target_version)
    return sum(1 for c in sel.conversations if sel.times[c.id] > after_ms)
