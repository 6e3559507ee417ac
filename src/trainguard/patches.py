"""Every attribute trainguard writes on another package's module or class: what, for which
feature, and when it is installed (issue 51). The modules that install them are the ones named;
this table is what the docs show (:func:`markdown`, rendered into docs/guard.md and checked by
``tests/test_docs.py``), and what the tests' census (``tests/patch_census.py``, which looks at
every module and class in the process, not at this table) is checked against: a patch the census
finds that is not listed here fails ``tests/test_comm_hook.py``.

Everything here is put back by ``Guard.close()`` (the replacement runner's, when the script
ends); ``tests/test_close.py``, ``tests/test_guard_scope.py`` and ``tests/test_transparency.py``
find the census empty afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    """One attribute trainguard replaces while a feature needs it.

    Attributes:
        target: the dotted module or class, as the census names it (``torch.distributed``).
        names: the attributes replaced (a collective's ``torch.distributed`` names, ...).
        feature: what it serves.
        when: when it is installed (and so the feature that must be on).
        module: the trainguard module that installs it.
    """

    target: str
    names: tuple[str, ...]
    feature: str
    when: str
    module: str

    def covers(self, census_name: str) -> bool:
        """Whether a census entry (``target.name``) is this patch's."""
        return any(census_name == f"{self.target}.{n}" for n in self.names)


COLLECTIVES = (
    "all_reduce",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)

PATCHES = (
    Patch(
        "torch.nn.utils",
        ("clip_grad_norm_",),
        "the norm it returns noted for `should_step`; with FSDP2 on a 1-D mesh of every rank, the "
        "detectors' values ride in its all-reduce",
        "every Guard",
        "rejoin/catch.py",
    ),
    Patch("sys", ("excepthook",), "a lost peer told in one line, not a traceback", "every Guard", "console.py"),
    Patch(
        "torch",
        ("Tensor.backward",),
        "the loss `backward()` ran on, whose value rides with the gradients",
        "a DDP model with trainguard's hook, or FSDP2's clip, carrying the detectors' values",
        "instability/fold.py",
    ),
    Patch(
        "torch.distributed",
        COLLECTIVES,
        "a lost peer caught in the script's own collectives",
        "in-process recovery on, more than one rank (or a replacement of a lost rank)",
        "rejoin/catch.py",
    ),
    Patch(
        "torch.utils.data.dataloader",
        ("_BaseDataLoaderIter.__next__",),
        "a step done again gets back the batches its interrupted attempt took",
        "in-process recovery on, more than one rank, a DDP or plain model",
        "rejoin/replay.py",
    ),
    Patch(
        "torch.distributed",
        ("_compute_bucket_assignment_by_size",),
        "a DDP reducer built again with the bucket layout it had",
        "inside a rebuild of the reducer only (a recovery, `close()`)",
        "compat.py",
    ),
    Patch(
        "torch.distributed",
        ("init_process_group",),
        "a replacement joins the survivors' group where the script creates its own",
        "a replacement of a lost rank (the runner), until the script ends",
        "rejoin/replacement.py",
    ),
    Patch(
        "torch.nn.parallel.distributed",
        ("DistributedDataParallel.__init__",),
        "a replacement's DDP built without the start's broadcast (the state comes from the survivors)",
        "a replacement of a lost rank (the runner), until the script ends",
        "rejoin/replacement.py",
    ),
    Patch(
        "os",
        ("environ's class",),
        "a replacement's rank variables given when the script first reads them",
        "a replacement of a lost rank (the runner), until the script ends",
        "rejoin/replacement.py",
    ),
)


def listed(census_name: str) -> bool:
    """Whether a census entry (``module.attribute`` or ``module.Class.attribute``) is in :data:`PATCHES`."""
    if census_name == "os.environ's class":
        return True
    return any(p.covers(census_name) for p in PATCHES)


def markdown() -> str:
    """:data:`PATCHES` as the Markdown table docs/guard.md shows."""
    rows = ["| what | for | installed | by |", "| --- | --- | --- | --- |"]
    for p in PATCHES:
        names = ", ".join(f"`{n}`" for n in p.names) if len(p.names) < 4 else f"its {len(p.names)} public collectives"
        rows.append(f"| `{p.target}`: {names} | {p.feature} | {p.when} | `{p.module}` |")
    return "\n".join(rows) + "\n"
