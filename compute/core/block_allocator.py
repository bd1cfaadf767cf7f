"""Reference-counted allocation of fixed-size KV blocks (device or host).

Pure bookkeeping over block ids ``0..num_blocks-1``: who holds a block is the
KV cache manager's business; this only counts holders. A block is free when
its count is zero and it sits on the free list.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free list plus a reference count per block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO reuse: a just-freed block is reused last, which keeps stale-data
        # bugs visible in tests instead of hiding them behind the same block id.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self) -> int | None:
        """A free block with one holder, or None when every block is in use."""
        if not self._free:
            return None
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def fork(self, block_id: int) -> None:
        """One more holder of a block in use (sharing, e.g. a prefix-cache hit)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; allocate it instead of forking")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> bool:
        """One holder fewer; True when that was the last one and the block is free again."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} freed twice (it is already free)")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id]:
            return False
        self._free.append(block_id)
        return True

    def check_invariants(self) -> None:
        """Raise RuntimeError if the free list and the counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        if any(count < 0 for count in self._ref_counts):
            raise RuntimeError("negative reference count")
        in_use = sum(1 for count in self._ref_counts if count > 0)
        if len(free) + in_use != self.num_blocks:
            raise RuntimeError(f"{len(free)} free + {in_use} in use != {self.num_blocks} blocks")
        if any(self._ref_counts[b] for b in free):
            raise RuntimeError("a block on the free list has holders")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"unknown block {block_id} (have {self.num_blocks})")
