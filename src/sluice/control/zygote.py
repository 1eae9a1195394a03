"""A pre-imported template process that forks new workers: a scale-up without an
interpreter start or a single import.

A fresh `sluice worker` starts an interpreter and imports torch, the engine and the HTTP
stack, and so does its engine core process, before either does any work. `LocalBackend`
instead keeps one template, started once and pre-imported (Android's zygote, Python's
forkserver), and each scale-up forks it:

    controller (LocalBackend)                 zygote: python -m sluice.control.zygote
      Zygote(env, log)    ───── Popen ─────▶  OpenMP wait set, then PRELOAD imported
                          ◀── {"ready"} ────  then waits on its socket, no thread started
      fork(argv, log)     ─ {"argv", ...} ─▶  fork(); the child runs `sluice ARGV`
                          ◀─ {"pid": P} ────
      ForkedProcess(P): Popen's poll / wait / send_signal / kill
                          ◀─ {"exit": P, "code": C} ─  SIGCHLD: reaped, status reported

The forked worker runs with `SLUICE_WORKER_MULTIPROC_METHOD=fork`: it forks its engine
core first thing (still one thread), so neither process imports anything.

Fork safety: a fork copies only the calling thread, so another thread's held locks
would stay held in the child forever. The zygote never starts a thread and checks that
it has none (/proc/self/task) before each fork, refusing otherwise (the backend then
starts a fresh process). OpenMP's threads start in the engine core, at its first
parallel op, after the fork; nothing in PRELOAD runs one. Environment variables that
libraries read when imported (OMP_*, MKL_*) are the zygote's: the backend starts it with
its workers' environment.

Lifetimes: the zygote dies with the controller (PR_SET_PDEATHSIG when started from the
controller's main thread; its loop also polls getppid). A forked worker gets SIGTERM
when the zygote exits (PDEATHSIG, armed from the zygote's only thread) and drains, as
on `stop()`. Its exit status is the zygote's to report: if the zygote is gone, a worker
that exited reports 1.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ZYGOTE_POLL_S = 0.25  # how often the zygote checks that its parent is alive
READY_TIMEOUT_S = 300.0  # imports, and the CPU kernels' build the first time (~45 s)
REPLY_TIMEOUT_S = 10.0
EXIT_UNKNOWN = 1  # the status of a worker whose zygote died before reporting it
PRELOAD = (
    "torch",
    "sluice.cli",
    "sluice.worker.server",
    "sluice.engine.async_engine",
    "sluice.engine.core",
    "sluice.engine.model_runner",
    "sluice.engine.models.gguf_loader",
    "safetensors.torch",
    "gguf.quants",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.uvloop",
)


def supported() -> bool:
    """Linux only: forked workers are signalled through pidfds."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


class ZygoteError(RuntimeError):
    """The zygote did not start, or would not fork."""


# -- the controller's side ------------------------------------------------------------------


