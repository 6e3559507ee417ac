"""torch elastic's private members that the launcher relies on exist on the installed torch, and only
trainguard/launcher/torch_agent.py touches them (trainguard/compat.py lists them, with every other
private name trainguard uses: tests/test_compat.py checks the whole of src/ likewise). Real objects: a c10d rendezvous on loopback, an agent,
and a started worker process; no launch."""

from __future__ import annotations

import ast
import sys
import uuid

import pytest
import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from conftest import REPO
from trainguard import compat
from trainguard.launcher import torch_agent as elastic

SRC = REPO / "src" / "trainguard"
PRIVATE = {p.name for p in compat.MEMBERS if p.owner in (compat.AGENT, compat.PCONTEXT)}


@pytest.fixture
def agent_and_pcontext(tmp_path):
    """A constructed LocalElasticAgent (real rendezvous handler) and a started process context."""
    params = RendezvousParameters(
        backend="c10d", endpoint="localhost:0", run_id=uuid.uuid4().hex, min_nodes=1, max_nodes=1
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    spec = WorkerSpec(
        role="trainer", local_world_size=1, entrypoint=sys.executable, args=("-c", "pass"), rdzv_handler=handler
    )
    agent = LocalElasticAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "agent")))
    pcontext = start_processes(
        name="probe",
        entrypoint=sys.executable,
        args={0: ("-c", "pass")},
        envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "probe")),
    )
    try:
        yield agent, pcontext
    finally:
        pcontext.close()
        handler.shutdown()


def test_private_members_exist_on_the_installed_torch(agent_and_pcontext):
    agent, pcontext = agent_and_pcontext
    missing = elastic.missing_members(agent, pcontext)
    assert not missing, (
        f"torch {torch.__version__} lacks {missing}: update trainguard/launcher/torch_agent.py "
        f"and the torch range in pyproject.toml"
    )
    elastic.check(agent, pcontext)  # raises nothing either


def test_a_missing_member_is_named_with_the_torch_version():
    with pytest.raises(elastic.ElasticIncompatible) as e:
        elastic.check(pcontext=object())  # a process context without subprocess handlers
    assert "object.subprocess_handlers" in str(e.value) and torch.__version__ in str(e.value)


def _private_uses(path) -> set[str]:
    """Names of PRIVATE members that a module reads, writes, defines or passes to getattr."""
    tree = ast.parse(path.read_text())
    found = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in PRIVATE}
    found |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in PRIVATE}
    found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in PRIVATE}
    return found


def test_the_adapters_lists_are_compats():
    assert set(elastic.AGENT_METHODS + elastic.AGENT_ATTRIBUTES) | {"_running_local_ranks"} == PRIVATE
    assert "_running_local_ranks" in elastic.PCONTEXT_ATTRIBUTES


def test_only_the_adapter_touches_them():
    users = {str(p.relative_to(SRC)): uses for p in SRC.rglob("*.py") if (uses := _private_uses(p))}
    assert set(users) == {"launcher/torch_agent.py", "compat.py"}, users  # compat: the list of their names
