"""Draft trees: the static topologies a recipe names, and the per-step tree a drafter builds.

Node 0 of every tree is the root: the last committed token, whose successor
the target has not yet decided. Nodes are stored in topological order
(a parent's index is below its children's), siblings in rank order (the order
in which they were proposed), which is the order verification tries them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.recipe import ChainTree, StaticTree

CATCH_UP = 2  # committed tokens a drafter's catch-up feeds: the last accepted draft (maybe never fed) and the new root


@dataclass(frozen=True)
class TreeTopology:
    """The shape of a static tree (chain included): node i > 0 is child number `ranks[i]` of `parents[i]`."""

    parents: tuple[int, ...]  # [N + 1], parents[0] = -1
    ranks: tuple[int, ...]  # [N + 1], ranks[0] = 0

    @property
    def nodes(self) -> int:
        """Draft nodes, the root not counted."""
        return len(self.parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        depth = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            depth[i] = depth[p] + 1
        return tuple(depth)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def expanding(self, depth: int) -> list[int]:
        """The nodes at `depth` that have children: those a drafter feeds together at that depth."""
        return [u for u, d in enumerate(self.depths) if d == depth and self.children(u)]

    def cut(self, depth: int) -> TreeTopology:
        """The tree's nodes down to `depth` (its parents precede its children, so they keep their order)."""
        kept = [i for i, d in enumerate(self.depths) if d <= depth]
        index = {node: i for i, node in enumerate(kept)}
        return TreeTopology(tuple(index.get(self.parents[i], -1) for i in kept), tuple(self.ranks[i] for i in kept))

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> TreeTopology:
        """Medusa-style paths of child ranks, e.g. [[0], [1], [0, 0]]."""
        ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for path in ordered:
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_branching(cls, branching: list[int]) -> TreeTopology:
        paths, level = [], [()]
        for width in branching:
            level = [(*p, r) for p in level for r in range(width)]
            paths.extend(level)
        return cls.from_paths([list(p) for p in paths])

    @classmethod
    def from_spec(cls, spec: ChainTree | StaticTree) -> TreeTopology:
        if isinstance(spec, ChainTree):
            return cls.from_paths([[0] * d for d in range(1, spec.length + 1)])
        if spec.branching is not None:
            return cls.from_branching(spec.branching)
        return cls.from_paths(spec.paths)


@dataclass(frozen=True)
class Growth:
    """The sizes of a growing tree: `width` W children per expanded node, `depth` D the sent
    tree's depth bound (and the expansion steps that grow a first tree), `nodes` N the sent tree's
    nodes (root not counted), `grow` G expansion steps per verdict, taken while the target verifies,
    `leaves` B leaves fed per expansion step (on a GPU a step costs about the same for any small
    B, so more leaves buy more coverage of the bonus tokens a verdict may bring), `first` the
    expansion steps (the root's included) that grow a fresh tree before it is sent."""

    width: int
    depth: int
    nodes: int
    grow: int
    leaves: int
    first: int

    @property
    def steps(self) -> int:
        """Most expansion steps between two re-roots (the executor's schedule): a fresh tree's
        first - 1 after the root's, then G while the target verifies."""
        return self.first + self.grow

    @property
    def keep(self) -> int:
        """Nodes a re-rooted tree keeps at most (the most likely of the surviving subtree)."""
        return 2 * (self.nodes + 1) + self.leaves * self.width

    @property
    def pool(self) -> int:
        """Nodes the pool holds: what a re-root keeps and what the steps until the next make."""
        return self.keep + self.width + self.steps * self.leaves * self.width

    @property
    def region(self) -> int:
        """Draft-cache slots past the committed prefix that the tree's fed nodes may take."""
        return self.keep + self.steps * self.leaves + CATCH_UP