class Zygote:
    """The controller's handle on its zygote: start it, fork workers from it, close it.

    Thread-safe: one lock serializes the socket (forks, and reading exit reports)."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "sluice.control.zygote", "--parent-pid", str(os.getpid()),
               "--fd", str(theirs.fileno())]
        if threading.current_thread() is threading.main_thread():  # see local.py's docstring
            cmd.append("--pdeathsig")
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(env), pass_fds=[theirs.fileno()],
                                            start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._buffer = b""
        self._replies: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self.ready = False
        self.single_threaded = False
        self._open = True  # False once the socket is closed or at EOF

    @property
    def alive(self) -> bool:
        return self._open and self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until the zygote has imported everything; ZygoteError if it exits first."""
        with self._lock:
            if not self.ready:
                reply = self._next_reply(timeout)
                self.ready = bool(reply.get("ready"))
                self.single_threaded = bool(reply.get("single_threaded"))  # else no fork
                if not self.ready:
                    raise ZygoteError(f"zygote: {reply}")

    def fork(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str]
             ) -> ForkedProcess:
        """A forked child running `sluice ARGV`, its output in `log_path`; returns at once."""
        with self._lock:
            self._send({"argv": list(argv), "log": str(log_path), "env": dict(env)})
            reply = self._next_reply(REPLY_TIMEOUT_S)
        if "pid" not in reply:
            raise ZygoteError(reply.get("error", f"zygote: {reply}"))
        return ForkedProcess(int(reply["pid"]), self)

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """`pid`'s exit status if the zygote has reported it, waiting up to `timeout`."""
        with self._lock:
            if pid not in self._exits and self._open:
                self._pump(timeout)
            return self._exits.pop(pid, None)

    def close(self, timeout: float = 5.0) -> None:
        """Close the socket (the zygote exits at once) and reap it."""
        with self._lock:
            self._open = False
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    # -- the socket (called with the lock held) --

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            self._open = False
            raise ZygoteError(f"zygote gone: {exc}\n{self.log_tail()}") from exc

    def _next_reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self._replies:
            if not self._open:
                raise ZygoteError(f"zygote exited\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ZygoteError(f"zygote: no reply within {timeout} s\n{self.log_tail()}")
            self._pump(min(0.5, max(0.0, deadline - time.monotonic())))
        return self._replies.pop(0)

    def _pump(self, timeout: float) -> None:
        """Read what the zygote sent within `timeout`: replies and exit reports."""
        try:
            if not select.select([self._sock], [], [], timeout)[0]:
                return
            data = self._sock.recv(1 << 16)
        except OSError:  # reset by a zygote that died
            data = b""
        if not data:
            self._open = False
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                self._exits[int(message["exit"])] = int(message["code"])
            else:
                self._replies.append(message)


class ForkedProcess:
    """A process the zygote forked, with the part of `subprocess.Popen` that local.py
    uses. Signals go through a pidfd, so they never reach a later process that reused
    the pid once the zygote reaped this one."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        self._pidfd: int | None = None
        with contextlib.suppress(ProcessLookupError):
            self._pidfd = os.pidfd_open(pid)

    def poll(self, timeout: float = 0.0) -> int | None:
        if self.returncode is None:
            code = self._zygote.returncode(self.pid, timeout)
            if code is None and not self._zygote.alive and self._exited():
                code = EXIT_UNKNOWN
            if code is not None:
                self.returncode = code
                self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll(0.05) is None:
            if not self._zygote.alive:
                time.sleep(0.05)
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exited(self) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], 0)[0])

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


# -- the zygote's side ----------------------------------------------------------------------


def zygote_main(argv: Sequence[str] | None = None) -> int:
    """`python -m sluice.control.zygote --parent-pid P [--pdeathsig] --fd N`."""
    from sluice.control.local import set_parent_death_signal

    parser = argparse.ArgumentParser(prog="python -m sluice.control.zygote")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--pdeathsig", action="store_true")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the controller")
    ns = parser.parse_args(argv)
    if ns.pdeathsig:
        set_parent_death_signal()
    if os.getppid() != ns.parent_pid:
        return 1  # the parent died before we got here
    sock = socket.socket(fileno=ns.fd)
    preload()
    from sluice.engine.core_client import single_threaded

    _reply(sock, {"ready": True, "single_threaded": single_threaded()})
    return _serve(sock, ns.parent_pid)


def preload() -> None:
    """Import what a worker and its engine core import, and load the CPU kernels (built
    once per machine), with OpenMP's wait policy and glibc's allocator set as the engine
    core sets them.

    numpy's OpenBLAS would start its thread pool when imported: told to use one thread
    (the engine's matmuls are torch's, not numpy's), it starts none.
    """
    from sluice.engine.malloc import keep_freed_memory  # imports no torch
    from sluice.engine.openmp import set_wait_policy

    set_wait_policy()
    keep_freed_memory()  # (glibc's settings are inherited by every fork)
    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an optional one (uvloop): the worker does without
            print(f"zygote: not preloaded: {exc}", file=sys.stderr, flush=True)
    if blas_threads is None:
        del os.environ["OPENBLAS_NUM_THREADS"]
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = blas_threads
    from sluice.engine import native

    try:
        native.load_kernels()
    except Exception as exc:  # noqa: BLE001 - each worker then tries, and reports, itself
        print(f"zygote: CPU kernels not preloaded: {exc}", file=sys.stderr, flush=True)


def _serve(sock: socket.socket, parent_pid: int) -> int:
    """Fork on each request, report each child's exit, until the controller goes away."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buffer = b""
    while os.getppid() == parent_pid:
        readable = select.select([sock.fileno(), wake_r], [], [], ZYGOTE_POLL_S)[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(sock)
        if sock.fileno() in readable:
            data = sock.recv(1 << 16)
            if not data:
                return 0  # the controller closed it
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                _fork(sock, json.loads(line), [wake_r, wake_w])
    return 0


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    from sluice.engine.core_client import single_threaded

    if not single_threaded():
        _reply(sock, {"error": "the zygote has threads: a fork would not be safe"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sock.close()
            for fd in fds:
                os.close(fd)
            code = _run_child(request, zygote)
        finally:
            os._exit(code)
    _reply(sock, {"pid": pid})


def _run_child(request: dict[str, Any], zygote: int) -> int:
    """In the forked child: become `sluice ARGV` as `Popen(start_new_session=True)` would
    start it, tied to the zygote, and run it to its exit status."""
    from sluice.control.local import set_parent_death_signal

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["SLUICE_WORKER_MULTIPROC_METHOD"] = "fork"
    set_parent_death_signal()
    if os.getppid() != zygote:
        return 1  # the zygote died before we got here
    return _exit_status(request["argv"])


def _exit_status(argv: list[str]) -> int:
    """Run `sluice ARGV` and shut down as the interpreter would at exit."""
    from sluice.cli import main

    try:
        code: Any = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


def _reply(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the controller is gone: the loop ends next
        sock.sendall(json.dumps(message).encode() + b"\n")


if __name__ == "__main__":
    raise SystemExit(zygote_main())
