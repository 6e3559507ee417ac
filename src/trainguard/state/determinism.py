"""Everything a bitwise-identical resume needs besides model and optimizer tensors.

* RNG states: Python ``random``, NumPy's global generator, torch CPU and every CUDA device.
  They are captured as plain containers and tensors so that they load with
  ``torch.load(weights_only=True)`` (no arbitrary pickle).
* :func:`state_hash`: SHA-256 over the model and optimizer state, tensors in sorted key order, so
  that two runs compare by one string. Each rank hashes only the shards it holds; the ranks'
  digests are combined in rank order (a collective when a process group exists).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import pickle
import random
import struct
import sys
import sysconfig
from typing import Any, Callable, Optional

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy and torch (CPU and CUDA) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# the memory reads below take id() for an object's address, which holds in CPython only
_CPYTHON = sys.implementation.name == "cpython"


@functools.cache
def _gil_held_reads() -> bool:
    """Whether a memory read of Python's generator is atomic with respect to its methods: a build
    with the GIL. On a free-threaded build (``Py_GIL_DISABLED``) ``random.getstate()`` takes the
    generator object's critical section, which Python code cannot take: there the state is read
    with ``getstate()`` (even where the GIL was enabled again at run time: the build decides).
    ``ctypes.string_at`` is a ``PYFUNCTYPE`` call, so on a GIL build it copies with the GIL held."""
    return not sysconfig.get_config_var("Py_GIL_DISABLED")


# Python's ``random`` state words (624 and the position) as little-endian uint32: packing them costs
# about 10 µs, pickling the tuple of 625 ints about 40 µs
_PY_WORDS = struct.Struct("<625I")


def _python_full() -> tuple[int, bytes, Optional[float]]:
    version, internal, gauss = random.getstate()
    return version, _PY_WORDS.pack(*internal), gauss


def _python_fast(offset: int) -> tuple[int, bytes, Optional[float]]:
    return _python_of(_python_raw(offset), random._inst.gauss_next)


def _python_raw(offset: int) -> bytes:
    """The memory of Python's generator at ``offset`` in its object (see :func:`_python_offset`)."""
    return ctypes.string_at(id(random._inst) + offset, _PY_WORDS.size)


def _python_of(raw: bytes, gauss: Optional[float]) -> tuple[int, bytes, Optional[float]]:
    """Python's state from its object's memory: the position, then the words."""
    return 3, raw[4:] + raw[:4], gauss  # 3: random.Random.VERSION


@functools.cache
def _python_offset() -> Optional[int]:
    """Where CPython's generator object holds its state: the position (an int), then the 624 words,
    right after the object header; read as one block of memory, about 2 µs instead of
    ``random.getstate()`` and packing (25 µs). Checked against ``getstate()`` once; ``None`` where
    it differs (another interpreter, another layout) or where the read could tear (a free-threaded
    build: :func:`_gil_held_reads`): ``getstate()`` is used every time."""
    if not (_CPYTHON and sys.byteorder == "little" and random.Random.VERSION == 3 and _gil_held_reads()):
        return None
    offset = object.__basicsize__
    return offset if _python_fast(offset) == _python_full() else None


def _python_state() -> tuple[int, bytes, Optional[float]]:
    """``(version, the 625 words as bytes, cached Gaussian)`` of Python's global ``random``."""
    offset = _python_offset()
    return _python_full() if offset is None else _python_fast(offset)


# bytes of NumPy's MT19937 state as its bit generator holds it: 624 32-bit words, then the position
_MT_KEYS = 624
_MT_BYTES = _MT_KEYS * 4 + 4


