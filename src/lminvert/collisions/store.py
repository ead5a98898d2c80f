"""On-disk, resumable store of N vectors per layer: one float32 ``.npy`` memmap per layer plus a progress file.

Rows are written in fixed chunks (all layers of a chunk at once, then flushed); the progress file, replaced
atomically, lists the finished chunks. A run interrupted at any point resumes with the chunks not listed,
and never trusts a chunk whose rows might be half written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ..errors import LminvertError
from ..paths import read_json, write_json

PROGRESS = "progress.json"


class StateStore:
    """``n`` rows of dimension ``d`` for each of ``layers``, filled chunk by chunk in ``directory``."""

    def __init__(self, directory: str | Path, n: int, d: int, layers: Iterable[int], chunk_size: int) -> None:
        self.directory = Path(directory)
        self.n, self.d, self.chunk_size = int(n), int(d), int(chunk_size)
        self.layers = [int(x) for x in layers]
        self.directory.mkdir(parents=True, exist_ok=True)
        shape = {"n": self.n, "d": self.d, "layers": self.layers, "chunk_size": self.chunk_size}
        path = self.directory / PROGRESS
        if path.exists():
            progress = read_json(path)
            if {key: progress.get(key) for key in shape} != shape:
                raise LminvertError(
                    f"{self.directory} holds states of another shape ({ {k: progress.get(k) for k in shape} }); "
                    "use a new output directory"
                )
            self.done = set(int(c) for c in progress.get("done", []))
        else:
            self.done = set()
            for layer in self.layers:  # (re)create the arrays: nothing in them is trusted yet
                np.lib.format.open_memmap(self.path(layer), mode="w+", dtype=np.float32, shape=(self.n, self.d))
            write_json(path, {**shape, "done": []})
        self._shape = shape

    @property
    def n_chunks(self) -> int:
        return (self.n + self.chunk_size - 1) // self.chunk_size

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_size
        return start, min(start + self.chunk_size, self.n)

    def pending(self) -> list[int]:
        return [c for c in range(self.n_chunks) if c not in self.done]

    @property
    def complete(self) -> bool:
        return len(self.done) == self.n_chunks

    def path(self, layer: int) -> Path:
        return self.directory / f"layer_{layer:03d}.npy"

    def write_chunk(self, chunk: int, rows: Mapping[int, np.ndarray]) -> None:
        """Store the rows of ``chunk`` for every layer, flush them, then mark the chunk done."""
        start, stop = self.chunk_range(chunk)
        if set(rows) != set(self.layers):
            raise ValueError(f"chunk {chunk}: got layers {sorted(rows)}, expected {self.layers}")
        for layer, values in rows.items():
            if values.shape != (stop - start, self.d):
                raise ValueError(f"chunk {chunk}, layer {layer}: shape {values.shape} != {(stop - start, self.d)}")
            array = np.load(self.path(layer), mmap_mode="r+")
            array[start:stop] = values
            array.flush()
            del array
        self.done.add(chunk)
        write_json(self.directory / PROGRESS, {**self._shape, "done": sorted(self.done)})

    def layer(self, layer: int) -> np.ndarray:
        """The finished ``[n, d]`` float32 array of ``layer`` (read-only memmap)."""
        if not self.complete:
            raise LminvertError(f"{self.directory}: states are not complete ({len(self.done)}/{self.n_chunks} chunks)")
        return np.load(self.path(layer), mmap_mode="r")
