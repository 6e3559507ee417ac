"""Whole nodes in one process: the beat clock, the node registry on a real TCPStore, the beat
thread, the arrival count, and the boundary files' mirror that a spare node's replacement reads."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import wait_for
from trainguard.launcher.nodes import ActiveNode, Assignment, Beat, NodeRegistry, Silence, arrival, serves_endpoint
from trainguard.rejoin import boundary
from trainguard.rejoin.auth import Seal
from trainguard.rejoin.protocol import RecoveryStore, connect, serve
from trainguard.rejoin.rank import lost_boundaries

SEAL = Seal(b"k" * 32)


def test_silence_counts_from_the_last_change_on_the_watchers_clock():
    s = Silence()
    assert s.observe("a", 5, 100.0) == 0.0  # first look
    assert s.observe("a", 5, 101.5) == 1.5
    assert s.observe("a", 6, 102.0) == 0.0  # it beat
    assert s.observe("a", 6, 102.25) == 0.25
    s.forget("a")
    assert s.observe("a", 6, 200.0) == 0.0


def test_registry_round_trip_and_spares_leave_the_list_once_taken():
    server = serve()
    client = connect("127.0.0.1", server.port)
    node0, other = NodeRegistry(server, SEAL), NodeRegistry(client, SEAL)
    other.set_active(1, ActiveNode("h1", "h1:10", (2, 3)))
    assert node0.active(1) == ActiveNode("h1", "h1:10", (2, 3)) and node0.active(2) is None
    spare = other.add_spare("h9", "h9:7", 2)
    assert spare.spare_ids == (1_000_001, 1_000_002)
    assert node0.spares() == {1: spare}
    node0.take(1, Assignment(1, "h1", (2, 3), 4))
    assert node0.spares() == {} and other.assignment(1) == Assignment(1, "h1", (2, 3), 4)
    assert not other.finished()
    node0.finish()
    assert other.finished()
    assert not node0.ended("h1:10")
    other.end("h1:10")  # its launch ended: its silence is not a lost node
    assert node0.ended("h1:10")


def test_a_value_sealed_with_another_key_is_absent_and_reported():
    server = serve()
    forged = []
    NodeRegistry(server, Seal(b"x" * 32)).set_active(1, ActiveNode("evil", "e:1", (0,)))
    assert NodeRegistry(server, SEAL, forged.append).active(1) is None
    assert forged == ["nodes/active/1"]


def test_beats_move_while_the_thread_runs_and_stop_when_it_stops():
    server = serve()
    registry = NodeRegistry(server, SEAL)
    beat = Beat(f"127.0.0.1:{server.port}", "me:1")
    wait_for(lambda: registry.beats("me:1") >= 3, 30, "three beats")
    beat.stop()
    time.sleep(0.3)
    count = registry.beats("me:1")
    time.sleep(0.3)
    assert registry.beats("me:1") == count


def test_arrivals_count_in_order_and_the_store_host_is_known():
    server = serve()
    endpoint = f"127.0.0.1:{server.port}"
    assert [arrival(endpoint, "job", 10), arrival(endpoint, "job", 10), arrival(endpoint, "other", 10)] == [1, 2, 1]
    assert serves_endpoint(endpoint)  # this process serves that store
    assert not serves_endpoint("127.0.0.1:1")


def test_a_mirrored_boundary_reads_back_as_the_files_do(tmp_path):
    server = serve()
    store = RecoveryStore(connect("127.0.0.1", server.port), 1, SEAL)
    kept = boundary.BoundaryState(tmp_path, 3, lambda slot, data: store.mirror_boundary(3, slot, data))
    for step in (7, 8, 9):
        kept.keep({"step": step, "rng": torch.arange(step), "sampler": {"pos": step * 4}})
    files = boundary.read(tmp_path, 3)
    mirrored = dict(p for p in (boundary.parse_slot(store.mirrored_boundary(3, s)) for s in (0, 1)) if p)
    assert sorted(files) == sorted(mirrored) == [8, 9]
    for step in (8, 9):
        assert mirrored[step]["sampler"] == files[step]["sampler"] == {"pos": step * 4}
        assert torch.equal(mirrored[step]["rng"], torch.arange(step))
    assert boundary.parse_slot(None) is None and boundary.parse_slot(b"short") is None


def test_a_replacement_reads_its_lost_ranks_file_else_the_store_copy(tmp_path):
    """What a replacement (the Guard's, or the HF Trainer's join) reads: the lost rank's file on
    this node; on another node (no file) the copy in the recovery store; neither: refused."""
    server = serve()
    store = RecoveryStore(connect("127.0.0.1", server.port), 1, SEAL)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    kept = boundary.BoundaryState(here, 2, lambda slot, data: store.mirror_boundary(2, slot, data))
    for step in (4, 5):
        kept.keep({"step": step, "sampler": {"pos": step}})
    from_file, source = lost_boundaries(here, 2, store)
    assert source == "file" and sorted(from_file) == [4, 5]
    from_store, source = lost_boundaries(elsewhere, 2, store)
    assert source == "recovery store" and from_store[5]["sampler"] == {"pos": 5}
    with pytest.raises(FileNotFoundError, match="no step boundary of rank 3"):
        lost_boundaries(elsewhere, 3, store)
