"""The one checked list of private torch and transformers names (trainguard.compat): every listed
member exists on the installed packages (on real objects: a DDP model and an FSDP2 model on a gloo
group of one), no module of src/trainguard but compat (and torch elastic's adapter, for its own
listed members) touches a private name of another package, each fallback works and each refusal
names the member and the version; the bucket layout swap of an in-process DDP rebuild is the
rebuilding thread's alone and falls back where torch renamed the function."""

from __future__ import annotations

import ast
import re
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import REPO
from trainguard import compat
from trainguard.instability import clipfold
from trainguard.rejoin import regroup, sharded

SRC = REPO / "src" / "trainguard"
LISTED = {p.name for p in compat.MEMBERS}
# the one module outside compat allowed to touch listed members: its own ones, as a subclass must
ADAPTER = "launcher/torch_agent.py"
# private names of the standard library and NumPy (not torch's, transformers' or Lightning's), and the
# named tuple API (public despite its underscore)
NOT_TORCH = {
    ("sys", "_getframe"),
    ("os", "_exit"),
    ("random", "_inst"),
    ("np.random.mtrand", "_rand"),
    ("hashlib", "_Hash"),
}
TUPLE_API = {"_replace", "_fields", "_asdict", "_make"}
PRIVATE_MODULE_ROOTS = ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the class's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(source: str, module: str) -> list[str]:
    """The private names of other packages that ``source`` (the module ``module``, a path below
    src/trainguard) uses, as ``"line: text"``: attributes read or written on an object that is not
    the class's own, own attributes and methods named like a listed member, private names given to
    getattr/hasattr/setattr/delattr, imports of private modules or names."""
    own_listed = {p.name for p in compat.MEMBERS if module in p.used_in} if module == ADAPTER else set()
    found = []
    for n in ast.walk(ast.parse(source)):
        hit = None
        if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in TUPLE_API:
            base = ast.unparse(n.value)
            if _own(n.value):
                hit = n.attr in LISTED and n.attr not in own_listed
            else:
                hit = (base, n.attr) not in NOT_TORCH and n.attr not in own_listed
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            hit = n.name in LISTED and n.name not in own_listed
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) > 1:
            name = n.args[1]
            if n.func.id in ("getattr", "hasattr", "setattr", "delattr") and isinstance(name, ast.Constant):
                text = str(name.value)
                hit = _private(text) and text not in TUPLE_API and not (_own(n.args[0]) and text not in LISTED)
        elif isinstance(n, ast.Import):
            hit = any(
                a.name.split(".")[0] in PRIVATE_MODULE_ROOTS and any(map(_private, a.name.split("."))) for a in n.names
            )
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            parts = n.module.split(".")
            hit = parts[0] in PRIVATE_MODULE_ROOTS and (
                any(map(_private, parts)) or any(_private(a.name) for a in n.names)
            )
        if hit:
            found.append(f"{n.lineno}: {ast.unparse(n).splitlines()[0][:80]}")
    return found


# one row per rule: (source, found)
CHECKER_TABLE = [
    ("model._comm_hooks.clear()", True),
    ("dist._compute_bucket_assignment_by_size = f", True),
    ("getattr(model, '_comm_hooks', None)", True),
    ("from torch.utils._foreach_utils import _has_foreach_support", True),
    ("from torch.nn.utils import _foo", True),
    ("import torch._dynamo", True),
    ("class A:\n    def _ddp_init_helper(self): pass", True),
    ("self._pcontext = None", True),  # a listed member, outside the adapter
    ("self._mine = 1\ngetattr(self, '_mine', None)", False),  # the class's own private members
    ("sys._getframe(1)", False),
    ("t._replace(a=1)", False),
    ("import torch.distributed as dist", False),
]


@pytest.mark.parametrize("source,found", CHECKER_TABLE, ids=[s for s, _ in CHECKER_TABLE])
def test_the_checker_finds_each_kind_of_private_use(source, found):
    assert bool(private_uses(source, "x.py")) is found, private_uses(source, "x.py")


def test_no_module_but_compat_touches_private_names_of_torch_transformers_or_lightning():
    users = {}
    for path in sorted(SRC.rglob("*.py")):
        module = str(path.relative_to(SRC))
        if module != "compat.py" and (uses := private_uses(path.read_text(), module)):
            users[module] = uses
    assert users == {}, f"reach these through trainguard/compat.py (and list them there): {users}"


def test_every_member_is_listed_with_its_users_and_what_happens_without_it():
    for p in compat.MEMBERS:
        assert p.missing.startswith(("fallback: ", "refused: ")), p
        for module in p.used_in:
            assert (SRC / module).is_file(), (p, module)


