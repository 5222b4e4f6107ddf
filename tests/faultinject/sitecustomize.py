"""Test-only fault injection: Python imports this at start-up when tests/faultinject is on PYTHONPATH.

Purpose: tests/test_faults.py runs the real CLI as a subprocess with this directory on its PYTHONPATH and a JSON
spec in EAGLE_TEST_FAULT saying where the process must stop:
    {"pause_rename": "<text>", "truncate": true}  just before a path is renamed onto a name containing <text>
                                                  (with truncate: the file being renamed is first cut to half its
                                                  size, the state a kill in the middle of writing it leaves)
    {"pause_call": "module:Class.method"}         just before that method runs
    {"fail_call": "module:Class.method", "times": n}
                                                  that method raises MLflow's TEMPORARILY_UNAVAILABLE error (what a
                                                  locked SQLite store raises) its first n calls
To stop, the process prints `FAULT-PAUSE <where> pid=<pid>` on stderr and sends itself SIGSTOP, so every thread
freezes at that exact point; the test then looks at the disk and `kill -9`s it.
Not here: anything the project reads. The project never sees this variable; without it this file does nothing.
"""

import importlib.abc
import importlib.util
import json
import os
import signal
import sys

SPEC = json.loads(os.environ.get("EAGLE_TEST_FAULT") or "{}")


def _pause(where: str) -> None:
    sys.stderr.write(f"FAULT-PAUSE {where} pid={os.getpid()}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def _hook_renames(text: str, truncate: bool) -> None:
    def wrap(real):
        def renamer(src, dst, *args, **kwargs):
            if text in os.path.basename(os.fspath(dst)):
                if truncate and os.path.isfile(src):
                    os.truncate(src, os.path.getsize(src) // 2)
                _pause(f"rename {os.fspath(src)} -> {os.fspath(dst)}")
            return real(src, dst, *args, **kwargs)

        return renamer

    os.replace, os.rename = wrap(os.replace), wrap(os.rename)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies `patch(module)` right after `name` is first imported."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap_method(target: str, make) -> None:
    module_name, qualname = target.split(":")
    owner_name, method = qualname.split(".")

    def patch(module):
        owner = getattr(module, owner_name)
        setattr(owner, method, make(getattr(owner, method)))

    if module_name in sys.modules:
        patch(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


def _pausing(real):
    def method(*args, **kwargs):
        _pause(f"call {real.__qualname__}")
        return real(*args, **kwargs)

    return method


def _failing(times: int):
    calls = [0]

    def make(real):
        def method(*args, **kwargs):
            calls[0] += 1
            if calls[0] <= times:
                from mlflow.exceptions import MlflowException
                from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

                sys.stderr.write(f"FAULT-FAIL {real.__qualname__} call {calls[0]}\n")
                raise MlflowException(
                    "(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE
                )
            return real(*args, **kwargs)

        return method

    return make


if "pause_rename" in SPEC:
    _hook_renames(SPEC["pause_rename"], bool(SPEC.get("truncate")))
if "pause_call" in SPEC:
    _wrap_method(SPEC["pause_call"], _pausing)
if "fail_call" in SPEC:
    _wrap_method(SPEC["fail_call"], _failing(int(SPEC.get("times", 1))))
