"""Build the embedded default from the command line and print its report summary as JSON.

Run: `python -m embedded [--preset smollm2|tiny|default|gpu] [--config FILE.json] [--root DIR] [--force]
[--quiet]`. `--config` is a JSON object loaded strictly (unknown keys are errors); it replaces the preset, and
sections or keys it omits take the dataclass defaults (those of `default()`): `{"traffic": {"kind": "long"}}` is the
default build with long-output traffic files (embedded/long_traffic.py). A config that cannot be read
or holds a bad value is refused before the build with one line `embedded: error: <file>: <key path> ...`, exit 2.
Not here: anything but argument parsing and printing; the work is `embedded.build.build_embedded`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedded", description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset",
        default="smollm2",
        choices=["tiny", "default", "gpu", "smollm2"],
        help="smollm2 (default): the real pretrained chat model and its LoRA fine-tune (embedded/real.py); "
        "the others: the toy stdlib Llama's sizes",
    )
    p.add_argument("--config", type=Path, help="JSON config (strict); replaces --preset")
    p.add_argument("--root", type=Path, default=Path(".eagle/embedded"), help="cache root (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even when the build is cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.preset == "smollm2" and not args.config:
        from embedded.real import build_real

        real = build_real(root=args.root, progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(
            json.dumps(
                {"build_dir": str(real.build_dir), "cached": real.cached, "gguf": real.gguf, "finetune": real.finetune},
                indent=2,
            )
        )
        return 0
    from embedded.build import build_embedded  # heavy imports after argument parsing
    from embedded.config import EmbeddedConfig
    from eagle.errors import BadInput

    try:
        cfg = (
            EmbeddedConfig.from_dict(json.loads(args.config.read_text()))
            if args.config
            else EmbeddedConfig.preset(args.preset)
        )
    except (BadInput, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:  # one line: the file and why
        print(f"embedded: error: {args.config}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    result = build_embedded(cfg, args.root, force=args.force, progress=not args.quiet)
    m = result.metrics
    print(
        json.dumps(
            {
                "build_dir": str(result.build_dir),
                "cached": result.cached,
                "build_hash": result.build_hash,
                "build_seconds": m.build_seconds,
                "heldout_loss": round(m.heldout_loss, 4),
                "heldout_perplexity": round(m.heldout_perplexity, 2),
                "top1_agreement": m.top1_agreement,
                "target_tokens_per_second": round(m.target_train.tokens_per_second),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