def test_every_listed_member_of_a_module_or_class_exists_on_the_installed_packages():
    assert compat.missing_members() == [], (
        f"torch {torch.__version__}: update trainguard/compat.py and the ranges in pyproject.toml"
    )


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_members_objects_carry_exist_on_real_ddp_and_fsdp2_models(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ddp = DDP(torch.nn.Linear(4, 2))
    assert compat.missing_ddp(ddp) == [] and compat.ddp_comm_hooks(ddp) == []
    assert [id(p) for p in compat.ddp_reducer_params(ddp)] == [id(p) for p in ddp.parameters()]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    model(torch.randn(2, 4)).sum().backward()  # FSDP's lazy init: the root is known
    mods = sharded.fsdp_modules(model)
    meshes = [info.mesh for info in sharded._mesh_infos(model)]
    assert mods and meshes and compat.missing_fsdp(mods, meshes) == []
    assert compat.fsdp_is_root(mods[0]) is True and compat.mesh_is_root(meshes[0])
    assert sharded.why_not_rebindable(model) is None


def test_a_refusal_names_the_member_and_the_installed_version():
    with pytest.raises(compat.Incompatible) as e:
        compat.trainer_clip_grad_norm(object(), None)  # an object without the Trainer's member
    assert "Trainer._clip_grad_norm" in str(e.value) and f"transformers {compat.version('transformers')}" in str(
        e.value
    )
    with pytest.raises(
        compat.Incompatible, match=re.escape(f"torch {torch.__version__} lacks DistributedDataParallel._comm_hooks")
    ):
        compat.refuse(compat.missing_on(object.__new__(DDP), compat.DDP))


def test_fallbacks_where_torch_lacks_the_member(monkeypatch, group):
    grads = [torch.randn(3), torch.randn(5)]
    fused = compat.foreach_norm(grads, 2.0)
    monkeypatch.delattr(torch, "_foreach_norm")  # as a torch release without it would be
    assert [float(a) for a in compat.foreach_norm(grads, 2.0)] == [float(b) for b in fused]
    assert compat.default_store() is not None
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(distributed_c10d, "_get_default_store")
    assert compat.default_store() is None
    compat.foreach_utils.cache_clear()
    import torch.utils._foreach_utils as foreach  # the module compat reads, in a test of it

    monkeypatch.delattr(foreach, "_has_foreach_support")
    try:
        assert compat.foreach_utils() is None and clipfold._partial_norms(grads, 2.0, None) is None
    finally:
        compat.foreach_utils.cache_clear()
    ddp = DDP(torch.nn.Linear(4, 2))
    monkeypatch.delattr(ddp, "_comm_hooks")
    with pytest.raises(regroup.RegroupError, match="lacks DistributedDataParallel._comm_hooks"):
        regroup.check_rebindable(ddp)


LAYOUT = [[0], [1]]  # one parameter per bucket: not DDP's own layout for a small Linear (one bucket)


def test_the_layout_swap_is_the_rebuilding_threads_alone():
    """While one thread rebuilds a reducer with a kept layout, another thread's DDP bucket
    assignment (its own DDP model being built) gets torch's own answer, not the kept layout."""
    params = list(torch.nn.Linear(4, 2).parameters())
    args = (params, [25 * 1024 * 1024], [False] * len(params))
    real = dist._compute_bucket_assignment_by_size(*args)
    other = []
    with compat.bucket_layout(LAYOUT, 1024) as kept:
        assert kept and dist._compute_bucket_assignment_by_size(*args) == (list(reversed(LAYOUT)), [1024, 1024])
        t = threading.Thread(target=lambda: other.append(dist._compute_bucket_assignment_by_size(*args)))
        t.start()
        t.join()
    assert other == [real]
    assert dist._compute_bucket_assignment_by_size(*args) == real


def _buckets_sent(model: DDP) -> int:
    """How many buckets the first backward after a rebuild all-reduces (a counting hook)."""
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return torch.futures.collect_all([]).then(lambda _: bucket.buffer())

    model.register_comm_hook(None, counting)
    model(torch.randn(3, 4)).sum().backward()
    return len(calls)


def test_a_rebuild_keeps_the_layout_and_falls_back_to_ddps_where_torch_renamed_the_function(group, monkeypatch):
    model = DDP(torch.nn.Linear(4, 2))
    regroup.rebind_ddp(model, LAYOUT)
    assert _buckets_sent(model) == 2  # the kept layout: one bucket per parameter
    import torch.nn.parallel.distributed as ddp_module

    # a torch whose DDP computes its buckets under another name: DDP still finds its function,
    # torch.distributed no longer has the name trainguard swaps
    seen_by_ddp = types.ModuleType("torch.distributed")
    seen_by_ddp.__dict__.update(vars(dist))
    monkeypatch.setattr(ddp_module, "dist", seen_by_ddp)
    monkeypatch.delattr(dist, "_compute_bucket_assignment_by_size")
    model = DDP(torch.nn.Linear(4, 2))
    regroup.rebind_ddp(model, LAYOUT)  # no AttributeError: DDP's initial layout
    assert _buckets_sent(model) == 1  # DDP's own: one bucket for a small model


def test_the_elastic_adapter_takes_its_member_names_from_compat():
    from trainguard.launcher import torch_agent

    listed = set(torch_agent.AGENT_METHODS + torch_agent.AGENT_ATTRIBUTES + torch_agent.PCONTEXT_ATTRIBUTES)
    assert {p.name for p in compat.MEMBERS if p.used_in == (ADAPTER,)} <= listed
    assert Path(torch_agent.__file__).relative_to(SRC.resolve()).as_posix() == ADAPTER
