"""The simulated engine's KV connector: prompts' KV handed from a prefill replica to a decode replica through a
shared folder, as vLLM's ExampleConnector (shared storage) does on one host.

`save(hashes)`: a prefill replica that computed a prompt writes one empty file named by its last full block's hash
(a block hash names its whole prefix). `lookup(hashes, start)`: a replica finds the longest prefix of a prompt
stored there, probing from the prompt's end down to `start` (the blocks it already holds); the blocks past `start`
are loaded at the engine's hand-over cost instead of computed. O(prompt blocks) file probes per lookup, one file
per save; the folder is the operator's (a temporary one in tests), never cleaned by the engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class SharedKvStore:
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}.kv"

    def save(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._path(hashes[-1]).touch()

    def lookup(self, hashes: Sequence[int], start: int) -> int:
        """Blocks after the first `start` that the folder holds (the longest stored prefix, less `start`)."""
        for end in range(len(hashes), start, -1):
            if os.path.exists(self._path(hashes[end - 1])):
                return end - start
        return 0


def shared_storage_path(kv_transfer_config: dict[str, object]) -> str | None:
    """ExampleConnector's folder in a vLLM `--kv-transfer-config`."""
    extra = kv_transfer_config.get("kv_connector_extra_config")
    path = extra.get("shared_storage_path") if isinstance(extra, dict) else None
    return path if isinstance(path, str) else None
