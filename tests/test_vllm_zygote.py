"""The zygote that vLLM's servers are forked from (infra/vllm_zygote.py), with a probe module in vLLM's place.

Purpose: a forked child is what `python -m MODULE ARGV` would be: its argv, environment, working directory and log
are the request's, it leads a session of its own, and it ends as the interpreter would (its exit code, an uncaught
exception printed with exit 1, atexit handlers run); the handle reports the code as `subprocess.Popen` does (a
signal negative) and times out as it does. Closing the zygote (what the exit of the process that started it does)
stops the children still running. Another environment gets another zygote, up to `MAX_ZYGOTES`; one whose module
cannot be imported is not tried again, and `launch` returns None (the caller starts the server directly).
Run: `python -m pytest tests/test_vllm_zygote.py` (a few seconds: the probe imports nothing heavy).
Not here: vLLM's own server through a zygote (every engine test does that: infra/vllm_server.py forks them by
default; tests/test_vllm.py also starts one without).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import vllm_zygote
from infra.vllm_zygote import Zygote

PROBE = """
import atexit, json, os, sys, time


def main():
    out = os.environ["PROBE_OUT"]
    atexit.register(lambda: open(out + ".atexit", "w").close())
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("PROBE_MARK"),
                   "pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(), "name": __name__}, f)
    print("probe says hello", flush=True)
    mode = sys.argv[1]
    if mode == "sleep":
        time.sleep(120)
    elif mode == "raise":
        raise RuntimeError("the probe failed")
    sys.exit(int(mode))


if __name__ == "__main__":  # as vLLM's server module: importing it (the zygote does) runs nothing
    main()
"""


@pytest.fixture
def probe_env(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "zygote_probe.py").write_text(PROBE)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "PROBE_OUT": str(tmp_path / "probe.json")}


@pytest.fixture
def zygote(probe_env, tmp_path):
    z = Zygote(sys.executable, probe_env, tmp_path / "zygote.log", module="zygote_probe")
    yield z
    z.close()


def _wait_for(path: Path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{path} not written in {timeout_s} s")


def test_a_child_is_what_python_dash_m_would_be(zygote, probe_env, tmp_path):
    (tmp_path / "work").mkdir()
    child = zygote.fork(
        ["3", "--flag"], {**probe_env, "PROBE_MARK": "mine"}, str(tmp_path / "work"), tmp_path / "child.log"
    )
    assert child.wait(30) == 3 and child.poll() == 3
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert seen["argv"] == ["3", "--flag"] and seen["name"] == "__main__" and seen["mark"] == "mine"
    assert seen["cwd"] == str(tmp_path / "work") and seen["pid"] == child.pid == seen["sid"]  # a session of its own
    assert seen["ppid"] == zygote.proc.pid
    assert (tmp_path / "probe.json.atexit").exists(), "the interpreter's own exit ran its atexit handlers"
    assert "probe says hello" in (tmp_path / "child.log").read_text()
    assert (tmp_path / "child.log.rc").read_text() == "3"

    failed = zygote.fork(["raise"], probe_env, str(tmp_path), tmp_path / "failed.log")
    assert failed.wait(30) == 1
    assert "RuntimeError: the probe failed" in (tmp_path / "failed.log").read_text()


def test_a_signal_is_a_negative_code_and_wait_times_out_as_popen_does(zygote, probe_env, tmp_path):
    child = zygote.fork(["sleep"], probe_env, str(tmp_path), tmp_path / "child.log")
    _wait_for(tmp_path / "probe.json")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGTERM)  # as VllmServer.stop() does
    assert child.wait(30) == -signal.SIGTERM


def test_closing_the_zygote_stops_its_children(zygote, probe_env, tmp_path):
    child = zygote.fork(["sleep"], probe_env, str(tmp_path), tmp_path / "child.log")
    _wait_for(tmp_path / "probe.json")
    zygote.close()
    assert zygote.proc.returncode == 0
    assert child.wait(5) == -signal.SIGTERM


def test_launch_keys_zygotes_by_environment_and_gives_up_cleanly(probe_env, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_zygote, "_zygotes", {})
    monkeypatch.setattr(vllm_zygote, "MAX_ZYGOTES", 2)
    try:

        def launch(env, name, module="zygote_probe"):
            return vllm_zygote.launch(sys.executable, ["0"], env, str(tmp_path), tmp_path / f"{name}.log", module)

        a = launch({**probe_env, "PYTEST_CURRENT_TEST": "a"}, "a")
        b = launch({**probe_env, "PYTEST_CURRENT_TEST": "b", "EAGLE_HOME": "x"}, "b")  # what vLLM does not read
        assert a.zygote is b.zygote and a.wait(30) == b.wait(30) == 0
        assert launch(probe_env, "e", module="no_such_module_here") is None  # cannot start: the caller's turn
        assert "No module named 'no_such_module_here'" in (tmp_path / f"vllm-zygote-{os.getpid()}.log").read_text()
        assert list(vllm_zygote._zygotes.values()).count(None) == 1  # remembered: not tried again
        c = launch({**probe_env, "OMP_NUM_THREADS": "1"}, "c")  # read at import: another zygote
        assert c.zygote is not a.zygote and c.wait(30) == 0
        assert launch({**probe_env, "OMP_NUM_THREADS": "2"}, "d") is None  # MAX_ZYGOTES running already
    finally:
        vllm_zygote.close_all()


def test_a_killed_starter_takes_its_zygote_and_its_children_along(probe_env, tmp_path):
    """`kill -9` of the process that started the zygote (no atexit, no `close()`): the zygote sees its request pipe
    close and stops the children it forked, then exits."""
    starter = (
        "import sys, time\nfrom pathlib import Path\nfrom infra.vllm_zygote import Zygote\n"
        f"z = Zygote(sys.executable, {probe_env!r}, Path({str(tmp_path / 'z.log')!r}), module='zygote_probe')\n"
        f"c = z.fork(['sleep'], {probe_env!r}, {str(tmp_path)!r}, Path({str(tmp_path / 'c.log')!r}))\n"
        "print(z.proc.pid, c.pid, flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    try:
        zygote_pid, child_pid = map(int, proc.stdout.readline().split())
        _wait_for(tmp_path / "probe.json")
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + vllm_zygote.STOP_WAIT_S + 10
        while time.monotonic() < deadline and (vllm_zygote._alive(child_pid) or vllm_zygote._alive(zygote_pid)):
            time.sleep(0.1)
        assert not vllm_zygote._alive(child_pid), "the child outlived the kill"
        assert not vllm_zygote._alive(zygote_pid), "the zygote outlived the kill"
        assert (tmp_path / "c.log.rc").read_text() == str(-signal.SIGTERM)
    finally:
        proc.kill()
