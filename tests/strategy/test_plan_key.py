"""``Strategy.plan_key``: what a plan is, without its name and notes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from heterog.strategy import ParallelConfig, Strategy


def _plan(configs: list[ParallelConfig], group_of: list[int], **kw) -> Strategy:
    return Strategy(graph_fingerprint="g", cluster_name="c", n_devices=4, batch_size=8,
                    group_of=np.array(group_of), configs=configs, **kw)


def test_plans_alike_but_for_name_notes_and_config_objects_share_a_key():
    even = ParallelConfig(devices=(0, 1), shares=(4, 4))
    base = _plan([even, even, even], [0, 1, 2, 2])
    alike = _plan([even, ParallelConfig(devices=(0, 1), shares=(4, 4)), replace(even)], [0, 1, 2, 2],
                  method="other", meta={"note": 1})
    assert base.plan_key() == alike.plan_key()


def test_every_part_of_a_plan_changes_its_key():
    even = ParallelConfig(devices=(0, 1), shares=(4, 4))
    base = _plan([even, even], [0, 0, 1])
    others = [
        _plan([even, ParallelConfig(devices=(0, 1), shares=(5, 3))], [0, 0, 1]),     # a group's shares
        _plan([even, ParallelConfig(devices=(2, 3), shares=(4, 4))], [0, 0, 1]),     # a group's devices
        _plan([even, even], [0, 1, 1]),                                               # which ops form a group
        _plan([even, even], [0, 0, 1], micro_batches=(4, 4)),
        _plan([even, even], [0, 0, 1], micro_batches=(4, 4), schedule="gpipe"),
        _plan([even, even], [0, 0, 1], recompute=(1,)),
        _plan([even, even], [0, 0, 1], priorities=np.array([3, 2, 1])),
        _plan([even, even], [0, 0, 1], sync_batch_stats=True),
        _plan([even, ParallelConfig(devices=(0, 1), shares=(4, 4), sync="ps", ps_device=0)], [0, 0, 1]),
    ]
    keys = [base.plan_key()] + [s.plan_key() for s in others]
    assert len(set(keys)) == len(keys)
