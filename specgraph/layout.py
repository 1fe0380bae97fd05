"""Where a forward's tokens go in a paged cache and what each of them sees.

A stage's cache is a pool of blocks of `block_size` slots, shared by the requests it holds. A
request sees its tokens at *virtual* slots 0, 1, ... (slot = position for committed tokens); its
row of the block table maps virtual block b to a physical block: physical slot =
table[row, v // block_size] * block_size + v % block_size. Block 0 is the pool's trash: padding
tokens write there and rows the pool does not hold point at it.

A forward packs the tokens of several requests (segments), grouped by segment: segment r's are
tokens [cu[r], cu[r + 1]), past cu[R] padding. Each segment has a *region* of virtual slots from
starts[r]: its tokens are written at region offsets (starts[r] + offset) and each sees every
virtual slot below starts[r] (its committed prefix) and the region offsets `visible` marks for it
(itself and its ancestors: a chain, a draft tree, a prompt chunk). Everything is a device tensor
except the sizes, so a forward needs no host read and replays as a CUDA graph for fixed sizes.

A recurrent (gated-DeltaNet) layer sees only the committed state and its own forward's tokens: in
such a forward, segment r's i-th token sits at region offset i (every caller's forwards of a
hybrid model do), so `grid` [R, G] (segment r's i-th token's packed index, -1 past its count) lays
the segments out as a padded batch with the tree visible[grid[r, i], :G] among them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Layout:
    tokens: int  # T, padding included
    slots: torch.Tensor  # [T] physical slot each token writes
    positions: torch.Tensor  # [T] rotary position of each token
    rows: torch.Tensor  # [R] each segment's row of `table` (a hybrid's state slot)
    cu: torch.Tensor  # [R + 1] segment r's tokens are [cu[r], cu[r + 1])
    starts: torch.Tensor  # [R] virtual slot where each segment's region begins
    visible: torch.Tensor  # [T, G] bool: the region offsets each token sees (padding: none)
    grid: torch.Tensor  # [R, G] packed index of each segment's i-th token, -1 past its count
    table: torch.Tensor  # [table rows, M] physical block of each virtual block: a segment's slots are below M blocks
    block_size: int
    padded: bool = True  # whether tokens past the segments' may be there (the attention then zeroes its output first)

    @property
    def width(self) -> int:
        """Virtual slots a segment may see (the table's columns): a reference kernel gathers that many."""
        return self.table.shape[1] * self.block_size

    @property
    def segments(self) -> int:
        return self.rows.numel()

    @property
    def region(self) -> int:
        """G: the region offsets a token may see."""
        return self.visible.shape[1]

    @classmethod
    def build(cls, table: torch.Tensor, block_size: int, rows: torch.Tensor, starts: torch.Tensor,
              counts: torch.Tensor, offsets: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor,
              width: int, padded: bool = True) -> Layout:
        """rows, starts, counts [R] (tokens per segment: at most G, as each sits at an offset of its
        own); offsets, positions [T] and visible [T, G] for the packed tokens (rows past sum(counts):
        padding, whatever they hold; `padded` False: the counts are known to fill all T); `width`: at
        least every starts[r] + G (the table is cut to the blocks that hold it: a view)."""
        t, g = visible.shape
        table = table[:, : -(-width // block_size)]
        device = visible.device
        cu = torch.cat([counts.new_zeros(1), counts]).cumsum(0)  # [R + 1] (not counts.cumsum(0): where counts
        # is a `full` (a static tree's sizes), torch 2.11's Inductor rewrites full().cumsum() and fails on a symbolic fill)
        index = torch.arange(t, device=device)
        live = index < cu[-1]
        segment = _segments(cu, t)
        virtual = torch.where(live, starts.index_select(0, segment) + offsets, 0)  # [T]
        slots = physical(table, block_size, rows.index_select(0, segment), virtual)
        grid = cu[:-1, None] + torch.arange(g, device=device)  # [R, G]
        grid = torch.where(grid < cu[1:, None], grid, -1)
        return cls(t, torch.where(live, slots, 0), torch.where(live, positions, 0), rows, cu, starts,
                   visible & live[:, None], grid, table, block_size, padded)

    @classmethod
    def single(cls, table: torch.Tensor, block_size: int, start: torch.Tensor, offsets: torch.Tensor,
               visible: torch.Tensor, positions: torch.Tensor, width: int, row: int = 0) -> Layout:
        """One request (table row `row`) writing T tokens at region offsets [T] from virtual slot
        `start` ([] long), each seeing the offsets visible [T, G] marks."""
        device = visible.device
        return cls.build(table, block_size, torch.full((1,), row, device=device), start.reshape(1),
                         torch.full((1,), offsets.numel(), device=device), offsets, visible, positions, width, False)

    def to(self, device: torch.device | str) -> Layout:
        tensors = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **tensors)

    def attention_inputs(self, heads: int) -> tuple:
        """What the attention kernels take of the layout, after q and the layer's cache, for a model
        of `heads` query heads (at most: a rank of a split model has fewer): with each token's reach
        [T] int32 (1 + the last region offset it sees, 0 none: the Triton kernel reads keys no further,
        and once a forward rather than scanning `visible` in every program of every layer), a zeroed
        scratch of int32 tickets [R (ceil(heads G / 16) + heads)], where the Triton kernel counts the
        split programs of each row block (it leaves them zero, so one scratch serves every layer of a
        forward, and a CUDA graph of the forward holds its own), and whether it may have padding tokens."""
        g = self.region
        reach = (self.visible * torch.arange(1, g + 1, dtype=torch.int32, device=self.visible.device)).amax(1)
        tickets = torch.zeros(self.segments * (-(-heads * g // 16) + heads), dtype=torch.int32, device=self.rows.device)
        return (self.table, self.rows, self.cu, self.starts, self.visible, reach, self.grid, tickets, self.block_size,
                self.padded)

    def token_segments(self) -> torch.Tensor:
        """[T] the segment of each packed token (padding: the last's)."""
        return _segments(self.cu, self.tokens)

    def tree(self) -> torch.Tensor:
        """[R, G, G] bool: within each segment, token i sees token j (a hybrid forward: see the module doc)."""
        g = self.region
        return self.visible.index_select(0, self.grid.clamp(min=0).flatten()).view(-1, g, g) & (self.grid >= 0)[..., None]


def _segments(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens] the segment of each packed token of segments cu [R + 1] (padding: the last)."""
    index = torch.arange(tokens, device=cu.device)
    # (Inductor fails on a searchsorted of a slice)
    return (index[:, None] >= cu[None, 1:]).sum(1).clamp(max=cu.numel() - 2)


def physical(table: torch.Tensor, block_size: int, rows: torch.Tensor, virtual: torch.Tensor) -> torch.Tensor:
    """Physical slots of virtual slots `virtual` of table rows `rows` (same shape, or broadcastable)."""
    blocks = table[rows, virtual // block_size]
    return blocks * block_size + virtual % block_size
