"""The draft model's KV cache plus, for every slot, its logical position and whether it holds a real token."""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..compat import cache_kwarg
from .alignment import compact, gather_slots
from .tree_attention import additive_mask


def attention_windows(config) -> dict[str, int | None]:
    """Mask kinds the model's layers use, each with its sliding window (None = full attention).

    Models with `layer_types` take a dict of masks keyed by layer type; the others take one tensor, keyed "".
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        kinds = {}
        for kind in set(layer_types):
            if kind == "full_attention":
                kinds[kind] = None
            elif kind == "sliding_attention":
                kinds[kind] = window
            else:
                raise ValueError(
                    f"SSD's tree attention supports full and sliding-window attention layers; the draft model has "
                    f"'{kind}' layers."
                )
        return kinds
    return {"": window}


class GrowingLayer(DynamicLayer):
    """A full-attention KV layer (never evicting) whose keys and values are views of buffers with spare capacity.

    Appending a forward's states writes them in place, where `DynamicLayer` concatenates (a copy of the whole
    context per forward); `keep_tail` moves only the slots after a given one. Capacity grows by a quarter (at least
    256 slots) when full, so the copies on growth are amortised.
    """

    def __init__(self, **kwargs):
        self._keys = self._values = None
        self.length = 0
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[..., : self.length, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # transformers' own methods assign whole tensors
        self._keys = value
        self.length = 0 if value is None or value.dim() < 2 else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[..., : self.length, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1])
        self._values = value_states.new_empty(*value_states.shape[:-2], 0, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity():
            return
        grown = needed + max(256, needed // 4)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:-2], grown, old.shape[-1])
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._reserve(end)
        self._keys[..., self.length : end, :] = key_states
        self._values[..., self.length : end, :] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (finished rows leave)."""
        if self._keys is not None:
            length = self.length
            self._keys = self.keys.index_select(0, rows)
            self._values = self.values.index_select(0, rows)
            self.length = length

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        """Slots before `start` stay; row r's slots after it become `start + index[r]` in order ([b, W])."""
        for name in ("_keys", "_values"):
            buffer = getattr(self, name)
            tail = gather_slots(buffer[..., start : self.length, :], index, -2)
            buffer[..., start : start + index.shape[1], :] = tail
        self.length = start + index.shape[1]

    def memory_bytes(self) -> int:
        """Bytes held, spare capacity included."""
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values) if t is not None)


class StaticSlotsLayer(DynamicLayer):
    """A full-attention KV layer of fixed capacity, for compiled and graph-captured draft steps.

    `keys`/`values` are always the whole buffers [b, h, C, d] (slots not written yet are masked by the caller), and a
    forward's states are written at slots [n, n + N) through a device-side counter n, so a step's shapes depend only
    on (b, N, C) and it replays without recompiling. The host mirror `length` is advanced by the caller
    (`DraftCache.forward`), never inside the model, so nothing compiled reads a changing Python number.
    """

    is_compileable = True

    def __init__(self, capacity: int, **kwargs):
        self.capacity_slots = capacity
        self.length = 0
        super().__init__(**kwargs)
        self.keys = self.values = self._next = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.capacity_slots, d)
        self.values = value_states.new_zeros(b, value_states.shape[1], self.capacity_slots, value_states.shape[-1])
        self._next = torch.zeros((), dtype=torch.long, device=self.device)
        self.length = 0
        self.is_initialized = True
        self._mark_static()

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values, self._next):
                torch._dynamo.mark_static_address(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self._next + torch.arange(key_states.shape[-2], device=self.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self._next.add_(key_states.shape[-2])
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.capacity_slots, 0

    def advance(self, count: int) -> None:
        """The host mirror of the device counter, after a forward of `count` tokens per row."""
        self.length += count

    def grow(self, capacity: int) -> None:
        """Move to larger buffers (a new shape: compiled steps specialise again)."""
        if self.keys is not None and capacity > self.capacity_slots:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:-2], capacity, old.shape[-1])
                new[..., : self.length, :] = old[..., : self.length, :]
                setattr(self, name, new)
            self._mark_static()
        self.capacity_slots = max(capacity, self.capacity_slots)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)
            self._mark_static()

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        for buffer in (self.keys, self.values):
            tail = gather_slots(buffer[..., start : self.length, :], index, -2)
            buffer[..., start : start + index.shape[1], :] = tail
        self.length = start + index.shape[1]
        self._next.fill_(self.length)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


