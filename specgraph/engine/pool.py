"""The KV pool's blocks, on the host: which are free, which request holds which.

Every stage of an engine shares one block numbering (each stage's pool has as many blocks, of its
own K/V size), so a request's blocks are one list and its table row is the same in every stage.
Block 0 is the trash (layout.py) and is never handed out. A request is given, when it is
admitted, every block its longest possible sequence needs (prompt, new tokens and one step's
region), so nothing admitted ever waits for memory or is dropped; a request that cannot get them
waits until others finish.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, blocks: int, block_size: int):
        """`blocks`: the pool's size, the trash included."""
        if blocks < 2:
            raise ValueError("a pool needs the trash block and at least one more")
        self.block_size = block_size
        self.blocks = blocks
        self._free = list(range(blocks - 1, 0, -1))  # a stack: the lowest numbers go first

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def allocate(self, slots: int) -> list[int] | None:
        """Blocks for `slots` virtual slots, or None (nothing taken) where too few are free."""
        count = self.blocks_for(slots)
        if count > len(self._free):
            return None
        taken = self._free[-count:][::-1]
        del self._free[-count:]
        return taken

    def release(self, blocks: list[int]) -> None:
        assert not set(blocks) & set(self._free) and 0 not in blocks, "a block released twice, or the trash"
        self._free.extend(reversed(sorted(blocks)))
        self._free.sort(reverse=True)
