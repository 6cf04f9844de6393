"""The native backend: the Llama family on specdec's own forward pass over a preallocated KV cache.

``NativeBackend`` wraps a ``models.llama.Llama``; ``NativeCache`` is a ``RaggedCache`` (per-row
validity and lengths, one rollback primitive) whose keys and values live in one buffer allocated
once per generation, [layers, 2, rows, kv_heads, capacity, head_dim], the batch's B rows its first B
(``kv`` is that view). A block's entries are written in place at columns [past, past + n); rolling back
just lowers the column count, so the next block overwrites the rejected columns. Rows that leave are
filled in place by the rows after them (only the rows that move are copied), and rows that join are
copied into free rows, so a serving batch whose requests come and go copies what moves, not the whole
cache. The buffer grows (by doubling, counted in ``grown``) only when a block would pass the capacity,
or joining rows find no free row or need more columns.

Beyond ``forward``, a block can stop part-way up the network and continue later (``begin``,
``advance``, ``finish``), for early-exit drafters that run the first layers of the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.backends.cache import FULL, RaggedCache, Window
from specdec.batch import keep_rows
from specdec.errors import InvalidArgumentError
from specdec.models import kernels, llama

DEFAULT_CAPACITY = 256


@dataclass
class Block:
    """A block of new columns on its way up the network.

    Everything that depends only on the block (visibility masks, positions, the kernels' block
    parameters) is computed once when it starts, so its layers can run in several calls.
    """

    hidden: torch.Tensor                   # [B * n, H]: the input of layer ``layer``
    shape: tuple[int, int]                 # (B, n)
    past: int                              # the block's first cache column
    layer: int                             # the next layer to run; num_layers when all have run
    positions: torch.Tensor                # [B * n] int64 (kept alive for ``params``)
    masks: dict[Window, torch.Tensor | None]  # window -> visible [B, n, past + n] bool, None: all
    params: llama.BlockParams              # shape, positions, cache strides, work buffers
    work: llama.Scratch                    # work buffers of its shape
    hidden_layers: tuple[int, ...] = ()    # taps requested, transformers' indexing (see NativeCache.begin)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # index -> [B, n, H]

    @property
    def states(self) -> torch.Tensor:
        """The hidden states at ``layer``: [B, n, H] (not normed; ``Llama.logits`` applies the head)."""
        return self.hidden.view(*self.shape, -1)


class NativeCache(RaggedCache):
    """A preallocated KV cache and the forward pass over it.

    ``forward`` (from RaggedCache) runs a whole block. A layer range splits it:

        block = cache.begin(tokens, valid, stop=b)   # bookkeeping once, layers [0, b)
        draft_logits = backend.model.logits(block.states)  # e.g. an early exit at layer b
        logits, hidden = cache.finish(block, logits_to_keep=...)  # layers [b, L), the head

    ``advance(block, stop)`` runs layers [block.layer, stop) in between. Finish (or abandon) a
    block before the next ``forward``/``begin``/``truncate``: the upper layers of an abandoned
    block leave unwritten cache entries, which a ``truncate`` below it makes harmless.
    """


    def __init__(self, backend: "NativeBackend", batch_size: int, capacity: int | None = None):
        model = backend.model
        super().__init__(batch_size, model.device, getattr(model.config, "max_position_embeddings", None))
        self.model = model
        self.grown = 0  # reallocations because a block passed the capacity
        capacity = max(1, capacity or DEFAULT_CAPACITY)
        self.store = llama.new_kv(model, batch_size, capacity)  # [L, 2, rows >= B, kv, capacity, D]
        self.kv = self.store  # its first B rows
        model.reserve(capacity)
        self.scratch: dict[tuple[int, int], llama.Scratch] = {}  # (B, n) -> work buffers
        self._stop: int | None = None
        self._resume: tuple[torch.Tensor, int] | None = None
        # A draft model's head over its draft vocabulary only (the final norm folded in, as model.head):
        # logits [.., len(rows)] instead of [.., V]
        self.logit_head: llama.Matrix | None = None

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def memory_bytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def begin(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, stop: int = 0,
              hidden_layers: tuple[int, ...] = (), block_mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> Block:
        """Append a block (its only bookkeeping) and run layers [0, stop); returns it at ``stop``.

        Arguments as in ``forward``. ``hidden_layers`` index transformers' ``hidden_states``: 0 is
        the embedding output, i the output of layer i, num_layers the final-normed output; they
        come back from ``finish``.
        """
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        self._stop = stop
        try:
            return self.forward(tokens, valid, 1, hidden_layers, block_mask, positions)
        finally:
            self._stop = None

    def begin_at(self, hidden: torch.Tensor, valid: torch.Tensor, layer: int,
                 hidden_layers: tuple[int, ...] = ()) -> Block:
        """Append a block whose layers [0, layer) already ran at these very columns: ``hidden`` [B, n, H]
        is its input of layer ``layer``. Nothing below ``layer`` runs, so those layers' cache entries at
        the new columns must still be in place (blocks that computed them and were then rolled back with
        ``truncate``, which keeps the entries). Returns the block at ``layer``, for ``finish``."""
        if any(0 <= i < layer for i in hidden_layers):
            raise InvalidArgumentError(f"hidden_layers {hidden_layers}: a block resumed at layer {layer} has no "
                                       f"states below it")
        self._resume, self._stop = (hidden, layer), layer
        try:
            return self.forward(torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device), valid, 1,
                                hidden_layers)
        finally:
            self._resume, self._stop = None, None

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, stop: int) -> torch.Tensor:
        """One new column per row through layers [0, stop): tokens [B] -> states [B, H] at ``stop``.

        What ``begin`` does for one live token per row, with the bookkeeping an early-exit chain pays
        at every draft cut to a few tensor operations (no block mask, no explicit positions, no taps);
        every row sees all its live columns (within each layer's window), the same arithmetic.
        """
        batch = tokens.shape[0]
        if self.columns + 1 > self.capacity:
            self._grow(self.columns, self.columns + 1)
        past, positions = self.append(self.valid.new_ones(batch, 1), dense=True)
        flat = positions.reshape(-1).contiguous()
        model = self.model
        work = self._scratch(batch, 1)
        params = llama.block_params(model, self.kv, past, flat, work)
        layers = model.layers[:stop]
        windows = dict.fromkeys(layer.window for layer in layers)
        every = windows.keys() == {FULL} and bool(self.valid.all())
        masks = {window: None if every else self.visible(positions, past, None, window).contiguous()
                 for window in windows}
        x = F.embedding(tokens, model.embed)
        return llama.decoder_layers(model, 0, len(layers), x, params, self.kv, masks)

    @torch.inference_mode()
    def advance(self, block: Block, stop: int) -> Block:
        """Run layers [block.layer, stop) of ``block``, writing their cache entries."""
        model = self.model
        stop = min(stop, len(model.layers))
        while block.layer < stop:
            if type(self)._layer is NativeCache._layer:  # the model's own layers: the run to ``stop`` in one
                # kernel call, which copies the taps out on the way (a drafter's cache whose ``_layer`` feeds each
                # layer inputs of its own runs them one by one)
                end = stop
                inside = {tap: torch.empty_like(block.hidden) for tap in block.hidden_layers if block.layer < tap < end}
                block.hidden = llama.decoder_layers(model, block.layer, end, block.hidden, block.params, self.kv,
                                                    block.masks, inside)
                block.taps.update({tap: copy.view(*block.shape, -1) for tap, copy in inside.items()})
            else:
                end = block.layer + 1
                block.hidden = self._layer(block.layer, block)
            block.layer = end
            if block.layer in block.hidden_layers and block.layer < len(model.layers):
                block.taps[block.layer] = block.states
        return block

    @torch.inference_mode()
    def finish(self, block: Block, logits_to_keep: int | torch.Tensor = 1):
        """Run the remaining layers and the head; returns what ``forward`` returns.

        That is logits [B, m, V] and hidden states [B, n, len(hidden_layers), H] or None.
        logits_to_keep: an int m, the last m columns of the block (0: all), or a LongTensor [B, m]
        of column indices inside the block.
        """
        model, last = self.model, len(self.model.layers)
        self.advance(block, last)
        states = block.states  # [B, n, H]
        if last in block.hidden_layers:  # transformers' last hidden state is the final-normed one
            block.taps[last] = model.final_norm(states)
        if isinstance(logits_to_keep, torch.Tensor):
            states = states.gather(1, logits_to_keep[:, :, None].expand(-1, -1, states.shape[2]))
        elif logits_to_keep:
            states = states[:, -logits_to_keep:]
        if self.logit_head is None:
            logits = model.logits(states)  # [B, m, V]
        else:
            logits = kernels.linear(states.contiguous(), self.logit_head, norm_eps=model.eps)
        hidden = None
        if block.hidden_layers:
            hidden = torch.stack([block.taps[i] for i in block.hidden_layers], dim=2)
        return logits, hidden

    # RaggedCache hooks.
    @torch.inference_mode()
    def _run(self, tokens, positions, past, logits_to_keep, hidden_layers, block_mask):
        block = self._start(tokens, positions, past, hidden_layers, block_mask)
        if self._stop is not None:
            return self.advance(block, self._stop)
        return self.finish(block, logits_to_keep)

    def _start(self, tokens, positions, past, hidden_layers, block_mask) -> Block:
        model = self.model
        batch, n = tokens.shape
        if past + n > self.capacity:
            self._grow(past, past + n)
        windows = dict.fromkeys(layer.window for layer in model.layers)
        if n == 1 and block_mask is None and windows.keys() == {FULL} and bool(self.valid.all()):
            masks = {FULL: None}  # one token that sees every column (plain decoding): no mask at all
        else:
            masks = {window: self.visible(positions, past, block_mask, window).contiguous() for window in windows}
        count = len(model.layers) + 1
        if any(not -count <= i < count for i in hidden_layers):
            raise InvalidArgumentError(f"hidden_layers {hidden_layers} outside [-{count}, {count})")
        hidden_layers = tuple(i % count for i in hidden_layers)
        start = 0
        if self._resume is not None:  # begin_at: the block enters at a later layer
            x, start = self._resume[0].reshape(batch * n, -1).to(model.dtype).contiguous(), self._resume[1]
        else:
            x = self._inputs(tokens)  # [B * n, H]
        flat = positions.reshape(-1).contiguous()
        work = self._scratch(batch, n)
        block = Block(x, (batch, n), past, start, flat, masks, llama.block_params(model, self.kv, past, flat, work),
                      work, hidden_layers)
        if 0 in hidden_layers:
            block.taps[0] = block.states
        return block

    def _inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input for a block of tokens [B, n]: [B * n, H] (drafter caches feed features too)."""
        return F.embedding(tokens.reshape(-1), self.model.embed)

    def _layer(self, index: int, block: Block) -> torch.Tensor:
        """Layer ``index`` on ``block.hidden``: its output [B * n, H] (caches whose layers are the model's
        own run them ``decoder_layers`` at a time)."""
        visible = block.masks[self.model.layers[index].window]
        return llama.decoder_layer(self.model, index, block.hidden, block.params, self.kv, visible)

    def _scratch(self, batch: int, n: int) -> llama.Scratch:
        """Work buffers for this block shape; kept for small blocks, which recur every step."""
        work = self.scratch.get((batch, n))
        if work is None:
            work = llama.scratch(self.model, batch, n)
            if batch * n <= 256:
                self.scratch[(batch, n)] = work
        return work

    def _grow(self, past: int, needed: int) -> None:
        # Every column moves, not only the first ``past``: entries past the live columns may still be
        # read (an early-exit verification re-enters drafted columns whose first layers ran already).
        self._reallocate(self.store.shape[2], max(needed, 2 * self.capacity), self.capacity)
        self.grown += 1

    def _reallocate(self, rows: int, capacity: int, columns: int) -> None:
        """A new store of ``rows`` rows and ``capacity`` columns holding the batch's first ``columns``
        columns (the rest unwritten: the next block, or ``extend``'s holes, writes it before it is read)."""
        store = llama.new_kv(self.model, rows, capacity)
        batch = self.kv.shape[2]
        store[:, :, :batch, :, :columns] = self.kv[:, :, :, :, :columns]
        self.store, self.kv = store, store[:, :, :batch]
        self.model.reserve(capacity)

    @torch.inference_mode()
    def adopt(self, other: "NativeCache") -> None:
        """Take ``other``'s columns (its keys and values in this cache's dtype, its rows' validity and
        positions): a cache of a model of the same shape, e.g. the prompt the target has just read, so
        a quantized copy of it need not read the prompt again. Rows and capacity must fit."""
        columns = other.columns
        if other.kv.shape[:4] + other.kv.shape[5:] != self.kv.shape[:4] + self.kv.shape[5:]:  # all but capacity
            raise ValueError(f"cannot adopt a cache shaped {tuple(other.kv.shape)} into {tuple(self.kv.shape)}")
        if columns > self.capacity:
            self._reallocate(self.store.shape[2], columns, 0)
        self.kv[:, :, :, :, :columns] = other.kv[:, :, :, :, :columns]
        self.valid, self.positions = other.valid.clone(), other.positions.clone()
        self.lengths = other.lengths.clone()

    @torch.inference_mode()
    def place(self, parts: list[tuple[torch.Tensor, "NativeCache"]]) -> None:
        """Fill this cache, still without columns, from ``parts``: (rows ``index`` of this cache, a cache
        of just those rows), e.g. a cohort's prompts read group by group. Each part's columns go to its
        rows as they are; a narrower part's rows get holes on the right (zeros: attention adds 0 x value),
        the layout ``extend`` makes. One store of this cache's capacity is written, instead of one per
        part extended into the next and the rows put back in order (measured: 16 ShareGPT prompts in 6
        groups spent more time copying caches than reading prompts)."""
        if self.columns:
            raise ValueError("place fills a cache without columns")
        columns = max(part.columns for _, part in parts)
        if columns > self.capacity:
            self._reallocate(self.store.shape[2], columns, 0)
        batch = self.batch_size
        valid = torch.zeros(batch, columns, dtype=torch.bool, device=self.valid.device)
        positions = torch.zeros(batch, columns, dtype=torch.long, device=self.valid.device)
        lengths = torch.zeros_like(self.lengths)
        for index, part in parts:
            width = part.columns
            for slot, row in enumerate(index.tolist()):
                self.kv[:, :, row, :, :width] = part.kv[:, :, slot, :, :width]
                self.kv[:, :, row, :, width:columns] = 0
            valid[index, :width] = part.valid
            positions[index, :width] = part.positions
            lengths[index] = part.lengths
            self.grown += part.grown
        self.valid, self.positions, self.lengths = valid, positions, lengths

    def _truncated(self, stop: int) -> None:
        pass  # columns from ``stop`` on are overwritten by the next block

    @torch.inference_mode()
    def _select_rows(self, index: torch.Tensor) -> None:
        self.store = keep_rows(self.store, index, dim=2, used=(4, self.columns))  # moved in place, written columns
        self.kv = self.store[:, :, :index.numel()]
        self.scratch.clear()  # shaped for the old batch size

    @torch.inference_mode()
    def _extend(self, other: "NativeCache", columns: int) -> None:
        batch, joining = self.kv.shape[2], other.kv.shape[2]
        capacity = max(self.capacity, other.capacity, columns)
        if capacity > self.capacity:  # a quarter more than asked: a server's cohorts each need a little more
            # (seen: 709, 726, 831, 847 columns), and each new store's first writes fault its pages in
            capacity = max(capacity, self.capacity + self.capacity // 4)
        rows = self.store.shape[2]
        if batch + joining > rows or capacity > self.capacity:
            self._reallocate(rows if batch + joining <= rows else max(batch + joining, 2 * rows), capacity,
                             self.columns)
        store = self.store
        store[:, :, batch:batch + joining, :, :other.columns] = other.kv[:, :, :, :, :other.columns]
        # Columns that become holes must hold finite numbers (attention adds 0 x value); a free row
        # may hold a former row's entries, and the narrower side's columns up to ``columns`` are read.
        store[:, :, batch:batch + joining, :, other.columns:columns] = 0
        store[:, :, :batch, :, self.columns:columns] = 0
        self.kv = store[:, :, :batch + joining]
        self.model.reserve(capacity)
        self.grown += other.grown
        self.scratch.clear()  # shaped for the old batch size

    @torch.inference_mode()
    def _gather_columns(self, order: torch.Tensor) -> None:
        # Row by row, whole columns (head_dim values each) at a time, and only the rows whose columns move: a
        # gather over an index expanded to every value took 0.3 s for the 7 rows of a served batch whose holes
        # had piled up over 300 plain steps (the first speculative step compacts them).
        width = order.shape[1]
        staying = torch.arange(width, device=order.device)
        for row in (~(order == staying).all(1)).nonzero()[:, 0].tolist():
            columns = self.kv[:, :, row]  # [layers, 2, heads, capacity, dim]
            columns[:, :, :, :width] = columns.index_select(3, order[row])


class NativeBackend:
    """A Llama-family model on specdec's own forward pass (the transformers backend: ``hf.HFBackend``)."""

    name = "native"
    supports_trees = True  # tree masks are part of its forward pass

    def __init__(self, model: llama.Llama):
        self.model = model

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", quantize: str | None = None) -> "NativeBackend":
        return cls(llama.load(path, dtype, device, quantize))

    @staticmethod
    def supports(path_or_config) -> str | None:
        """None when the native backend runs this model directory or HF config, else the reason."""
        if isinstance(path_or_config, (str, os.PathLike)):
            try:
                config = llama.read_config(path_or_config)
            except Exception as exc:
                return str(exc)
            path = os.fspath(path_or_config)
            safetensors = any(os.path.isfile(os.path.join(path, name))
                              for name in ("model.safetensors", "model.safetensors.index.json", "model.gguf"))
            return llama.unsupported(config) or (
                None if safetensors else "no safetensors weights (the native backend reads no pickle files)")
        return llama.unsupported(path_or_config)

    @staticmethod
    def supports_run(dtype: torch.dtype, device) -> str | None:
        """None when the kernels run this dtype on this device here, else the reason."""
        return llama.unsupported_run(dtype, device)

    @property
    def quantized_types(self) -> tuple[str, ...]:
        """The block-quantized types its matrices run in (a GGUF file's Q8_0, Q4_0, Q4_1), if any."""
        model = self.model
        matrices = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return tuple(sorted({m.qtype for m in [*matrices, model.head] if isinstance(m, llama.QMatrix)}))

    @property
    def exact_numerics(self) -> bool:
        """A row's outputs are bit for bit the same whatever block it is computed in (kernels.c)."""
        return True

    @property
    def description(self) -> str:
        return f"native/{self.config.model_type}"

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def new_cache(self, batch_size: int, capacity: int | None = None) -> NativeCache:
        """A cache for ``batch_size`` rows; size ``capacity`` for the longest prompt + new tokens + draft."""
        return NativeCache(self, batch_size, capacity)