_COMPILED: dict = {}


def _call(model: torch.nn.Module, kwargs: dict):
    return model(**kwargs)


def compiled_call(model: torch.nn.Module, backend: str, mode: str | None):
    """A callable running `model(**kwargs)` compiled with (backend, mode). One compiled function per (backend, mode)
    takes the model as an argument (dynamo specialises on it): graphs compiled in one generation serve the next,
    and nothing is attached to the model (it still pickles for the process executor, and is freed as usual)."""
    if (backend, mode) not in _COMPILED:
        _COMPILED[backend, mode] = torch.compile(_call, backend=backend, mode=mode, dynamic=False)
    compiled = _COMPILED[backend, mode]
    return lambda **kwargs: compiled(model, kwargs)


def recompile_limits():
    """Room for every static shape a generation meets (the draft: widths 1, 2, K+1, B at each batch size as rows
    finish; the target: K+1 for each K the adaptive lookahead picks) without falling back to eager: torch's default
    allows 8 per function."""
    return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024)


def default_compile(device: torch.device) -> tuple[str, str | None]:
    """(backend, mode): CUDA graphs through inductor's "reduce-overhead" on a GPU, inductor's kernels elsewhere."""
    return ("inductor", "reduce-overhead") if torch.device(device).type == "cuda" else ("inductor", None)


