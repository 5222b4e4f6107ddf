"""The offline corpus: the running interpreter's standard library, cut into file chunks and function pairs.

Purpose: read the base domain (non-test `.py` under `sysconfig.get_paths()['stdlib']`, without `encodings/`,
`pydoc_data/`, `ensurepip/`, test directories and `site-packages`) and the fine-tune domain (the standard
library's own test suite under `test/`, or, where a Python ships without it, the base modules' docstrings as
prose); split each domain by file into train and held-out; cut files into raw chunks and into function pairs
(decorators + signature + docstring -> body) with `ast`.
Not here: tokenisation, chat formatting (see `traffic.py`), training.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from embedded.config import CorpusConfig

DROPPED_DIRS = frozenset(
    {
        "encodings",
        "pydoc_data",
        "ensurepip",
        "site-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "lib-dynload",
    }
)


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # posix path relative to the stdlib root, e.g. "json/decoder.py"
    text: str
    sha256: str


@dataclass(frozen=True)
class FunctionPair:
    source_file: str
    qualname: str
    signature: str  # decorators + `def ...:` lines, dedented to column 0
    docstring: str | None  # cleaned (inspect.cleandoc), None when absent
    header: str  # the source lines from the first decorator to the end of the docstring (or signature)
    body: str  # the statements after the docstring, indented by one level relative to `def`


@dataclass(frozen=True)
class Domain:
    """One domain of the corpus, split by file."""

    name: str  # "stdlib" or "stdlib-tests" (or "stdlib-docstrings" as the fallback)
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]
    is_code: bool = True

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.name.encode())
        for split, files in (("train", self.train), ("heldout", self.heldout)):
            for f in files:
                h.update(f"{split}\0{f.rel_path}\0{f.sha256}\n".encode())
        return h.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _path_key(rel_path: str, salt: str = "order") -> str:
    return hashlib.sha256(f"{salt}:{rel_path}".encode()).hexdigest()


def _read(root: Path, path: Path) -> SourceFile | None:
    """The file as a `SourceFile`, or None when it is not UTF-8 or not valid Python for this interpreter."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    if "<|" in text:  # would collide with the tokenizer's special tokens
        return None
    return SourceFile(path.relative_to(root).as_posix(), text, hashlib.sha256(data).hexdigest())


def _candidates(
    root: Path, rel_paths: list[str], cfg: CorpusConfig, max_files: int | None, max_bytes: int | None
) -> list[SourceFile]:
    """Files in a fixed pseudo-random order (by hash of path), within the count and byte budgets."""
    out, total = [], 0
    for rel in sorted(rel_paths, key=_path_key):
        path = root / rel
        size = path.stat().st_size
        if cfg.max_file_bytes is not None and size > cfg.max_file_bytes:
            continue
        if max_bytes is not None and total + size > max_bytes:
            continue
        f = _read(root, path)
        if f is None:
            continue
        out.append(f)
        total += size
        if max_files is not None and len(out) >= max_files:
            break
    return out


def base_files(cfg: CorpusConfig, root: Path | None = None) -> list[SourceFile]:
    root = root or stdlib_root()
    keep = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in DROPPED_DIRS and not d.startswith("config-"))
        rel_dir = Path(dirpath).relative_to(root)
        keep += [
            (rel_dir / n).as_posix()
            for n in filenames
            if n.endswith(".py") and not n.startswith(("test_", "_sysconfigdata"))
        ]
    return _candidates(root, keep, cfg, cfg.max_base_files, None)


def finetune_files(cfg: CorpusConfig, root: Path | None = None) -> tuple[str, list[SourceFile], bool]:
    """(domain name, files, is_code): the test suite when present, else docstrings of the base modules as prose."""
    root = root or stdlib_root()
    tests = root / "test"
    if tests.is_dir():
        rel = [p.relative_to(root).as_posix() for p in tests.rglob("*.py")]
        files = _candidates(root, rel, cfg, None, cfg.finetune_bytes)
        if files:
            return "stdlib-tests", files, True
    return "stdlib-docstrings", _docstring_files(cfg, root), False


