"""A stage: one model and its paged KV cache on its device — the unit that executors schedule.

A forward packs the tokens of one or more requests (specgraph/layout.py): each request is a row
of the stage's block table, and a forward's layout says where each token is written and what it
sees. Layouts are built on the device from device tensors (the committed lengths live there), so
no forward needs a host read. With `width` = a request's capacity every forward has shapes that
depend on its sizes only: on a GPU the stage then replays one CUDA graph per size in its
`graph_buckets` (planned by the capture_graphs pass), unless the whole step around it is being
captured.

The stage's table starts with every row owning `capacity` slots of blocks of its own (what the
executors of one request at a time use: row 0); an engine that pages its requests writes the
rows it assigns (engine/).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specgraph.cache import KVCache
from specgraph.kernels import Kernels
from specgraph.layout import Layout
from specgraph.runtime.graphs import Replays

BLOCK_SIZE = 64  # slots per block where the plan does not say


class Stage:
    def __init__(self, name: str, model: nn.Module, capacity: int, device: torch.device,
                 graph_buckets: tuple[int, ...] = (), static_shapes: bool = False, kernels: Kernels = Kernels(),
                 vocab: tuple[int, int] | None = None, requests: int = 1, blocks: int | None = None,
                 block_size: int = BLOCK_SIZE, capture: tuple[int, ...] = ()):
        """`capacity`: virtual slots of one request; `requests`: the table's rows; `blocks`: the
        pool's blocks (default: one for trash and `capacity` for each row); `kernels`: the stage's
        choice of kernels, which its cache runs too; `vocab`: (rows, width) where the model's logits
        are to be `width` wide with only the first `rows` ids proposable (a drafter whose vocabulary
        is padded unlike its target's: the validate pass), None as they come."""
        self.name = name
        self.model = model
        self.device = device
        self.kernels = kernels
        self.vocab = vocab
        self.capacity, self.block_size = capacity, block_size
        per_request = -(-capacity // block_size)
        self.cache: KVCache = model.new_cache(blocks or 1 + requests * per_request, block_size, requests, kernels)
        # The cache's storage never changes size, so compiled code takes its sizes as constants. (Left to
        # Dynamo, code compiled for one program's pool was recompiled for another's with the slots symbolic,
        # and Inductor handed every layer's slice of the pool to the kernels that write it at layer 0's
        # offset: a program built after another decoded wrong tokens, GPU runs 99-100, tests/test_compile.py.)
        for name in self.cache.TENSORS:
            torch._dynamo.mark_static(getattr(self.cache, name))
        self.table = (1 + torch.arange(requests * per_request, device=device)).view(requests, per_request)
        if blocks is not None:
            self.table.zero_()  # (rows are assigned as requests come: the trash until then)
        self.max_step_tokens = min(capacity, self.cache.max_step_tokens)  # tokens one forward of a request may write
        self.graph_buckets = frozenset(graph_buckets)
        self.static_shapes = static_shapes or bool(graph_buckets)  # attend over the whole capacity
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._replays = Replays(device.type == "cuda", self.pool)
        self.capture = capture  # layers whose inputs forward_features returns (an EAGLE-3 head drafts for this stage)

    def width(self, length: int, step_tokens: int) -> int:
        """Virtual slots a step's forwards attend over, `length` tokens committed and `step_tokens` written past them."""
        return self.capacity if self.static_shapes else min(self.capacity, length + step_tokens)

    def forward(self, tokens: torch.Tensor, layout: Layout) -> torch.Tensor:
        """tokens [T] placed as `layout` says -> logits [T, V]. Writes their K/V."""

        def run(tokens, slots, positions, rows, cu, starts, visible, grid):
            placed = dataclasses.replace(layout, slots=slots, positions=positions, rows=rows, cu=cu, starts=starts,
                                         visible=visible, grid=grid)
            return self._aligned(self.model(tokens[None], self.cache, placed)[0])

        inputs = (tokens, layout.slots, layout.positions, layout.rows, layout.cu, layout.starts, layout.visible,
                  layout.grid)
        if torch.compiler.is_compiling() or not (layout.table.shape[1] == self.table.shape[1]
                                                  and layout.tokens in self.graph_buckets):
            return run(*inputs)  # (compiled code that calls it: first, so that its sizes stay symbolic)
        key = (layout.tokens, layout.segments, layout.region)
        return self._replays.run(key, run, *inputs).clone()  # (the next replay overwrites it)

    def feed(self, tokens: torch.Tensor, layout: Layout) -> None:
        """`forward` for the K/V (and recurrent state) it writes alone, without the vocabulary
        projection: a prompt forward, whose logits nobody reads (at a 512-token chunk of a
        Llama-3-8B shape they were [512, 128256] in fp32, 263 MB, and 0.5 TFLOP of projection)."""
        self.model(tokens[None], self.cache, layout, logits=False)

    def forward_features(self, tokens: torch.Tensor, layout: Layout, logits: bool = True
                         ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`forward`, eager, also returning the inputs of the layers `capture` names [T, C H] (the
        features a head drafts from: models/eagle.py); without `logits`, None for the logits."""
        projected, features = self.model(tokens[None], self.cache, layout, self.capture, logits=logits)
        return None if projected is None else self._aligned(projected[0]), features[0]

    def pack(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
             offsets: torch.Tensor, visible: torch.Tensor, width: int, counts: torch.Tensor | None = None,
             total: int | None = None) -> tuple[torch.Tensor, Layout]:
        """R requests (table rows `rows` [R]) packed for one forward: row r writes tokens [R, E]
        (positions, region offsets [R, E]) at virtual slots starts[r] + offset, each seeing the slots
        below starts[r] and the region offsets visible [R, E, G] marks, over `width` virtual slots;
        only the first counts[r] of a row where `counts` [R] is given (the rest: padding), `total`
        tokens in all where given (at least sum(counts): a host bound) -> the packed tokens [R E, or
        total] and their layout (its grid: row r's e-th token's packed index)."""
        r, e = tokens.shape
        flat = (tokens.flatten(), positions.flatten(), offsets.flatten(), visible.flatten(0, 1))
        padded = counts is not None
        if counts is None:
            counts = torch.full((r,), e, dtype=torch.long, device=self.device)
        else:
            order = packed_order(counts, e, total)
            flat = tuple(x.index_select(0, order) for x in flat)
        tokens, positions, offsets, visible = flat
        return tokens, Layout.build(self.table, self.block_size, rows, starts, counts, offsets, visible, positions,
                                    width, padded)

    def forward_rows(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """`pack`'s requests (tokens [R, E]) through one forward -> logits [R, E, V] (a padding token's: garbage)."""
        r, e = tokens.shape
        packed, layout = self.pack(tokens, *args, **kwargs)
        logits = self.forward(packed, layout)  # [T, V]
        return logits.index_select(0, layout.grid[:, :e].clamp(min=0).flatten()).view(r, e, -1)

    def forward_one(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, offsets: torch.Tensor,
                    visible: torch.Tensor, width: int) -> torch.Tensor:
        """The request of table row 0: tokens, positions, offsets [T] written at virtual slots start
        ([] long) + offsets, each seeing the slots below `start` and the region offsets visible
        [T, G] marks, over `width` virtual slots -> logits [T, V]."""
        row = torch.zeros(1, dtype=torch.long, device=self.device)
        return self.forward_rows(tokens[None], positions[None], row, start.reshape(1), offsets[None], visible[None],
                                 width)[0]

    @property
    def logits_width(self) -> int:
        """Columns of the logits `forward` returns."""
        return self.model.served_vocab if self.vocab is None else self.vocab[1]

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [T, V] -> [T, width]: ids past `rows` at -inf (see __init__)."""
        if self.vocab is None or self.vocab == (logits.shape[-1],) * 2:
            return logits
        rows, width = self.vocab
        aligned = logits.new_full((logits.shape[0], width), float("-inf"))
        aligned[:, :rows] = logits[:, :rows]
        return aligned

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [T] at the virtual slots [0, T) of row 0 -> logits [T, V]: eager forwards of
        at most `max_step_tokens`, each kept, attending over the slots written so far."""
        return torch.cat([self.forward(packed, layout) for packed, layout in self._prefill_chunks(tokens)])

    def prefill_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill`, returning the features `capture` names instead of logits [T, C H]."""
        return torch.cat([self.forward_features(packed, layout, logits=False)[1]
                          for packed, layout in self._prefill_chunks(tokens)])

    def _prefill_chunks(self, tokens: torch.Tensor):
        """Row 0's prefill forwards: (packed chunk, its layout) for each chunk of at most
        `max_step_tokens`, kept once the caller has run it."""
        row = torch.zeros(1, dtype=torch.long, device=self.device)
        for start in range(0, tokens.numel(), self.max_step_tokens):
            chunk = tokens[start : start + self.max_step_tokens]
            t = chunk.numel()
            offsets = torch.arange(t, device=self.device)
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            yield self.pack(chunk[None], (start + offsets)[None], row, torch.tensor([start], device=self.device),
                            offsets[None], causal[None], start + t)
            self.cache.keep(row, torch.full((1,), t, device=self.device))

    def reset(self) -> None:
        """Start a new request in row 0."""
        self.cache.reset(torch.zeros(1, dtype=torch.long, device=self.device))


def packed_order(counts: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """Where Stage.pack takes each packed token from R rows of `width` (flattened [R width]): the rows'
    first counts[r] tokens first, in row order, each a segment; padding after them; `total` in all -> [total]."""
    index = torch.arange(width, device=counts.device)
    return (index[None] >= counts[:, None]).flatten().long().argsort(stable=True)[:total]
