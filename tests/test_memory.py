"""The peak of a phase: ``mark_peak`` starts a new high-water mark, so what a prefill costs is read
apart from what loading the model cost before it."""

import torch

from infinikv import memory


def test_a_peak_is_read_from_its_mark():
    start = memory.mark_peak()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    held = memory.peak()
    del block
    assert held >= start + 60 * 2**20
    again = memory.mark_peak()
    assert memory.peak() < held and again < held  # the earlier peak no longer counts
