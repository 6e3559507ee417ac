"""A rank's own state at the last step boundary, kept where it outlives the rank.

What only one rank holds (its data position, its RNG streams, its micro-batch size, its instability
statistics; ``Guard.rank_state()``) is serialized at every step boundary, kept in memory (the
survivors restore it to redo an interrupted step) and written to a node-local file (a replacement
of the rank reads it there). The file is replaced atomically (write, then rename) but not
fsynced: it must outlive the process, not the machine; the launcher puts it on a memory-backed
file system where there is one (``/dev/shm``). A lost node loses it, and the launcher then falls
back to a group restart.

Encoding: ``torch.save`` costs about 0.8 ms of CPU per step for the 16 kB of a typical rank state
(most of it the zip container), 3 % of a 30 ms step. The state is made of plain values and a few
small CPU tensors (the RNG states), so it is pickled with every tensor turned into its raw bytes
(``(dtype, shape, bytes)``) and read back with an unpickler that refuses every class: nothing but
built-in values can come out of a boundary file, as with ``weights_only=True``. About 0.1 ms per
step. A state holding anything else (a user's ``extra`` entry of another type) falls back to
``torch.save``/``torch.load(weights_only=True)``. Measured by ``benchmarks/inprocess_recovery.py``
(steady-state rows).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint.local import deserialize, serialize

PLAIN = b"P"  # first byte of a blob: pickled plain values (tensors as raw bytes)
TORCH = b"T"  # first byte of a blob: torch.save
_TENSOR = "__trainguard_tensor__"
_ATOMS = (str, int, float, bool, bytes, type(None))


class _Unsupported(Exception):
    """A value the plain encoding does not carry (the blob falls back to ``torch.save``)."""


def _plain(obj: Any) -> Any:
    """``obj`` with every CPU tensor replaced by ``{_TENSOR: (dtype, shape, bytes)}``.

    Raises:
        _Unsupported: a value other than a dict, list, tuple, built-in scalar or CPU tensor.
    """
    if type(obj) in _ATOMS:  # exact types: a subclass (numpy.float64, an IntEnum) pickles by its class
        return obj
    if type(obj) is dict:
        if not all(type(k) in _ATOMS for k in obj):
            raise _Unsupported("a dict key of another type")
        return {k: _plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):  # most are flat (Python's RNG state: 625 ints): kept as they are
        return obj if all(type(v) in _ATOMS for v in obj) else type(obj)(_plain(v) for v in obj)
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
        t = obj.detach().contiguous()
        return {
            _TENSOR: (
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.reshape(-1).view(torch.uint8).numpy().tobytes(),
            )
        }
    raise _Unsupported(type(obj).__name__)


def _unplain(obj: Any) -> Any:
    """Inverse of :func:`_plain`."""
    if type(obj) is dict:
        if _TENSOR in obj and len(obj) == 1:
            dtype, shape, data = obj[_TENSOR]
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return flat.view(getattr(torch, dtype)).reshape(shape)
        return {k: _unplain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_unplain(v) for v in obj)
    return obj


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 (pickle's hook)
        raise pickle.UnpicklingError(f"a step-boundary blob may hold only built-in values, not {module}.{name}")


def encode(state: dict[str, Any]) -> bytes:
    """``state`` as bytes for :func:`decode` (plain pickle where it can, else ``torch.save``)."""
    try:
        return PLAIN + pickle.dumps(_plain(state), protocol=5)
    except _Unsupported:
        return TORCH + serialize(state)


def decode(blob: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode` (tensors come back as fresh CPU tensors).

    Raises:
        pickle.UnpicklingError: a plain blob names a class (it was not written by :func:`encode`).
        ValueError: the blob is of neither kind.
    """
    kind, body = blob[:1], blob[1:]
    if kind == PLAIN:
        return _unplain(_NoClasses(io.BytesIO(body)).load())
    if kind == TORCH:
        return deserialize(body)
    raise ValueError(f"not a step-boundary blob (first byte {kind!r})")


def path_of(directory: Path, rank: int) -> Path:
    """The boundary file of global rank ``rank`` in the node-local ``directory``."""
    return directory / f"rank{rank}.boundary"


class BoundaryState:
    """This rank's state at its last step boundary.

    Args:
        directory: the node-local directory of the boundary files (``None``: memory only).
        rank: global rank.
    """

    def __init__(self, directory: Optional[Path], rank: int):
        self.path = path_of(directory, rank) if directory is not None else None
        self.blob: Optional[bytes] = None
        self.step: Optional[int] = None

    def keep(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (``{"step": N, ...}``, tensors and plain values loadable with
        ``weights_only=True``) as the boundary of step ``N``.

        Raises:
            OSError: the file could not be written.
        """
        self.blob = encode(state)
        self.step = int(state["step"])
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(self.blob)
            os.replace(tmp, self.path)

    def restore(self) -> dict[str, Any]:
        """The state last kept (a fresh copy).

        Raises:
            RuntimeError: nothing was kept yet.
        """
        if self.blob is None:
            raise RuntimeError("no step boundary state was kept yet")
        return decode(self.blob)

    def close(self) -> None:
        """Remove this rank's file (a finished or stopped rank leaves none behind)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read(directory: Path, rank: int) -> dict[str, Any]:
    """A lost rank's last boundary state, for its replacement.

    Raises:
        FileNotFoundError: the rank kept none (it died before its first step boundary).
    """
    return decode(path_of(directory, rank).read_bytes())