def _docstring_files(cfg: CorpusConfig, root: Path) -> list[SourceFile]:
    out, total = [], 0
    for f in base_files(cfg, root):
        docs = [
            inspect.cleandoc(d)
            for n in ast.walk(ast.parse(f.text))
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (d := ast.get_docstring(n, clean=False))
        ]
        text = "\n\n".join(docs) + "\n"
        if len(docs) < 2 or total + len(text) > cfg.finetune_bytes:
            continue
        rel = f.rel_path[:-3] + ".txt"
        out.append(SourceFile(rel, text, hashlib.sha256(text.encode()).hexdigest()))
        total += len(text)
    return out


def split_domain(name: str, files: list[SourceFile], heldout_fraction: float, is_code: bool = True) -> Domain:
    """Held-out files are those whose path hash falls under the fraction (at least one, never all)."""
    if len(files) < 2:
        raise ValueError(f"domain {name!r} has {len(files)} usable files; need at least 2 to split")
    ordered = sorted(files, key=lambda f: _path_key(f.rel_path))
    # a hash salted differently from the selection order, so that a truncated selection still splits evenly
    held = [f for f in ordered if int(_path_key(f.rel_path, "split")[:8], 16) / 2**32 < heldout_fraction]
    if not held:
        held = ordered[:1]
    if len(held) == len(ordered):
        held = held[:-1]
    held_set = {f.rel_path for f in held}
    train = [f for f in ordered if f.rel_path not in held_set]
    return Domain(name, tuple(train), tuple(held), is_code)


def raw_chunks(f: SourceFile, chunk_lines: int) -> list[str]:
    """Consecutive pieces of about `chunk_lines` lines, cut at a blank line (hard cut at twice that)."""
    chunks, cur = [], []
    for line in f.text.splitlines(keepends=True):
        cur.append(line)
        if (len(cur) >= chunk_lines and not line.strip()) or len(cur) >= 2 * chunk_lines:
            chunks.append("".join(cur))
            cur = []
    if any(line.strip() for line in cur):
        chunks.append("".join(cur))
    return [c for c in chunks if c.strip()]


def function_pairs(f: SourceFile, cfg: CorpusConfig) -> list[FunctionPair]:
    """Module-level functions and methods of module-level classes, in file order."""
    try:
        tree = ast.parse(f.text)
    except SyntaxError:
        return []
    lines = f.text.splitlines(keepends=True)
    out = []
    for node, owner in _functions(tree):
        pair = _pair(f.rel_path, lines, node, owner, cfg)
        if pair is not None:
            out.append(pair)
    return out


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, ""
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node.name


def _dedent(lines: list[str], col: int) -> str:
    """Remove `col` leading spaces; blank lines become bare newlines; under-indented lines (inside a string
    literal) are kept as they are."""
    out = []
    for line in lines:
        if not line.strip():
            out.append("\n" if line.endswith("\n") else "")
        else:
            out.append(line[col:] if line[:col].strip() == "" else line)
    return "".join(out)


def _pair(
    rel: str, lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str, cfg: CorpusConfig
) -> FunctionPair | None:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    doc = ast.get_docstring(node, clean=False)
    stmts = node.body[1:] if doc is not None else node.body
    if not stmts or node.body[0].lineno <= node.lineno or node.end_lineno is None:
        return None
    sig_end = node.body[0].lineno - 1
    header_end = node.body[0].end_lineno if doc is not None else sig_end
    body_start = stmts[0].lineno - 1
    while body_start > header_end and lines[body_start - 1].strip().startswith("#"):
        body_start -= 1  # keep comments that lead into the first statement
    body_lines = lines[body_start : node.end_lineno]
    if not cfg.min_body_lines <= len(body_lines) <= cfg.max_body_lines:
        return None
    col = node.col_offset
    return FunctionPair(
        source_file=rel,
        qualname=f"{owner}.{node.name}" if owner else node.name,
        signature=_dedent(lines[start:sig_end], col),
        docstring=inspect.cleandoc(doc) if doc is not None else None,
        header=_dedent(lines[start:header_end], col),
        body=_dedent(body_lines, col),
    )
