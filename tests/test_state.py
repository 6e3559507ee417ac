"""Sampler positions, RNG capture/restore and the state hash, in one process."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from trainguard import ResumableSampler, seed_everything, state_hash
from trainguard.state import capture_rng, restore_rng


def test_sampler_resumes_mid_epoch_and_across_epochs():
    a = ResumableSampler(10, rank=1, world_size=2, seed=3)
    first = a.take(7)                      # crosses into epoch 1 (5 indices per rank per epoch)
    b = ResumableSampler(10, rank=1, world_size=2, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"epoch": 1, "offset": 2}
    assert a.take(9) == b.take(9)
    c = ResumableSampler(10, rank=0, world_size=2, seed=3)
    assert not set(c.take(5)) & set(first[:5]), "ranks must see disjoint shards of one epoch"


def test_rng_round_trip_through_weights_only_load():
    seed_everything(1)
    state = capture_rng()
    buf = io.BytesIO()
    torch.save(state, buf)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    seed_everything(99)
    restore_rng(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_state_hash_sees_one_bit_and_optimizer_state():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    h = state_hash(m, opt)
    assert h == state_hash(m, opt)
    with torch.no_grad():
        m.weight.view(-1).view(torch.int32)[0] ^= 1      # flip the lowest mantissa bit
    assert state_hash(m, opt) != h
    with torch.no_grad():
        m.weight.view(-1).view(torch.int32)[0] ^= 1
    opt.state[m.weight]["exp_avg"][0, 0] += 1
    assert state_hash(m, opt) != h
