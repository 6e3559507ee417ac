"""A rank's own state at the last step boundaries, kept where it outlives the rank.

What only one rank holds (its data position, its RNG streams, the user's extra state;
``Guard.local_state()``) is serialized at every step boundary, kept in memory (the survivors
restore it to redo an interrupted step) and written to a node-local file (a replacement of the
rank reads it there). What every rank holds alike (scheduler, instability statistics, micro-batch
size) comes from a survivor instead. The files (two slots, see :class:`BoundaryState`) are not
fsynced: they must outlive the process, not the machine; the launcher puts them on a memory-backed
file system where there is one (``/dev/shm``). A lost node loses it: where spare nodes may take
a lost node's place, each write is also *mirrored* into the recovery store on node 0 (``mirror``,
one store round trip per kept boundary), and a replacement on another node reads it there
(:func:`parse_slot` on what the store holds).

Encoding: ``torch.save`` costs about 0.8 ms of CPU per step for the 16 kB of a typical rank state
(most of it the zip container), 3 % of a 30 ms step. The state is made of plain values and a few
small CPU tensors (the RNG states), so it is pickled (in C, one pass) with every tensor turned into a call of
:func:`tensor_from_bytes` on its raw bytes, and read back with an unpickler that refuses every other
class or callable: nothing but built-in values and tensors can come out of a boundary file, as with
``weights_only=True``. About 0.1 ms per step. A state holding anything else (a user's ``extra`` entry of another type) falls back to
``torch.save``/``torch.load(weights_only=True)``. The whole steady-state cost is measured by
``benchmarks/inprocess_overhead.py``.

Copy-on-change: an entry named *stable* (the RNG states:
:class:`~trainguard.state.trainstate.RNGState` hands out the same dict while no generator moved,
and the same entry of a generator that did not move) is encoded apart from the others
(:func:`encode_parts`), by generator, and when its value is the very object kept at the boundary
before, that boundary's encoding is reused. A loop that draws no random number of the host's in a
step then encodes only its step number and data position; one that draws from one generator (a
CUDA generator's dropout) encodes that generator's state alone.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..checkpoint.local import deserialize, serialize
from ..dist import tensor_from_bytes  # the only callable a plain boundary blob may name

PLAIN = b"P"  # first byte of a blob: pickled plain values (tensors as raw bytes)
TORCH = b"T"  # first byte of a blob: torch.save
PARTS = b"Q"  # first byte of a blob: the pickled (blob of the other entries, {stable key: its blob, or {item: blob}}) (encode_parts)


class _Unsupported(Exception):
    """A value the plain encoding does not carry (the blob falls back to ``torch.save``)."""


class _Pickler(pickle.Pickler):
    """Pickles built-in values as pickle does (in C, without calling back here) and CPU tensors as
    :func:`tensor_from_bytes` calls; anything else raises :class:`_Unsupported`."""

    def reducer_override(self, obj: Any) -> Any:  # pickle's hook, for every non-built-in value
        if obj is tensor_from_bytes:
            return NotImplemented  # pickled by reference, as pickle does for a function
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
            try:
                data = obj.numpy().tobytes()  # C order, as reshape(-1) reads it; 3x faster than the view below
            except TypeError:  # a dtype NumPy lacks (bfloat16, ...)
                data = obj.reshape(-1).view(torch.uint8).numpy().tobytes()
            return tensor_from_bytes, (str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data)
        raise _Unsupported(type(obj).__name__)  # numpy.float64, an IntEnum, OrderedDict, a Parameter...


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 (pickle's hook)
        if (module, name) == (tensor_from_bytes.__module__, "tensor_from_bytes"):
            return tensor_from_bytes
        raise pickle.UnpicklingError(f"a step-boundary blob may hold only built-in values, not {module}.{name}")


def encode(state: Any) -> bytes:
    """``state`` as bytes for :func:`decode` (plain pickle where it can, else ``torch.save``)."""
    buf = io.BytesIO()
    buf.write(PLAIN)
    try:
        _Pickler(buf, protocol=5).dump(state)
    except _Unsupported:
        return TORCH + serialize(state)
    return buf.getvalue()


def encode_parts(
    state: dict[str, Any], stable: tuple[str, ...], reuse: dict[str, tuple[Any, Any, Any]]
) -> tuple[bytes, dict[str, tuple[Any, Any, Any]]]:
    """``state`` as bytes for :func:`decode`: its ``stable`` entries each encoded apart with
    :func:`encode`, the others together. A stable entry whose value is a ``dict`` (the RNG states,
    by generator) is encoded item by item.

    Reuse, by identity (the caller's promise: a stable value or item is never changed in place): a
    stable entry whose value *is* the value of ``reuse[key]`` takes its encoding whole; else each
    item of a ``dict`` that *is* the item of that name when ``reuse[key]`` was encoded takes that
    item's encoding (a generator that did not move, beside one that did).

    Returns:
        the bytes, and the ``reuse`` mapping for the next call: ``{stable key: (value, its
        encoding: bytes, or {item name: bytes} for a dict, the items as they were encoded)}``.
    """
    rest = {key: value for key, value in state.items() if key not in stable}
    kept: dict[str, tuple[Any, Any, Any]] = {}
    for key in stable:
        if key not in state:
            continue
        value, held = state[key], reuse.get(key)
        if held is not None and held[0] is value:
            kept[key] = held
        elif type(value) is dict:
            old_items, old = (held[2], held[1]) if held is not None and type(held[1]) is dict else ({}, {})
            items = dict(value)
            kept[key] = (
                value,
                {n: old[n] if n in old and old_items.get(n) is v else encode(v) for n, v in items.items()},
                items,
            )
        else:
            kept[key] = (value, encode(value), None)
    apart = {key: encoding for key, (_, encoding, _) in kept.items()}
    return PARTS + pickle.dumps((encode(rest), apart), protocol=5), kept


def decode(blob: bytes) -> Any:
    """Inverse of :func:`encode` and :func:`encode_parts` (tensors come back as fresh CPU tensors).

    Raises:
        pickle.UnpicklingError: a plain blob names a class (it was not written by :func:`encode`).
        ValueError: the blob is of none of the kinds.
    """
    kind, body = blob[:1], blob[1:]
    if kind == PLAIN:
        return _Unpickler(io.BytesIO(body)).load()
    if kind == TORCH:
        return deserialize(body)
    if kind == PARTS:
        rest, apart = _Unpickler(io.BytesIO(body)).load()
        if not (isinstance(rest, bytes) and isinstance(apart, dict) and all(map(_is_part, apart.values()))):
            raise ValueError("not a step-boundary blob (its parts are not blobs)")
        return {**decode(rest), **{key: _decode_part(part) for key, part in apart.items()}}
    raise ValueError(f"not a step-boundary blob (first byte {kind!r})")


def _is_part(part: Any) -> bool:
    """A stable entry's encoding in a ``PARTS`` blob: a blob, or ``{item name: blob}``."""
    return type(part) is bytes or (type(part) is dict and all(type(b) is bytes for b in part.values()))


def _decode_part(part: Any) -> Any:
    return decode(part) if type(part) is bytes else {name: decode(b) for name, b in part.items()}


def path_of(directory: Path, rank: int, slot: int) -> Path:
    """Boundary file ``slot`` (0 or 1) of global rank ``rank`` in the node-local ``directory``."""
    return directory / f"rank{rank}.boundary.{slot}"


# a slot file: this header, then the encoded state; a slot whose magic, length or CRC-32 does not
# match (never written, cleared, or cut short by the rank's death in the middle of the write) is empty
HEADER = struct.Struct("<8sqqI")  # magic, step, length of the state in bytes, CRC-32 of the state
MAGIC = b"TGBOUND1"
EMPTY = HEADER.pack(b"\0" * 8, 0, 0, 0)


class BoundaryState:
    """This rank's own state at its last two step boundaries.

    Two, because a rank can die in the moment between keeping the state of step ``N`` (just
    before the last collective of step ``N``) and that collective's completion: its peers then
    redo step ``N`` from boundary ``N - 1``; once the collective completed they are at ``N``. The
    replacement takes whichever of the two its peers agree on (see ``Guard._meet``).

    On disk, two slot files opened once: a boundary is one ``pwrite`` of a header and the state
    into the slot that does not hold the boundary kept before it (no open, rename or second
    encoding per step: about 37 µs per kept boundary in all, encoding included;
    ``benchmarks/boundary_keep.py``). A rank killed
    in the middle of that write leaves a slot whose CRC does not match: empty to :func:`read`,
    which still finds the boundary before it in the other slot.

    Args:
        directory: the node-local directory of the boundary files (``None``: memory only).
        rank: global rank.
        mirror: ``mirror(slot, data)`` is called with each slot write's bytes (header and state)
            once the file holds them, to keep a copy off this node (spare nodes); it returns once
            the copy is held, before the step's last collective is sent. ``None``: no copy.
        stable: keys whose value, passed again as the very same object, is unchanged (the caller
            never changes it in place): its encoding is reused (copy-on-change, see the module doc).
    """

    def __init__(
        self,
        directory: Optional[Path],
        rank: int,
        mirror: Optional[Callable[[int, bytes], None]] = None,
        stable: tuple[str, ...] = (),
    ):
        self.directory, self.rank, self.mirror, self.stable = directory, rank, mirror, stable
        self._reuse: dict[str, tuple[Any, Any, Any]] = {}  # stable key -> (value, its encoding, items), last kept
        self._fds: list[int] = []  # the two slot files, opened at the first keep
        self._slot_of: dict[int, int] = {}  # step -> the slot holding it
        self.kept: dict[int, bytes] = {}  # step -> encoded state, the newest two

    def renumber(self, rank: int) -> None:
        """Keep this rank's files under the number ``rank`` from now on (the group shrank in place;
        the old files are removed now, before any rank keeps a boundary under its new number)."""
        self.close()
        self.rank = rank
        self._slot_of = {}

    @property
    def step(self) -> Optional[int]:
        """The newest boundary kept (``None`` before the first)."""
        return max(self.kept, default=None)

    def keep(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (``{"step": N, ...}``, tensors and plain values loadable with
        ``weights_only=True``) as the boundary of step ``N``; the one before stays, older go.

        Raises:
            OSError: a slot file could not be written.
        """
        step = int(state["step"])
        older = [s for s in sorted(self.kept) if s < step][-1:]  # the boundary before this one
        self.kept = {s: self.kept[s] for s in older}
        blob, self._reuse = encode_parts(state, self.stable, self._reuse)
        self.kept[step] = blob
        if self.directory is None:
            return
        if not self._fds:
            self._fds = [
                os.open(path_of(self.directory, self.rank, slot), os.O_RDWR | os.O_CREAT, 0o600) for slot in (0, 1)
            ]
        if older and older[0] not in self._slot_of:  # kept before the files were (re)named: write it too
            self._write(0, older[0], self.kept[older[0]])
        slot = 1 - self._slot_of[older[0]] if older else 0
        self._write(slot, step, blob)
        if not older:  # the first boundary, or a step back (rollback): the other slot holds nothing kept
            os.pwrite(self._fds[1 - slot], EMPTY, 0)
            if self.mirror is not None:
                self.mirror(1 - slot, EMPTY)
        self._slot_of = {s: self._slot_of[s] for s in (*older, step)}

    def _write(self, slot: int, step: int, blob: bytes) -> None:
        data = whole = HEADER.pack(MAGIC, step, len(blob), zlib.crc32(blob)) + blob
        while data:  # one write of tens of kB on a memory-backed file system
            data = data[os.pwrite(self._fds[slot], data, HEADER.size + len(blob) - len(data)) :]
        self._slot_of[step] = slot
        if self.mirror is not None:
            self.mirror(slot, whole)

    def restore(self, step: int) -> dict[str, Any]:
        """The state kept for step ``step`` (a fresh copy).

        Raises:
            KeyError: no state of that step is kept (names the steps that are).
        """
        if step not in self.kept:
            raise KeyError(f"no step boundary state of step {step} (kept: {sorted(self.kept)})")
        return decode(self.kept[step])

    def close(self) -> None:
        """Close and remove this rank's files (a finished or stopped rank leaves none behind)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self.directory is not None:
            for slot in (0, 1):
                path_of(self.directory, self.rank, slot).unlink(missing_ok=True)


def parse_slot(data: Optional[bytes]) -> Optional[tuple[int, dict[str, Any]]]:
    """``(step, state)`` of one slot's bytes (a file's or its mirror's), ``None`` when it holds
    none (missing, cleared, cut short: magic, length or CRC-32 do not match)."""
    if data is None or len(data) < HEADER.size:
        return None
    magic, step, length, crc = HEADER.unpack_from(data)
    blob = data[HEADER.size : HEADER.size + length]
    if magic == MAGIC and len(blob) == length and zlib.crc32(blob) == crc:
        return step, decode(blob)
    return None


def read(directory: Path, rank: int) -> dict[int, dict[str, Any]]:
    """A lost rank's last boundary states, ``{step: state}``, for its replacement.

    Raises:
        FileNotFoundError: the rank kept none (it died before its first step boundary was written).
    """
    found: dict[int, dict[str, Any]] = {}
    for slot in (0, 1):
        try:
            parsed = parse_slot(path_of(directory, rank, slot).read_bytes())
        except FileNotFoundError:
            continue
        if parsed is not None:
            found[parsed[0]] = parsed[1]
    if not found:
        raise FileNotFoundError(f"no step boundary of rank {rank} in {directory}")
    return found
