"""The embedded default: a tokenizer, a Llama target, its fine-tune and chat traffic, built offline from the
running interpreter's standard library, reproducibly, and cached by content hash.

Purpose: give every machine (no downloads) a real target to train and evaluate EAGLE-3 heads on.
Run: `python -m embedded [--preset tiny|default|gpu]`; from Python, `build_embedded(EmbeddedConfig.default())`.
Not here: heads, registration, orchestration. See `build.py` for the layout of a build directory.
"""

from embedded.build import DEFAULT_ROOT, build_embedded, build_hash, load_domains
from embedded.config import (CorpusConfig, EmbeddedConfig, EvalConfig, LMTrainConfig, TargetConfig,
                                        TokenizerConfig, TrafficConfig)
from embedded.result import (Continuation, DomainInfo, EmbeddedResult, Metrics, TrafficFiles,
                                        load_result)

__all__ = [
    "DEFAULT_ROOT", "build_embedded", "build_hash", "load_domains", "load_result",
    "CorpusConfig", "EmbeddedConfig", "EvalConfig", "LMTrainConfig", "TargetConfig", "TokenizerConfig", "TrafficConfig",
    "Continuation", "DomainInfo", "EmbeddedResult", "Metrics", "TrafficFiles",
]
