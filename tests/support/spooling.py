"""Spool contents for the agent's delivery tests: a small real trace, committed the way the agent does."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from stepdoctor.spool import Spool


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small real Kineto Chrome trace recorded once with plain torch.profiler."""
    import torch

    path = tmp_path_factory.mktemp("trace") / "t.json"
    model = torch.nn.Linear(16, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            prof.step()
    prof.export_chrome_trace(str(path))
    return path.read_bytes()


def spool_traces(spool: Spool, trace: bytes, count: int, server: str | None, run: str = "r1") -> list[str]:
    """Commit ``count`` captures the way the agent does (export, rename, sidecar); returns their keys."""
    directory = spool.run_dir("proj", run)
    keys = []
    for index in range(count):
        stem = Spool.new_stem()
        Spool.export_partial(directory, stem).write_bytes(trace)
        key = uuid.uuid4().hex
        window = {"index": index, "first_step": 10 * index, "last_step": 10 * index + 2}
        sidecar = {"idempotency_key": key, "project": "proj", "run": run, "rank": 0, "window": window}
        Spool.commit_capture(directory, stem, {**sidecar, "server": server, "metadata": {"host": "h"}})
        keys.append(key)
    return keys


def run_training(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a training script (``python -c code args...``) as a user would: no ``STEPDOCTOR_*`` from the
    test's environment but ``env``, and agent errors raised (a mishandled one fails the script)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**base, "STEPDOCTOR_RAISE_ERRORS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def agent_lines(stderr: str) -> list[str]:
    """The agent's own stderr lines (torch's and Kineto's are left out)."""
    return [line for line in stderr.splitlines() if line.startswith("stepdoctor:")]


# A fork server for training scripts: one process imports torch and stepdoctor (and what torch's
# profiler imports at the first window: ``torch._inductor``, seconds of CPU) once; each script then
# runs in a fork of it, a process of its own as ``run_training``'s is, from its own environment and
# arguments, with its output on its own pipes (not files: a script's file-size limit must not cut
# them), its non-daemon threads and atexit handlers run at the end as the interpreter would.
# No torch op runs before the fork (no intra-op thread pool to inherit), as with DataLoader workers.
_FORK_SERVER = r"""
import atexit, json, os, selectors, sys, threading, traceback, types
import torch, stepdoctor
hasattr(torch, "_inductor")
reply = sys.stdout
for request in sys.stdin:
    code, args, env = json.loads(request)
    pipes = {1: os.pipe(), 2: os.pipe()}
    reply.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, (read, write) in pipes.items():
            os.dup2(write, fd)
            os.close(read)
            os.close(write)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), main.__dict__)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                status = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                status = 1
        except BaseException as exc:
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
            traceback.print_exception(exc)
            status = 1
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    output = {}
    with selectors.DefaultSelector() as selector:
        for fd, (read, write) in pipes.items():
            os.close(write)
            selector.register(read, selectors.EVENT_READ, fd)
            output[fd] = b""
        while selector.get_map():
            for key, _ in selector.select():
                chunk = os.read(key.fd, 65536)
                if chunk:
                    output[key.data] += chunk
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
    returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    text = [output[fd].decode(errors="replace") for fd in (1, 2)]
    reply.write(json.dumps([returncode, *text]) + "\n")
    reply.flush()
"""


class TrainingForks:
    """``run_training`` in forks of one process that imported torch once (``training_forks``)."""

    def __init__(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
        # the fork server's own errors (its imports); closed by close()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(
            [sys.executable, "-c", _FORK_SERVER],
            env=base,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,  # a timed-out script is killed with its fork server
        )
        self._base = base

    def run(self, code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """As ``run_training(code, *args, **env)``."""
        assert self._process.stdin is not None and self._process.stdout is not None
        request = [code, list(args), {**self._base, "STEPDOCTOR_RAISE_ERRORS": "1", **env}]
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._process.stdout], [], [], 120)
        line = self._process.stdout.readline() if ready else ""
        if not line:
            died = bool(ready)  # end of its output, not the timeout
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")
            self.close()
            if died:
                raise RuntimeError(f"the fork server exited:\n{log}")
            raise subprocess.TimeoutExpired([sys.executable, "-c", code, *args], 120)
        returncode, stdout, stderr = json.loads(line)
        return subprocess.CompletedProcess([sys.executable, "-c", code, *args], returncode, stdout, stderr)

    @property
    def closed(self) -> bool:
        return self._process.poll() is not None

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._log.close()


_forks: TrainingForks | None = None


@pytest.fixture(scope="module")
def training_forks() -> TrainingForks:
    """One fork server per test process, shared by the modules that use it (closed at exit)."""
    global _forks
    if _forks is None or _forks.closed:
        _forks = TrainingForks()
        atexit.register(_forks.close)
    return _forks
