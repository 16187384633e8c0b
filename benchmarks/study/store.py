"""The study's record: one JSON line per finished trial, the commit point of a trial.

A trial counts as done once its line is in ``trials.jsonl``; a study killed before that
(mid-run, or mid-write: a torn last line is dropped) runs the trial again from scratch.
The protocol the study started with is kept in ``protocol.json``; a study continued under
another protocol is refused, so every trial of one report comes from one protocol.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["ProtocolMismatchError", "TrialStore", "check_protocol"]


class ProtocolMismatchError(ValueError):
    """The study directory was started under another protocol."""


class TrialStore:
    """The trials of a study, in the order they finished.

    Args:
        path: The JSON-lines file (created on the first :meth:`append`).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # trials may finish side by side (study.driver)
        self.records: list[dict[str, Any]] = self._load()

    def _load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]  # a line without its newline was torn
        if len(complete) != len(data):
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]

    def done(self, trial_id: str) -> bool:
        return any(record["id"] == trial_id for record in self.records)

    def get(self, trial_id: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["id"] == trial_id), None)

    def append(self, record: dict[str, Any]) -> None:
        """Add one finished trial: a single write of one line, flushed to disk."""
        line = (json.dumps(record, allow_nan=True) + "\n").encode()
        with self._lock:
            self._write(line)
            self.records.append(record)

    def _write(self, line: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def select(self, **fields: Any) -> list[dict[str, Any]]:
        """The records whose fields equal ``fields``, in order."""
        return [r for r in self.records if all(r.get(k) == v for k, v in fields.items())]


def check_protocol(directory: Path, protocol: dict[str, Any]) -> None:
    """Keep the study's protocol in ``protocol.json``; refuse to continue under another.

    ``protocol`` holds ``study`` (settings of the whole study) and ``workloads`` (name ->
    settings). The study settings and every workload already in the file must match; a
    workload not yet in it is added (a study may run one workload, then the other).

    Raises:
        ProtocolMismatchError: Something differs (the message names what).
    """
    path = directory / "protocol.json"
    saved: dict[str, Any] = {"study": protocol["study"], "workloads": {}}
    if path.exists():
        saved = json.loads(path.read_text())
    current = json.loads(json.dumps(protocol))  # tuples as lists, as the file has them
    differing = [
        f"study.{k}"
        for k in sorted(set(saved["study"]) | set(current["study"]))
        if saved["study"].get(k) != current["study"].get(k)
    ]
    differing += [
        f"workload {name}"
        for name, settings in sorted(current["workloads"].items())
        if name in saved["workloads"] and saved["workloads"][name] != settings
    ]
    if differing:
        raise ProtocolMismatchError(
            f"{directory} holds a study under another protocol (differs in: "
            f"{', '.join(differing)}); continue it with the same options or use a new --out"
        )
    merged = {**saved, "workloads": {**saved["workloads"], **current["workloads"]}}
    if merged != saved or not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(merged, indent=1) + "\n")
        temporary.replace(path)