@dataclass(frozen=True)
class TreeStructure:
    """What verification and masking need of the shapes of R trees: `ancestors` [R, N + 1, N + 1]
    bool (i itself included), `depths` [R, N + 1], `child_table` [R, N + 1, C] (children in rank
    order, -1 padded) and `max_depth` (at least the deepest node's depth), so that verification
    walks the trees in a fixed number of tensor steps."""

    max_depth: int
    depths: torch.Tensor
    child_table: torch.Tensor
    ancestors: torch.Tensor

    @classmethod
    def of(cls, parents: list[int] | tuple[int, ...], device: torch.device | str) -> TreeStructure:
        """One tree's, from its parent list on the host (trees are small); C = the most children of any node."""
        n = len(parents)
        depth, kids, rows = [0] * n, [[] for _ in range(n)], [{0}]
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            kids[parents[i]].append(i)
            rows.append(rows[parents[i]] | {i})
        width = max(len(k) for k in kids)
        table = torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long).reshape(1, n, width)
        ancestors = torch.zeros(1, n, n, dtype=torch.bool)
        for i, row in enumerate(rows):
            ancestors[0, i, list(row)] = True
        return cls(max(depth), torch.tensor([depth], device=device), table.to(device), ancestors.to(device))

    @classmethod
    def on_device(cls, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, max_depth: int,
                  children: int, sizes: torch.Tensor | None = None) -> TreeStructure:
        """From device tensors, with no host read: parents [R, N + 1] (topological, siblings in rank
        order), their depths and ancestors; `max_depth` and `children` (C) are bounds; nodes past
        sizes [R] (padding) are nobody's children."""
        r, n = parents.shape
        order = torch.arange(n, device=parents.device)
        siblings = (parents[:, :, None] == parents[:, None, :]) & (order[None, None, :] < order[None, :, None])
        rank = siblings.sum(2)  # [R, N + 1]: among the earlier nodes of the same parent
        table = torch.full((r, n * children + 1), -1, dtype=torch.long, device=parents.device)  # (a spare column)
        child = (order[None] > 0) & (rank < children)
        if sizes is not None:
            child = child & (order[None] < sizes[:, None])
        place = torch.where(child, parents.clamp(min=0) * children + rank, n * children)
        table.scatter_(1, place, order.expand(r, -1))
        return cls(max_depth, depths, table[:, :-1].view(r, n, children), ancestors)

    @classmethod
    def of_parents(cls, parents: torch.Tensor, max_depth: int, children: int) -> TreeStructure:
        """From parents [R, N + 1] on the device (topological, siblings in rank order, no node
        deeper than `max_depth`), with no host read: each step climbs every node's chain one level."""
        r, n = parents.shape
        index = torch.arange(n, device=parents.device).expand(r, -1)
        up = parents.clamp(min=0)  # the root climbs to itself
        ancestors = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(r, 1, 1)
        node = index
        for _ in range(max_depth):
            node = up.gather(1, node)
            ancestors.scatter_(2, node[..., None], True)
        return cls.on_device(parents, ancestors.sum(2) - 1, ancestors, max_depth, children)

    def expand(self, rows: int) -> TreeStructure:
        """One tree's structure as that of `rows` trees of its shape (views)."""
        return TreeStructure(self.max_depth, *(x.expand(rows, *x.shape[1:]) for x in
                                               (self.depths, self.child_table, self.ancestors)))

    def to(self, device: torch.device) -> TreeStructure:
        return TreeStructure(self.max_depth, self.depths.to(device), self.child_table.to(device), self.ancestors.to(device))


@dataclass
class Tree:
    """R draft trees (one per request of a step) of up to N + 1 nodes each (root included), in
    topological order; tree r has sizes[r] nodes, its slots past them padding (children of the
    root, never verified)."""

    tokens: torch.Tensor  # [R, N + 1] long
    parents: torch.Tensor  # [R, N + 1] long, root -1
    structure: TreeStructure | None = None  # derived from parents (with a host read: one tree) when not given
    sizes: torch.Tensor | None = None  # [R] nodes of each tree, None: all N + 1
    packed: int | None = None  # where sizes vary: their sum (a host bound: what a forward of them all packs)

    def __post_init__(self) -> None:
        if self.structure is None:
            assert self.tokens.shape[0] == 1, "a structure is derived on the host for one tree only"
            self.structure = TreeStructure.of(self.parents[0].tolist(), self.tokens.device)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def size(self) -> int:
        """N + 1: node slots per tree."""
        return self.tokens.shape[1]

    @property
    def ancestors(self) -> torch.Tensor:
        return self.structure.ancestors

    @property
    def depths(self) -> torch.Tensor:
        return self.structure.depths

    @property
    def child_table(self) -> torch.Tensor:
        return self.structure.child_table

    @property
    def max_depth(self) -> int:
        return self.structure.max_depth

    def counts(self) -> torch.Tensor:
        """[R] nodes of each tree."""
        if self.sizes is None:
            return torch.full((self.rows,), self.size, dtype=torch.long, device=self.tokens.device)
        return self.sizes

    def children(self, node: int, row: int = 0) -> list[int]:
        """`node`'s children in rank order in tree `row` (a host read: for tests and inspection)."""
        return [c for c in self.child_table[row, node].tolist() if c >= 0]

    def to(self, device: torch.device) -> Tree:
        if device == self.tokens.device:
            return self
        return Tree(self.tokens.to(device), self.parents.to(device), self.structure.to(device),
                    None if self.sizes is None else self.sizes.to(device), self.packed)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """tokens, parents, depths, child_table, ancestors, counts: a deterministic draft's trees as a CUDA graph's outputs."""
        return self.tokens, self.parents, self.depths, self.child_table, self.ancestors, self.counts()

    @classmethod
    def random(cls, t: int, depth: int, generator: torch.Generator) -> Tree:
        """One tree of t nodes (tokens 0), parents first, the deepest path `depth` nodes long: a
        chain, then random parents above the deepest level (tests and kernel benchmarks)."""
        assert depth > 1 or t == 1, "a tree of depth 1 is its root alone"
        parents, depths = [], []
        for i in range(t):
            shallow = [j for j in range(i) if depths[j] < depth - 1]
            parent = i - 1 if i < depth else shallow[int(torch.randint(0, len(shallow), (), generator=generator))]
            parents.append(parent)
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return cls(torch.zeros(1, t, dtype=torch.long), torch.tensor([parents]))

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], max_depth: int, packed: int | None = None) -> Tree:
        tokens, parents, depths, child_table, ancestors, sizes = tensors
        return cls(tokens, parents, TreeStructure(max_depth, depths, child_table, ancestors),
                   None if packed is None else sizes, packed)
