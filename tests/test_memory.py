"""The peak of a phase: ``mark_peak`` starts a new high-water mark, so what a prefill costs is read
apart from what loading the model cost before it."""

import torch

from infinikv import memory


def test_a_peak_is_read_from_its_mark():
    memory.mark_peak()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, given back when deleted
    del block
    held = memory.peak()
    assert held >= memory.rss() + 60 * 2**20  # the peak remembers the block
    memory.mark_peak()
    assert memory.peak() < held - 32 * 2**20  # a new mark forgets it