class DraftCache:
    """KV slots of the draft for b rows (growing layers that never evict, so tree scratch can be dropped) plus every
    slot's logical position and validity ([b, L] each).

    Every forward goes through `forward()` with an explicit visibility pattern; the 4D masks are built here from
    logical positions, also for sliding-window layers. Slots need not be contiguous: invalid slots (padding, dummy
    queries) are never visible, and `keep` drops slots and rows.
    """

    def __init__(self, model: torch.nn.Module, rows: int = 1, timer=None, capacity: int | None = None,
                 compiled=None, compiled_widths: frozenset[int] = frozenset(), vocab_size: int | None = None,
                 model_vocab_size: int | None = None):
        self.model = model
        self.device = model.device
        # The target's vocabulary (what logits are returned over) and the draft's own rows; they differ only by
        # embedding padding (e.g. Qwen2.5-7B's 152,064 against 0.5B's 151,936, one tokenizer): see `_fit`.
        self.vocab_size, self.model_vocab_size = vocab_size, model_vocab_size
        self.capacity = capacity  # None: growing layers; else fixed-capacity layers (static shapes)
        self.kv = DynamicCache()
        if capacity is None:
            self.kv.layer_class_to_replicate = GrowingLayer
        else:
            count = model.config.get_text_config(decoder=True).num_hidden_layers
            self.kv.layers = [StaticSlotsLayer(capacity) for _ in range(count)]
        self.compiled = compiled  # the model's compiled call, for forwards of `compiled_widths` tokens per row
        self.compiled_widths = compiled_widths
        self.compiled_calls = 0
        self.positions = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.timer = timer  # a `PhaseTimer`: the model calls are recorded as "<phase>_forward"
        self._windows = attention_windows(model.config)
        self._cache_kwarg = cache_kwarg(model)
        self._dtype = next(model.parameters()).dtype
        self.version = 0  # counts the calls that may change the slots (`forward`, `keep`)

    def __len__(self) -> int:
        return self.positions.shape[1]

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    def _layers(self) -> list[GrowingLayer]:
        return [layer for layer in self.kv.layers if getattr(layer, "is_initialized", False)]

    def keep(self, keep: torch.Tensor, rows: torch.Tensor | None = None, max_holes: int = 0) -> None:
        """Keep, for each row (of `rows`, default all), the slots marked in `keep` [b, L], in order.

        Slots before the first valid slot any row drops stay where they are and the kept slots after it are packed,
        right-aligned, behind them (`alignment.compact`): a round moves only the slots it wrote, not the context.
        Invalid slots left before that point (padding, dummy queries) are holes; once they make the cache more than
        `max_holes` columns wider than a full compaction would, the whole cache is compacted.
        """
        self.version += 1
        if rows is not None:
            keep, self.positions, self.valid = keep[rows], self.positions[rows], self.valid[rows]
            for layer in self._layers():
                layer.select_rows(rows)
        keep = keep & self.valid
        if not keep.numel():
            return
        dropped = (self.valid & ~keep).any(dim=0).nonzero()
        start = int(dropped[0]) if dropped.numel() else len(self)
        # columns a full compaction would remove on top of a partial one: holes before `start`
        if start + int(keep[:, start:].sum(dim=1).max()) - int(keep.sum(dim=1).max()) > max_holes:
            start = 0
        if start == len(self):
            return
        index, valid = compact(keep[:, start:])
        for layer in self._layers():
            layer.keep_tail(start, index)
        self.positions = torch.cat([self.positions[:, :start], self.positions[:, start:].gather(1, index)], dim=1)
        self.valid = torch.cat([self.valid[:, :start], self.valid[:, start:].gather(1, index) & valid], dim=1)

    def _reserve(self, slots: int) -> None:
        """Static layers: grow the capacity (by half, in blocks of 256 slots) when `slots` would not fit."""
        if slots > self.capacity:
            self.capacity = -(-max(slots, self.capacity * 3 // 2) // 256) * 256
            for layer in self.kv.layers:
                layer.grow(self.capacity)

    def memory_bytes(self) -> int:
        """Bytes held by the KV buffers (spare capacity included)."""
        return sum(layer.memory_bytes() for layer in self._layers())

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        valid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        phase: str = "draft",
    ) -> torch.Tensor:
        """Append N tokens per row ([b, N]) at logical `positions` [b, N]; `visible` is [b, N, len(self)+N];
        `valid` [b, N] marks real tokens (default all). Returns logits [b, N', V] over the target's vocabulary."""
        self.version += 1
        if (self.model_vocab_size or 0) < (self.vocab_size or 0):
            tokens = tokens.clamp_max(self.model_vocab_size - 1)  # a padding id the draft has no row for
        key_pos = torch.cat([self.positions, positions], dim=1)
        mask_visible, mask_key_pos = visible, key_pos
        if self.capacity is not None:  # static shapes: masks over the whole capacity, unwritten slots masked
            self._reserve(key_pos.shape[1])
            spare = self.capacity - key_pos.shape[1]
            mask_visible = torch.nn.functional.pad(visible, (0, spare))
            mask_key_pos = torch.nn.functional.pad(key_pos, (0, spare))
        masks = {
            kind: additive_mask(mask_visible, positions, mask_key_pos, self._dtype, window)
            for kind, window in self._windows.items()
        }
        mask = masks[""] if "" in masks else masks
        kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      logits_to_keep=logits_to_keep, **{self._cache_kwarg: self.kv})
        call, limits = self.model, contextlib.nullcontext()
        if self.compiled is not None and tokens.shape[1] in self.compiled_widths and len(self) > 0:
            call, limits = self.compiled, recompile_limits()
            kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self.compiled_calls += 1
        with limits, self.timer(f"{phase}_forward") if self.timer is not None else contextlib.nullcontext():
            out = call(**kwargs)
        if self.capacity is not None:
            for layer in self.kv.layers:
                layer.advance(tokens.shape[1])
        self.positions = key_pos
        new_valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return self._fit(out.logits)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft's padding rows beyond it dropped; ids only the target
        has (its padding) never drafted (their q is 0)."""
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[..., : self.vocab_size]
        missing = logits.new_full((*logits.shape[:-1], self.vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, missing], dim=-1)
