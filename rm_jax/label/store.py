"""The labeller's files: the append-only output keyed by id, errors, rejects, stats.

The output is the resume state: an id is done when its line is in OUT. A rerun reads OUT first,
skips those ids, and appends the rest, so no id is ever written twice. Lines are written whole
(one write of the encoded line with its newline, then a flush), so a kill -9 can tear at most
the last line; `scan_and_repair` cuts such a tail back to the last complete line before appending.
It reads OUT as a stream and keeps only each id's outcome, so a resume costs the ids' memory, not
the rows'.
Anything else wrong inside OUT (a complete line that is not JSON, an id twice) is refused with
the line number: that file was edited by hand, and guessing would lose or duplicate labels.
"""

from __future__ import annotations

import dataclasses
import json
import os

from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL


def errors_path(out: str) -> str:
    return out + ".errors.jsonl"


def rejects_path(out: str) -> str:
    return out + ".rejects.jsonl"


def stats_path(out: str) -> str:
    return out + ".stats.json"


@dataclasses.dataclass(frozen=True)
class Done:
    """What a labelled line records, for the stats of a resumed run."""
    route: str
    l3: str


# One record per (route, verdict): the resume state of a 33k-row OUT is its ids and 4 objects.
_DONE = {(r, v): Done(r, v) for r in (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY) for v in ("pass", "fail")}


@dataclasses.dataclass(frozen=True)
class ExistingOutput:
    labelled: dict[str, Done]
    repaired_bytes: int        # bytes of a torn last line that were cut off (0: none)


class OutputCorrupt(ValueError):
    pass


def _done_of(raw: bytes) -> tuple[str, Done]:
    row = json.loads(raw)
    sid = str(row["id"])
    route = ROUTE_TOOL_CALL if (row["response"].get("tool_calls") or []) else ROUTE_TEXT_ONLY
    l3 = row["label"]["l3"]
    if (route, l3) not in _DONE:
        raise ValueError(f"label.l3 {l3!r} is not 'pass' or 'fail'")
    return sid, _DONE[route, l3]


def scan_and_repair(path: str) -> ExistingOutput:
    """OUT's ids and outcomes, read one line at a time (memory: the ids, not the rows); a torn
    last line is cut off."""
    if not os.path.exists(path):
        return ExistingOutput({}, 0)
    done: dict[str, Done] = {}
    complete_bytes = 0
    torn = 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):     # only the last line can lack its newline: a torn write
                torn = len(raw)
                break
            complete_bytes += len(raw)
            if not raw.strip():
                continue
            try:
                sid, item = _done_of(raw)
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise OutputCorrupt(f"{path}:{i}: not a labelled sample ({type(e).__name__}: {e}); "
                                    "fix or remove the line by hand") from None
            if sid in done:
                raise OutputCorrupt(f"{path}:{i}: id {sid!r} appears twice")
            done[sid] = item
    if torn:
        with open(path, "r+b") as f:
            f.truncate(complete_bytes)
    return ExistingOutput(done, torn)


class JsonlAppender:
    """One whole line per write, flushed at once (a crash leaves complete lines and at most one
    torn tail, which scan_and_repair cuts)."""

    def __init__(self, path: str, mode: str = "ab"):
        self._f = open(path, mode)

    def write(self, obj: dict) -> None:
        self._f.write((json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class RunLock:
    """An exclusive lock on OUT.lock for the whole run: two labellers appending to one OUT would
    each miss the other's ids and write them twice. Released when the process ends (kill -9
    included: the kernel drops flock locks with the process)."""

    def __init__(self, out: str):
        import fcntl
        self.path = out + ".lock"
        self._f = open(self.path, "a")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise ValueError(f"{out}: another labeller is writing it (lock {self.path} is held)") from None

    def release(self) -> None:
        self._f.close()


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
