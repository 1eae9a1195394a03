"""`protocol/ids.py`: the request path's ids are unique within a process, across
threads, and across a fork (the child draws its own prefix)."""

from __future__ import annotations

import os
import threading

import pytest

from sluice.protocol.ids import unique_hex


def test_ids_are_32_hex_digits_and_never_repeat_in_a_process() -> None:
    ids = [unique_hex() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len({i[:16] for i in ids}) == 1  # one prefix, a counter after it


def test_ids_from_many_threads_never_repeat() -> None:
    out: list[list[str]] = [[] for _ in range(8)]

    def draw(k: int) -> None:
        out[k] = [unique_hex() for _ in range(5_000)]

    threads = [threading.Thread(target=draw, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for ids in out for i in ids]
    assert len(set(every)) == len(every) == 40_000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_its_own_prefix() -> None:
    parent = unique_hex()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send one id back and leave at once
        os.write(write, unique_hex().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child[:16] != parent[:16]
    assert unique_hex()[:16] == parent[:16]  # the parent's own is unchanged