def _numpy_full() -> dict[str, Any]:
    """NumPy's global generator's state through ``get_state``: for MT19937 (NumPy's default) the
    legacy fields; for another bit generator (``np.random.set_bit_generator(np.random.PCG64(1))``,
    whose ``get_state()`` warns and returns a dict, not the legacy 5-tuple) ``{"kind": name,
    "state": ...}``, the dict of ``get_state(legacy=False)`` with its arrays as
    :func:`_encode` gives them."""
    if not isinstance(np.random.get_bit_generator(), np.random.MT19937):
        state = np.random.get_state(legacy=False)
        return {"kind": state["bit_generator"], "state": _encode(state)}
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _encode(value: Any) -> Any:
    """A bit generator's state with each array as ``{"array": uint8 tensor, "dtype", "shape"}``
    (loads with ``weights_only=True``; Python ints of any size, PCG64's 128-bit ones, load too)."""
    if isinstance(value, np.ndarray):
        return {
            "array": torch.from_numpy(value.view(np.uint8).copy()),
            "dtype": str(value.dtype),
            "shape": list(value.shape),
        }
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    """The inverse of :func:`_encode`."""
    if isinstance(value, dict) and set(value) == {"array", "dtype", "shape"}:
        return value["array"].numpy().view(np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


def _restore_numpy(n: dict[str, Any]) -> None:
    """Put NumPy's global generator back to ``n`` (from :func:`_numpy_full`/:func:`_numpy_fast`),
    the saved kind of bit generator first where the global one is of another kind."""
    kind = n["kind"]
    if type(np.random.get_bit_generator()).__name__ != kind:
        np.random.set_bit_generator(getattr(np.random, kind)())
    if "state" in n:
        np.random.set_state(_decode(n["state"]))
    else:
        np.random.set_state((kind, n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))


def numpy_snapshot() -> bytes:
    """NumPy's global generator's whole state as bytes (any bit generator; about 100 µs): equal
    bytes, no draw in between. For comparisons where :func:`rng_fingerprint` is unavailable."""
    return pickle.dumps(np.random.get_state(legacy=False))


def _numpy_fast(gauss_at: int) -> Optional[dict[str, Any]]:
    """The legacy generator's state read from memory (``None``: its bit generator is not MT19937):
    the 2,500 bytes of the MT19937 state through the bit generator's public ``ctypes`` interface,
    the cached Gaussian from the ``RandomState`` object at ``gauss_at``; about 3 µs instead of
    ``np.random.get_state()``'s 80 µs (which copies the key word by word)."""
    bitgen = np.random.get_bit_generator()  # NumPy >= 1.25
    if not isinstance(bitgen, np.random.MT19937):
        return None
    return _numpy_of(*_numpy_raw(bitgen, gauss_at))


def _numpy_raw(bitgen: np.random.MT19937, gauss_at: int) -> tuple[bytes, bytes]:
    """The MT19937 state's bytes, and the 16 bytes of ``has_gauss`` and the cached Gaussian of the
    legacy ``RandomState`` (``gauss_at``: see :func:`_gauss_offset`), read holding the bit
    generator's ``lock`` (as ``get_state()`` and every draw do): never a state half-way through a draw."""
    with bitgen.lock:  # the lock RandomState's draws and get_state() hold (a free-threaded build runs them in parallel)
        mt = ctypes.string_at(bitgen.ctypes.state_address, _MT_BYTES)
        return mt, ctypes.string_at(id(np.random.mtrand._rand) + gauss_at - 8, 16)


def _numpy_of(mt: bytes, gauss_raw: bytes) -> dict[str, Any]:
    """NumPy's state from the MT19937 bytes and the 16 bytes of ``has_gauss`` and the Gaussian."""
    has_gauss, gauss = struct.unpack("=i4xd", gauss_raw)
    return {
        "kind": "MT19937",
        "keys": torch.from_numpy(np.frombuffer(mt, np.uint32, _MT_KEYS).astype(np.int64)),
        "pos": int.from_bytes(mt[-4:], sys.byteorder, signed=True),
        "has_gauss": has_gauss,
        "cached_gaussian": gauss,
    }


def _same_numpy(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "keys" not in a or "keys" not in b:
        return False
    return torch.equal(a["keys"], b["keys"]) and all(
        a[k] == b[k] for k in ("kind", "pos", "has_gauss", "cached_gaussian")
    )


@functools.cache
def _gauss_offset() -> Optional[int]:
    """Where a legacy ``RandomState`` object holds its cached Gaussian: the byte offset of the value
    (a double), ``has_gauss`` (an int) being 8 bytes before it. Found on a scratch instance by
    setting two distinct values through ``set_state`` and finding each once in the object's memory,
    then checked once against the global generator's ``get_state()``; ``None`` if either fails
    (another NumPy or layout: ``get_state()`` is used every time)."""
    if not (_CPYTHON and hasattr(np.random, "get_bit_generator")):
        return None
    rs = np.random.RandomState(0)
    kind, keys, pos, _, _ = rs.get_state()
    found = set()
    for has_gauss, value in ((1, 1234.5678125), (0, -8765.4321875)):
        rs.set_state((kind, keys, pos, has_gauss, value))
        memory = ctypes.string_at(id(rs), type(rs).__basicsize__)
        pattern = struct.pack("=id", has_gauss, value)[:4] + bytes(4) + struct.pack("=d", value)
        if memory.count(pattern) != 1:
            return None
        found.add(memory.index(pattern) + 8)
    if len(found) != 1:
        return None
    offset = found.pop()
    fast = _numpy_fast(offset)
    return offset if fast is not None and _same_numpy(fast, _numpy_full()) else None


def _numpy_state() -> dict[str, Any]:
    """NumPy's global (legacy) generator's state, as :func:`capture_rng` gives it."""
    offset = _gauss_offset()
    return (_numpy_fast(offset) if offset is not None else None) or _numpy_full()


def rng_fingerprint() -> Optional[tuple[Any, ...]]:
    """The raw state of every generator :func:`capture_rng` reads (about 10 kB of bytes without
    CUDA): equal fingerprints mean equal captures, so a capture can be reused while the generators
    have not moved (:class:`~trainguard.state.trainstate.RNGState`), and :func:`capture_of` turns
    one into the capture without reading the generators again. Python's and NumPy's states read
    from memory as :func:`capture_rng` reads them; ``None`` where that fast read is unavailable
    (another interpreter or layout, a NumPy bit generator other than MT19937)."""
    py_at, gauss_at = _python_offset(), _gauss_offset()
    if py_at is None or gauss_at is None:
        return None
    bitgen = np.random.get_bit_generator()
    if not isinstance(bitgen, np.random.MT19937):
        return None
    parts = [
        _python_raw(py_at),
        random._inst.gauss_next,
        *_numpy_raw(bitgen, gauss_at),
        torch.get_rng_state().numpy().tobytes(),
    ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts += [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return tuple(parts)


# rng_fingerprint()'s parts by generator, and each generator's entry of the capture built from them
_SPANS = (("python", slice(0, 2)), ("numpy", slice(2, 4)), ("torch", slice(4, 5)), ("cuda", slice(5, None)))
_BUILD: dict[str, Callable[[tuple[Any, ...]], Any]] = {
    "python": lambda parts: _python_of(*parts),
    "numpy": lambda parts: _numpy_of(*parts),
    "torch": lambda parts: _uint8(parts[0]),
    "cuda": lambda parts: [_uint8(b) for b in parts],
}


def fingerprint_by_generator(fingerprint: Any) -> dict[str, tuple[Any, ...]]:
    """:func:`rng_fingerprint`'s parts by generator (``python``, ``numpy``, ``torch``, ``cuda``
    where CUDA is on), as tuples (one that came through a transfer may hold lists); ``{}`` for
    ``None``."""
    if fingerprint is None:
        return {}
    parts = tuple(fingerprint)
    return {name: _plain(parts[span]) for name, span in _SPANS if parts[span]}


def alike_across_ranks(name: str) -> bool:
    """Whether the generator ``name`` (``python``, ``numpy``, ``torch``, ``cuda``) of two ranks can
    be compared to tell whether they were seeded alike: every one but ``cuda`` where this process
    sees several CUDA devices (each rank of a node then draws from its own device's generator,
    and the states of all devices never match between ranks)."""
    return name != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() <= 1


def _plain(value: Any) -> Any:
    return tuple(_plain(v) for v in value) if isinstance(value, (tuple, list)) else value


def capture_of(
    fingerprint: tuple[Any, ...], before: Optional[tuple[tuple[Any, ...], dict[str, Any]]] = None
) -> dict[str, Any]:
    """What :func:`capture_rng` returned when :func:`rng_fingerprint` gave ``fingerprint``.

    ``before``: an earlier ``(fingerprint, capture_of(fingerprint))``; each generator whose raw
    state is the same in both keeps that capture's entry, the very object (copy-on-change by
    generator: a loop that draws from one generator builds and encodes that one's state alone)."""
    old_fp, old = before if before is not None and len(before[0]) == len(fingerprint) else ((), {})
    state = {}
    for name, span in _SPANS:
        parts = fingerprint[span]
        if parts:  # no "cuda" entry without CUDA
            state[name] = old[name] if name in old and old_fp[span] == parts else _BUILD[name](parts)
    return state


def _uint8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """Return the current RNG states as a ``weights_only``-loadable dict: ``python``: (version,
    the 625 words of ``random.getstate()`` as 2,500 bytes, cached Gaussian), ``numpy``: the legacy
    global generator's fields, ``torch``: the CPU generator's state, ``cuda``: each device's. About
    16 µs on a 2-core CPU, the Python and NumPy states read from memory (kept at every step
    boundary by in-process recovery: :mod:`trainguard.rejoin.boundary`)."""
    state = {
        "python": _python_state(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng`.

    Raises:
        KeyError: ``state`` lacks the Python, NumPy or torch entry.
    """
    version, internal, gauss = state["python"]  # the words: bytes, or a tuple in older checkpoints
    random.setstate((version, _PY_WORDS.unpack(internal) if isinstance(internal, bytes) else tuple(internal), gauss))
    _restore_numpy(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_FORMAT = b"trainguard state hash v2\n"
# bytes of a non-CPU tensor copied to host memory at a time (bounds the host memory the hash needs)
_HOST_CHUNK = 64 << 20


def _hash_bytes(h: hashlib._Hash, t: torch.Tensor) -> None:
    """Feed the raw bytes of ``t`` (row-major, native byte order) to ``h`` without a host copy of
    the whole tensor: a CPU tensor is read in place, another device's in ``_HOST_CHUNK`` pieces."""
    if t.numel() == 0:
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        h.update(flat.numpy())
        return
    for start in range(0, flat.numel(), _HOST_CHUNK):
        h.update(flat[start : start + _HOST_CHUNK].cpu().numpy())


def _tensor_header(key: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(header line, local tensor) of one tensor entry.

    A plain tensor is taken as it is. A ``DTensor`` contributes only this rank's shard
    (``to_local()``, never ``full_tensor()``), and its header names the global shape, the device
    mesh's shape, the placements and the shard's local shape and global offset (as
    ``torch.distributed.checkpoint`` computes them), so that the same bytes at another place of
    the global tensor hash differently.
    """
    if hasattr(t, "to_local") and hasattr(t, "placements"):  # DTensor
        from .. import compat

        local = t.to_local()
        _, offset = compat.local_shape_and_offset(t)
        header = (
            f"{key}:{t.dtype}:{list(t.shape)}:mesh={list(t.device_mesh.shape)}:"
            f"placements={[str(p) for p in t.placements]}:local={list(local.shape)}:offset={list(offset)}\n"
        )
        return header, local
    return f"{key}:{t.dtype}:{list(t.shape)}\n", t


def _update_with(h: hashlib._Hash, key: str, value: Any) -> None:
    """Feed one state entry to ``h``: dict keys in sorted order, list items in order, each tensor
    as its header line then its local bytes, anything else as ``key=<JSON text>``."""
    if isinstance(value, torch.Tensor):
        header, local = _tensor_header(key, value.detach())
        h.update(header.encode())
        _hash_bytes(h, local)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _update_with(h, f"{key}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _update_with(h, f"{key}.{i}", v)
    else:
        h.update(f"{key}={json.dumps(value, default=str)}\n".encode())


def local_state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bytes:
    """SHA-256 (32 raw bytes) of the part of the model's and optimizer's state that this rank holds.

    Not a collective (``get_state_dict`` without full state dicts gathers nothing): DTensor entries
    contribute their local shard, plain tensors (a DDP replica, a non-distributed model) their
    whole bytes. See :func:`state_hash` for the fields hashed.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    h = hashlib.sha256()
    _update_with(h, "model", model_sd)
    if optimizer is not None:
        _update_with(h, "optim", optim_sd)
    return h.digest()


def _gather_digests(digest: bytes, group: Any) -> list[bytes]:
    """All ranks' 32-byte digests (of ``group``), in group-rank order; ``[digest]`` without a group.

    A collective: one all-gather of 32 bytes per rank (through the GPU on a backend without CPU
    support, NCCL).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [digest]
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    device = (
        torch.device("cpu")
        if "gloo" in backend or not torch.cuda.is_available()
        else torch.device("cuda", torch.cuda.current_device())
    )
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.cpu().tolist()) for t in out]


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, group: Any = None) -> str:
    """SHA-256 (hex) of the model's and optimizer's state across all ranks, the same string on each.

    **A collective** when a process group exists: every rank of ``group`` (default: the world) must
    call it at the same point (the Guard does, at the end of a run). Without a process group it is
    a local computation.

    Formula (earlier versions hashed gathered full tensors on every rank; for sharded states the
    values differ from theirs):

    1. each rank hashes what it holds (:func:`local_state_digest`): the state dicts in
       fully-qualified-name form (``torch.distributed.checkpoint.state_dict.get_state_dict``, so
       the value does not depend on parameter ids and is the same for a DDP-wrapped and a plain
       model), keys visited in sorted order; each tensor contributes a header line (key, dtype,
       global shape; for a ``DTensor`` also mesh shape, placements, local shape and global offset)
       and then the raw bytes of its **local** part (``DTensor.to_local()``; never
       ``full_tensor()``, so no rank ever holds more than its own shards); each non-tensor value
       its JSON text;
    2. the 32-byte digests of all ranks are all-gathered (one collective of 32 bytes per rank);
    3. when every rank's digest is the same (a replicated state: DDP, or a single process), the
       result is that digest — the value earlier versions computed from full tensors, so
       replicated runs compare with older records; otherwise it is
       ``SHA-256("trainguard state hash v2\n" + "world=W\n" + d_0 + ... + d_{W-1})``.

    Consequences: two runs with the same world size and the same sharding give the same value
    iff every rank's state is bitwise equal (replicated state, e.g. DDP, is hashed on every rank,
    so a replica that diverged changes the value too); runs with different world sizes or
    layouts give different values. Cost: one SHA-256 pass over each rank's own bytes, in
    parallel on all ranks, plus the 32-byte all-gather.

    Args:
        model: the module (plain, DDP, FSDP2) as passed to the Guard.
        optimizer: its optimizer, or ``None`` to hash the model only.
        group: the process group whose ranks' digests are combined (default: the world).
    Returns:
        64 hex characters.
    """
    digests = _gather_digests(local_state_digest(model, optimizer), group)
    if len(set(digests)) == 1:  # replicated (or one rank): the rank's own digest
        return digests[0].hex()
    h = hashlib.sha256(_FORMAT)
    h.update(f"world={len(digests)}\n".encode())
    for d in digests:
        h.update(d)
    return h.hexdigest()
