"""`LedgerSpool`: the usage records waiting for the database, kept in a local file.

While the database is unreachable the ledger keeps the records it could not write in
memory and retries them (`ledger.py`). Memory alone loses them when the gateway dies
before the database is back: killed, out of memory, or stopped while the outage lasts
longer than its shutdown wait. So every record that starts waiting is also written to
this spool, a SQLite file on the gateway's own disk, and deleted from it once the
database has it; a gateway started on the same database (the same spool file) loads
what is there and writes it first.

    outage:   write fails -> waiting (memory) + spool.add      (the request goes on)
    back:     retry commits a batch -> spool.remove(its ids)
    restart:  spool.load() -> waiting -> retried as above

A record is never counted twice: the store's insert is idempotent on `record_id`, so a
record committed just before the process died, still in the spool, is skipped when it
is written again (and its budget reservation, already given back, frees nothing).
Several gateways on one machine and database may share the file (SQLite's locks); one
of them may write another's records, which is harmless for the same reason.

SQLite in WAL mode with `synchronous=NORMAL`: a commit survives the process being
killed (it is in the WAL file, written before the call returns), not a power loss.
The file is created on the first record that waits, so a gateway that never saw an
outage leaves none.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from sluice.gateway.store import UsageRecord

Item = tuple[UsageRecord, str | None]  # a record and the budget reservation it gives back

_SCHEMA = ("CREATE TABLE IF NOT EXISTS waiting (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
           "record_id TEXT NOT NULL UNIQUE, record TEXT NOT NULL, reservation TEXT)")


class LedgerSpool:
    """One spool file; thread-safe (one connection behind a lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _open(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=10)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
            self._conn = conn
        return self._conn

    def add(self, items: Iterable[Item]) -> None:
        """Keep `items` (records without a `record_id` cannot be told apart when written
        again, so they stay in memory only)."""
        rows = [(r.record_id, json.dumps(asdict(r)), reservation)
                for r, reservation in items if r.record_id is not None]
        if not rows:
            return
        with self._lock:
            self._open().executemany(
                "INSERT OR IGNORE INTO waiting (record_id, record, reservation) "
                "VALUES (?, ?, ?)", rows)

    def remove(self, record_ids: Iterable[str | None]) -> None:
        """Forget records the database now has (or refused for good)."""
        ids = [(rid,) for rid in record_ids if rid is not None]
        if not ids or (self._conn is None and not self.path.exists()):
            return
        with self._lock:
            self._open().executemany("DELETE FROM waiting WHERE record_id = ?", ids)

    def load(self) -> list[Item]:
        """Every record in the spool, oldest first (none when there is no file)."""
        if self._conn is None and not self.path.exists():
            return []
        with self._lock:
            rows = self._open().execute(
                "SELECT record, reservation FROM waiting ORDER BY seq").fetchall()
        return [(UsageRecord(**json.loads(record)), reservation) for record, reservation in rows]

    def __len__(self) -> int:
        if self._conn is None and not self.path.exists():
            return 0
        with self._lock:
            return int(self._open().execute("SELECT count(*) FROM waiting").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
