"""Small helpers over ``torch.distributed`` that also work in a single process without a group.

The object collectives (:func:`broadcast_object`, :func:`gather_objects`) never unpickle what a
peer sent with plain pickle, as ``torch.distributed``'s ``broadcast_object_list`` and
``all_gather_object`` do: whoever joins a group's store can be a peer (the stores of the first
generation are torch's, not sealed). They carry the object in a ``uint8`` tensor,
pickled so that only built-in values, CPU tensors (as raw bytes, as the step-boundary blobs of
:mod:`trainguard.rejoin.boundary`), paths and trainguard's own dataclasses (by name and fields,
rebuilt without calling their code) are in it, and read back by an unpickler that refuses every
other class and callable. The dataclasses are an explicit list (:data:`CROSSING`): each field
that arrives is checked against the class's field types, and a class may name a check of what it
points at (a :class:`~trainguard.checkpoint.store.Checkpoint` from a peer is refused when its
directory or a file in it could be another user's, as a local one is, before anything reads it).
Lengths a peer announces are capped (:data:`MAX_OBJECT_BYTES`) before anything is allocated. What that encoding does not carry (a user's object among the values)
goes as ``torch.save`` and comes back through ``torch.load(weights_only=True)``, which refuses
classes outside torch's allow-list; a refusal raises on the receiving rank instead of running.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist

PLAIN, TORCH = b"P", b"T"  # first byte of what travels: the restricted pickle, or torch.save


def _path(text: str) -> Path:
    """A path that travelled (the only callable besides :func:`_dataclass` and the tensor one)."""
    return Path(text)


MAX_OBJECT_BYTES = 1 << 30  # the longest object a peer may announce (bytes); longer: PeerValueError


class PeerValueError(pickle.UnpicklingError):
    """What a peer sent is refused: a dataclass not in :data:`CROSSING`, a field of the wrong
    name or type, a path that could be another user's, or a length above :data:`MAX_OBJECT_BYTES`
    (the message names it)."""


def _private_checkpoint(ckpt: Any) -> None:
    """A checkpoint named by a peer: its directory (when it exists here) and each file in it must
    be this user's and not writable by others, and none a symbolic link, as a local one's
    (:func:`~trainguard.rundir.exposed`): DCP unpickles its ``.metadata``.

    Raises:
        PeerValueError: naming the path and why.
    """
    from .rundir import exposed

    path = ckpt.path
    if not path.is_absolute() or ".." in path.parts:
        raise PeerValueError(f"a checkpoint path from a peer must be absolute and without '..': {path}")
    if not path.exists() and not path.is_symlink():
        return
    for p in (path, *(sorted(path.iterdir()) if path.is_dir() and not path.is_symlink() else ())):
        why = "it is a symbolic link" if p.is_symlink() else exposed(p)
        if why:
            raise PeerValueError(f"a checkpoint from a peer is refused: {p} is not private: {why}")


# the dataclasses that cross ranks, by "module:qualname": their checks of what they point at
CROSSING: dict[str, Any] = {
    "trainguard.checkpoint.store:Checkpoint": _private_checkpoint,
}


def _field_types(cls: type) -> dict[str, type]:
    """``cls``'s fields and their types (plain classes only: what :data:`CROSSING` lists has no other)."""
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass(name: str, fields: dict[str, Any]) -> Any:
    """An instance of the dataclass ``name`` (``module:qualname``, listed in :data:`CROSSING`) with
    ``fields`` set, built without calling its ``__init__``: the fields must be the class's, each
    of its type (``bool`` is no ``int``), and the class's check must pass.

    Raises:
        PeerValueError: ``name`` is not listed, a field is missing, extra or of another type, or
            the check refuses.
    """
    if name not in CROSSING:
        raise PeerValueError(f"{name} is not one of the dataclasses that cross ranks (trainguard.dist.CROSSING)")
    module, _, qualname = name.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    types = _field_types(cls)
    if not isinstance(fields, dict) or set(fields) != set(types):
        raise PeerValueError(f"{name}: expected the fields {sorted(types)}, got {sorted(map(str, fields))[:10]}")
    for key, want in types.items():
        value = fields[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise PeerValueError(f"{name}.{key}: expected {want.__name__}, got {type(value).__name__}")
    obj = object.__new__(cls)
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    CROSSING[name](obj)
    return obj


class _Unsupported(Exception):
    """A value the restricted pickle does not carry (it goes as ``torch.save``)."""


def tensor_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """A CPU tensor of ``dtype`` (``"int64"``, ...) and ``shape`` from its raw bytes (C order): the
    constructor of a tensor in what ranks send each other and in a step-boundary blob
    (:mod:`trainguard.rejoin.boundary`)."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Built-in values as pickle does; CPU tensors, paths and trainguard's dataclasses as calls
    of the three constructors the unpickler allows; anything else raises :class:`_Unsupported`."""

    def reducer_override(self, obj: Any) -> Any:  # pickle's hook, for every non-built-in value
        if obj is tensor_from_bytes or obj is _path or obj is _dataclass:
            return NotImplemented  # pickled by reference
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
            data = obj.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return tensor_from_bytes, (str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data)
        if isinstance(obj, PurePath):
            return _path, (str(obj),)
        cls = type(obj)
        name = f"{cls.__module__}:{cls.__qualname__}"
        if dataclasses.is_dataclass(obj) and name in CROSSING:
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return _dataclass, (name, fields)
        if dataclasses.is_dataclass(obj) and cls.__module__.startswith("trainguard."):
            raise TypeError(f"{name} does not cross ranks: add it to trainguard.dist.CROSSING")
        raise _Unsupported(cls.__name__)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 (pickle's hook)
        allowed = {
            (__name__, "tensor_from_bytes"): tensor_from_bytes,
            (__name__, "_path"): _path,
            (__name__, "_dataclass"): _dataclass,
        }
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"an object sent between ranks may not name {module}.{name}")
        return allowed[(module, name)]


def encode(obj: Any) -> bytes:
    """``obj`` as bytes for :func:`decode` (the restricted pickle where it can, else ``torch.save``)."""
    buf = io.BytesIO()
    buf.write(PLAIN)
    try:
        _Pickler(buf, protocol=5).dump(obj)
    except _Unsupported:
        out = io.BytesIO()
        out.write(TORCH)
        torch.save(obj, out)
        return out.getvalue()
    return buf.getvalue()


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        pickle.UnpicklingError: the bytes name a class or callable :func:`encode` does not write,
            or (``torch.save``) one outside ``torch.load(weights_only=True)``'s allow-list.
        ValueError: not bytes :func:`encode` wrote.
    """
    kind, body = data[:1], data[1:]
    if kind == PLAIN:
        return _Unpickler(io.BytesIO(body)).load()
    if kind == TORCH:
        return torch.load(io.BytesIO(body), weights_only=True)
    raise ValueError(f"not an object sent by trainguard.dist (first byte {kind!r})")


def is_dist() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_dist() else 1


def backend() -> str | None:
    """The default group's backend (``"gloo"``, ``"nccl"``), ``None`` without a process group."""
    return dist.get_backend() if is_dist() else None


def barrier(group: Any = None) -> None:
    """Barrier across all ranks (of ``group``, default the world); no-op in a single process."""
    if is_dist():
        dist.barrier(group=group)


def destroy() -> None:
    """Destroy the default process group, if any (before a deliberate exit)."""
    if is_dist():
        dist.destroy_process_group()


def destroy_group(group: Any) -> None:
    """Destroy a process group this process created with ``new_group`` (no-op for ``None``, or when
    the default group is already gone, which takes every group with it)."""
    if group is not None and is_dist():
        dist.destroy_process_group(group)


def all_reduce_max(values: list[int], group: Any = None) -> list[int]:
    """Element-wise max of a short int vector across ranks, in one collective.

    Args:
        values: per-rank flags or small integers.
        group: process group (default the world).
    Returns:
        The maxima, same length. On CUDA-only backends (NCCL) the tensor goes through the device.
    """
    if not is_dist():
        return list(values)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _device(group: Any) -> torch.device:
    """Where a collective's tensors live: the current CUDA device on NCCL, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )


def _bytes_tensor(data: bytes, length: int, device: torch.device) -> torch.Tensor:
    """``data`` in a ``uint8`` tensor of ``length`` bytes (zero-padded) on ``device``."""
    t = torch.zeros(length, dtype=torch.uint8)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t.to(device)


def _announced(length: int) -> int:
    """A length a peer announced, refused unless in ``[0, MAX_OBJECT_BYTES]`` (before any allocation).

    Raises:
        PeerValueError: naming the length.
    """
    if not 0 <= length <= MAX_OBJECT_BYTES:
        raise PeerValueError(f"a peer announced an object of {length} bytes (at most {MAX_OBJECT_BYTES})")
    return length


def _from_tensor(t: torch.Tensor, length: int) -> Any:
    """The object in the first ``length`` bytes of ``t`` (:func:`decode`).

    Raises:
        pickle.UnpicklingError: the bytes name a class or callable (not sent by this module).
    """
    return decode(t[:length].cpu().numpy().tobytes())


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Send ``obj`` from global rank ``src`` to every rank (of ``group``) and return it (``src``
    gets ``obj`` itself, the others a copy). Built-in values, containers and CPU tensors travel
    (see the module's docstring); two collectives: the length, then the bytes.

    Raises:
        pickle.UnpicklingError: on a receiving rank, what arrived names a class (a peer that is
            not this module sent it); PeerValueError (one) when it is refused (see the class).
        TypeError: ``obj`` holds a trainguard dataclass not in :data:`CROSSING`.
    """
    if not is_dist():
        return obj
    device, mine = _device(group), dist.get_rank() == src
    data = encode(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    length = _announced(int(size.item()))
    buf = _bytes_tensor(data, length, device)
    dist.broadcast(buf, src=src, group=group)
    return obj if mine else _from_tensor(buf, length)


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """All-gather one object per rank (of ``group``); returns the list indexed by rank (group
    rank), each a copy as it travelled (see the module's docstring). Two collectives: the lengths,
    then the bytes (padded to the longest).

    Raises:
        pickle.UnpicklingError: what a peer sent names a class; PeerValueError (one) when it is
            refused (see the class).
        TypeError: ``obj`` holds a trainguard dataclass not in :data:`CROSSING`.
    """
    if not is_dist():
        return [obj]
    device, data = _device(group), encode(obj)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [_announced(int(s.item())) for s in sizes]
    longest = max(lengths)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(bufs, _bytes_tensor(data, longest, device), group=group)
    return [_from_tensor(b, length) for b, length in zip(bufs, lengths)]


def new_cpu_group() -> Any:
    """A new gloo process group over all ranks (``None`` in a single process).

    Background work (the checkpoint writer, the liveness ping) runs its collectives on a group of
    its own: sharing the training group with DDP's all-reduces from another thread can mismatch
    collectives (measured: ``dcp.async_save`` on the default gloo group timed out). A collective
    itself: every rank must call it, in the same order as other ``new_group`` calls.
    """
    return dist.new_group(backend="gloo") if is_dist() else None
