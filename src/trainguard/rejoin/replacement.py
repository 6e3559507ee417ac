"""``python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]``: run a training script
as the replacement of a lost rank (the launcher starts it; see :mod:`trainguard.launcher.replace`).

The script runs as ``python SCRIPT ARG...`` would run it, with these differences:

* a ``DistributedDataParallel`` constructed without an explicit ``init_sync`` skips its initial
  parameter broadcast from rank 0: the survivors do not take part in a constructor's collectives
  (they are past theirs), and the Guard transfers the model from them anyway;
* ``--spare ID`` (a warm spare, started before any failure): the script runs up to its
  ``torch.distributed.init_process_group`` call, or to its first read of a variable that names
  the rank (:data:`RANK_VARIABLES`: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... through
  ``os.environ`` or ``os.getenv``), whichever comes first, and waits there until the launcher
  assigns it a rank; it then takes that rank's environment (``RANK``, ``LOCAL_RANK``, the
  generation's store, ...) and goes on. Imports and everything the script does before that point
  are done in advance; whatever the script reads of its rank is the assigned rank's value (a data
  shard chosen by ``RANK``, ``torch.cuda.set_device(LOCAL_RANK)``). Until then its standard
  output and error go to ``RUN_DIR/spares/spare-ID.log``, not the console (:class:`QuietOutput`:
  the preamble's output, printed at the launch already, is not shown twice);
* the script's own collectives complete on this process alone until the Guard has joined the
  survivors (:mod:`trainguard.rejoin.catch`): a barrier or a broadcast of a seed before the loop,
  which the survivors passed long ago, cannot pair with their recovery's collectives;
* in ``init_process_group`` a process that joins a generation says it is ready first: the ranks
  of a group that grows (a spare, a node that arrives) meet it only once it has started.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import compat
from ..events import EventLog
from ..launch_env import RANK_VARIABLES, RECOVERY_KEY, RECOVERY_NONCE, RUN_DIR, LaunchEnv
from ..outcomes import BadInput
from .auth import Seal, report_forged
from .catch import LOCAL, Catch, hand_over
from .protocol import RecoveryStore, spare_store_from_environ, wait_for_assignment
from .stores import group_store_path, init_on_file, open_store

# what this module replaced process-wide, put back by undo() (the replacement's script has ended)
_undo: list[Callable[[], None]] = []


def undo() -> None:
    """Put back everything this module replaced that is still replaced (``DistributedDataParallel.__init__``,
    ``torch.distributed.init_process_group``, ``os.environ``'s class), the latest first; safe to call twice."""
    while _undo:
        _undo.pop()()


def skip_initial_broadcast() -> None:
    """Make ``DistributedDataParallel(...)`` default to ``init_sync=False`` in this process (until :func:`undo`)."""
    original = DistributedDataParallel.__init__
    _undo.append(lambda: setattr(DistributedDataParallel, "__init__", original))

    @functools.wraps(original)
    def init(self, *args, init_sync: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, init_sync=init_sync, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def _report_forged(key: str) -> None:
    """A spare or a replacement refused a forged value: a ``security`` event in the run's log."""
    report_forged(EventLog(os.environ[RUN_DIR]), key)


class QuietOutput:
    """A warm spare's standard output and error, kept off the console until it takes a rank: it runs
    the script's preamble (a config dump, Lightning's banner) that the rank it replaces printed at
    the launch already. Until :meth:`release` both file descriptors go to ``path`` (the run
    directory's ``spares/spare-ID.log``: what a spare that fails before its assignment printed is
    there); from then on, the console again. What the spare printed before is dropped from the
    console, not replayed: it repeats the preamble."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd in self._saved:
            os.dup2(log, fd)
        os.close(log)

    def release(self) -> None:
        """Back to the console (the first call; later ones do nothing)."""
        if not self._saved:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = {}


class Assignment:
    """A warm spare's rank, taken once from the launcher: at the script's first read of a
    :data:`RANK_VARIABLES` variable (:meth:`watch_environ`) or at ``init_process_group``.
    ``output``: the spare's :class:`QuietOutput`, released once the rank is taken."""

    def __init__(self, spare_id: int, output: Optional[QuietOutput] = None):
        self.spare_id, self.output = spare_id, output
        self.store = spare_store_from_environ()
        self.seal = Seal(
            bytes.fromhex(os.environ.get(RECOVERY_KEY, "")), bytes.fromhex(os.environ.get(RECOVERY_NONCE, ""))
        )
        self.taken = False
        self._environ_class = type(os.environ)

    def take(self) -> None:
        """Block until the launcher assigns this spare a rank, and take that rank's environment
        (once; later calls return at once)."""
        if self.taken:
            return
        self.taken = True
        os.environ.__class__ = self._environ_class  # stop watching
        os.environ.update(wait_for_assignment(self.store, self.spare_id, self.seal, _report_forged))
        if self.output is not None:
            self.output.release()
        rank_zero_follows()

    def watch_environ(self) -> None:
        """Make ``os.environ`` (and so ``os.getenv``) take the assignment before it answers a
        read of a :data:`RANK_VARIABLES` variable."""
        original, take = self._environ_class, self.take

        class Watched(original):  # type: ignore[misc, valid-type]
            def __getitem__(self, key: str) -> str:
                if key in RANK_VARIABLES:
                    take()
                return original.__getitem__(self, key)

        os.environ.__class__ = Watched
        _undo.append(self._stop_watching)

    def _stop_watching(self) -> None:
        if type(os.environ) is not self._environ_class:
            os.environ.__class__ = self._environ_class


# frameworks whose import reads the rank (Lightning's ``rank_zero_only``, at import time: a spare
# watching os.environ would wait inside the import and import them only once assigned, 5-9 s of a
# Lightning recovery on 2 cores: torchmetrics, transformers, matplotlib) or takes seconds; a warm
# spare imports them in advance when the script imports them (by the module its imports name first)
FRAMEWORKS = {
    "lightning": "lightning.pytorch",
    "pytorch_lightning": "pytorch_lightning",
    "transformers": "transformers",
    "trainguard.lightning": "trainguard.lightning",
    "trainguard.hf": "trainguard.hf",
}


# a script that calls ``torch.compile`` anywhere (nanoGPT's ``compile=True``): its first compiled
# call imports the inductor, 0.4 s of a replacement's recovery on 2 quiet cores (2 s loaded), and
# sets the compiler up (:func:`warm_compiler`)
COMPILER = "torch._inductor.compile_fx"


def _calls_torch_compile(tree: Any) -> bool:
    """Whether the syntax tree has a call of ``torch.compile(...)`` (by that attribute name)."""
    import ast

    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "compile"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "torch"
        for n in ast.walk(tree)
    )


def frameworks_of(script: Path) -> list[str]:
    """The :data:`FRAMEWORKS` modules that ``script`` imports at its top level, and the compiler
    (:data:`COMPILER`) when it calls ``torch.compile`` (read from its syntax tree, not run); ``[]``
    when it cannot be read or parsed."""
    import ast

    try:
        tree = ast.parse(script.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    found = []
    for name in names:
        for prefix, module in FRAMEWORKS.items():
            if (name == prefix or name.startswith(prefix + ".")) and module not in found:
                found.append(module)
    if _calls_torch_compile(tree):
        found.append(COMPILER)
    return found


def import_in_advance(modules: list[str]) -> None:
    """Import ``modules`` now (a warm spare, before it watches ``os.environ``); one that fails to
    import is left to the script (which then fails as it would)."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the script's own import reports it
            pass


WARMED = "torch.compile's set-up warmed"  # the spare's log says it (RUN_DIR/spares/spare-ID.log)


def _warm_up(a: Any) -> Any:
    return (a * 2.0).sin()


def warm_compiler() -> None:
    """Compile a tiny function once, forward and backward, on CPU (a warm spare of a script that
    calls ``torch.compile``, before it watches ``os.environ``). A process's first compile pays once
    for the compiler's lazy set-up (dynamo's and AOTAutograd's first trace, the inductor's code
    generation and its C++ toolchain's probe): measured on 2 loaded cores, a replacement's first
    compiled step of the zoo's compiled shape took 2.0-4.4 s without this, 0.3-0.4 s after it
    (the warm-up itself 5-8 s, in the spare's idle time). The model's own graphs still compile
    in the replacement (the inductor's on-disk caches, which the first ranks filled, make that
    short). CPU only: the spare does not know its device yet, and a CUDA context made now would sit
    on GPU 0. Tensors from no random stream (the script's seeds are untouched). A failure (no C++
    compiler) is left to the script, which meets it as it would. One line says which, in the
    spare's log (:func:`quiet_spare`)."""
    import time

    started = time.monotonic()
    try:
        import torch

        a = torch.linspace(0.0, 1.0, 8, requires_grad=True)
        torch.compile(_warm_up)(a).sum().backward()
    except Exception as e:  # noqa: BLE001 - the script's own compile reports it
        print(f"trainguard: torch.compile's set-up not warmed ({type(e).__name__}: {e})", flush=True)
        return
    print(f"trainguard: {WARMED} in {time.monotonic() - started:.1f} s", flush=True)


def rank_zero_follows() -> None:
    """Lightning's ``rank_zero_only.rank`` (set from the environment when Lightning was imported,
    in advance: the spare's values) to the assigned rank; Lightning's strategy sets it again at
    its set-up, this covers the Trainer's construction before it."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    if module is not None and os.environ.get("RANK", "").isdigit():
        module.rank_zero_only.rank = int(os.environ["RANK"])


def quiet_spare(spare_id: int) -> Optional[QuietOutput]:
    """Spare ``spare_id``'s output into ``RUN_DIR/spares/spare-ID.log`` until it takes a rank
    (:class:`QuietOutput`); ``None`` (the console) without a run directory in the environment."""
    run_dir = os.environ.get(RUN_DIR)
    return QuietOutput(Path(run_dir) / "spares" / f"spare-{spare_id}.log") if run_dir else None


def join_at_init(spare_id: Optional[int], output: Optional[QuietOutput] = None) -> None:
    """Wrap this process's first ``init_process_group`` call: a warm spare (``spare_id``) takes
    its assignment from the launcher (at the latest there: see :class:`Assignment`); then a
    process that joins a generation (``TRAINGUARD_JOIN``) says it is ready
    (:meth:`~.protocol.RecoveryStore.ready`): the ranks of a group that grows meet it only then.
    ``output``: the spare's quiet output, released when it takes its rank."""
    original = dist.init_process_group
    assignment = Assignment(spare_id, output) if spare_id is not None else None
    if assignment is not None:
        assignment.watch_environ()

    @functools.wraps(original)
    def init(*args, **kwargs):  # type: ignore[no-untyped-def]
        if assignment is not None:
            assignment.take()
        launch, path = LaunchEnv.from_environ(), None
        if launch.join is not None and launch.recovery_store:
            seal = Seal(launch.recovery_key or b"", launch.recovery_nonce)
            store = RecoveryStore(open_store(launch.recovery_store), launch.recovery_group, seal, _report_forged)
            store.ready(launch.join, int(os.environ["RANK"]))
            path = group_store_path(launch.recovery_store, launch.recovery_group, launch.join)
        dist.init_process_group = original
        if path is not None:  # one node: the generation's group forms on a file of the launcher's
            args, kwargs = init_on_file(path, 1800.0, args, kwargs)  # torch's default group timeout
        return original(*args, **kwargs)

    dist.init_process_group = init
    _undo.append(lambda: setattr(dist, "init_process_group", original) if dist.init_process_group is init else None)


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` (the script) as ``__main__`` with ``sys.argv = argv``.

    Raises:
        BadInput: no script (the usage line is printed first; exit code 2); whatever the script raises.
    """
    spare: Optional[int] = None
    if argv[:1] == ["--spare"]:
        if len(argv) < 3 or not argv[1].isdigit():
            argv = []
        else:
            spare, argv = int(argv[1]), argv[2:]
    if not argv:
        print("usage: python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]", file=sys.stderr)
        raise BadInput("no script given")
    output = quiet_spare(spare) if spare is not None else None  # before the imports: their warnings too
    skip_initial_broadcast()
    # imported lazily otherwise, after the spare was assigned: the rank-side stack, and torch._dynamo,
    # which DistributedDataParallel's constructor imports (0.7 s on this machine)
    compat.preload_dynamo()

    import trainguard.guard  # noqa: F401

    if spare is not None:
        modules = frameworks_of(Path(argv[0]))
        import_in_advance(modules)
        if COMPILER in modules:
            warm_compiler()
    join_at_init(spare, output)
    catch = Catch()
    catch.install()
    catch.mode = LOCAL  # until the Guard joined the survivors
    hand_over(catch)  # the script's Guard makes it its own
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        # by its absolute path, as ``python script.py`` runs it (``__file__`` and the code's file
        # names absolute): a collective's site (rejoin.align) is then the same as the survivors'
        runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
    finally:  # the script has ended: nothing stays replaced (the Guard's close() put its own back)
        catch.uninstall()
        undo()


if __name__ == "__main__":
    main(sys.argv[1:])
