"""The embedded default: a tokenizer, a Llama target, its fine-tune and chat traffic, built offline from the
running interpreter's standard library, reproducibly, and cached by content hash.

Purpose: give every machine (no downloads) a real target to train and evaluate EAGLE-3 heads on.
Run: `python -m embedded [--preset tiny|default|gpu]`; from Python, `build_embedded(EmbeddedConfig.default())`.
Not here: heads, registration, orchestration. See `build.py` for the layout of a build directory.
"""

import importlib

# the public names and the submodule each lives in; loaded on first use (PEP 562), so that importing a submodule
# (build.py imports its siblings through the package) never runs this package's imports of it: no import cycle
_EXPORTS = {
    **dict.fromkeys(("DEFAULT_ROOT", "build_embedded", "build_hash", "load_domains"), "build"),
    **dict.fromkeys(
        (
            "CorpusConfig",
            "EmbeddedConfig",
            "EvalConfig",
            "LMTrainConfig",
            "TargetConfig",
            "TokenizerConfig",
            "TrafficConfig",
        ),
        "config",
    ),
    **dict.fromkeys(
        ("Continuation", "DomainInfo", "EmbeddedResult", "Metrics", "TrafficFiles", "load_result"), "result"
    ),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
