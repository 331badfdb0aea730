"""What `kvmesh fetch --summary-file` writes when it is done: one JSON object, the model's size and
the fetch's time. In an engine pod the fetch-model init container writes it to its termination
message (`/dev/termination-log`), where the operator reads it into status.modelStorage."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True, slots=True)
class FetchSummary:
    uri: str
    size_bytes: int         # the model's bytes on disk (the cached copy's when nothing was read)
    fetched_bytes: int      # read from the store by this fetch (0: the node cache had it)
    seconds: float          # the fetch's wall time: listing, waiting for the lock, reading, checks

    def to_json(self) -> str:
        return json.dumps({"uri": self.uri, "sizeBytes": self.size_bytes,
                           "fetchedBytes": self.fetched_bytes, "fetchSeconds": round(self.seconds, 3)})

    @classmethod
    def parse(cls, text: str | None) -> FetchSummary | None:
        """The summary in a termination message; None for anything else (a failed fetch's
        message is its last log lines)."""
        try:
            d = json.loads(text or "")
            return cls(str(d["uri"]), int(d["sizeBytes"]), int(d["fetchedBytes"]),
                       float(d["fetchSeconds"]))
        except (ValueError, TypeError, KeyError):
            return None


def model_bytes(path: Path) -> int:
    """Bytes of the files of a model directory (or of a single model file)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
