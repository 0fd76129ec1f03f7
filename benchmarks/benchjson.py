"""What every benchmark here does last: stamp the load average at the end and write its JSON where --out says."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write(out: dict, path: str) -> None:
    """Record the 1-minute load average as ``loadavg_end``, write ``out`` to ``path`` (folders made) and say so."""
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
