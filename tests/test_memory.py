"""The peak of a phase: ``mark_peak`` starts a new high-water mark, so what a prefill costs is read
apart from what loading the model cost before it."""

import mmap

import torch

from infinikv import memory

BLOCK = 64 * 2**20


def test_a_peak_is_read_from_its_mark():
    memory.mark_peak()
    # Fresh pages straight from the kernel, touched, then unmapped: an allocator could hand back
    # pages this long-lived process already holds, which would raise neither the RSS nor the peak.
    block = mmap.mmap(-1, BLOCK)
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)
    block.close()
    held = memory.peak()
    assert held >= memory.rss() + 60 * 2**20  # the peak remembers the block
    memory.mark_peak()
    assert memory.peak() < held - 32 * 2**20  # a new mark forgets it
    assert memory.highest() >= held  # the whole life's peak does not
