"""Run a Python module under tracemalloc (bench/soak.py --trace-memory): `python -m bench._tracemem DIR module args`.

Each SIGUSR1 writes a snapshot of the traced allocations to DIR/<n>.snap (n = 0, 1, ...; renamed there once
whole), after a full collection, so the parent can diff two points of a run by allocation site. The handler runs in
the main thread between bytecodes, so the snapshot sees the event loop's objects in a consistent state. Tracing
costs CPU and its own memory (the RSS of a traced run is not the product's); a diagnostic, never on by default.
"""

from __future__ import annotations

import gc
import runpy
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> None:
    out, module, *args = sys.argv[1:]
    snapshots = 0

    def dump(_signum: int, _frame: FrameType | None) -> None:
        nonlocal snapshots
        gc.collect()
        partial = Path(out) / f"{snapshots}.part"
        tracemalloc.take_snapshot().dump(str(partial))
        partial.rename(partial.with_suffix(".snap"))
        snapshots += 1

    tracemalloc.start(12)
    signal.signal(signal.SIGUSR1, dump)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
