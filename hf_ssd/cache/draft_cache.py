"""The draft model's KV cache plus, for every slot, its logical position and whether it holds a real token."""

from __future__ import annotations

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


class DraftCache:
    """KV slots of the draft for b rows (growing layers that never evict, so tree scratch can be dropped) plus every
    slot's logical position and validity ([b, L] each).

    Every forward goes through `forward()` with an explicit visibility pattern; the 4D masks are built here from
    logical positions, also for sliding-window layers. Slots need not be contiguous: invalid slots (padding, dummy
    queries) are never visible, and `keep` drops slots and rows.
    """

    def __init__(self, model: torch.nn.Module, rows: int = 1, timer=None):
        self.model = model
        self.device = model.device
        self.kv = DynamicCache()
        self.kv.layer_class_to_replicate = GrowingLayer
        self.positions = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.timer = timer  # a `PhaseTimer`: the model calls are recorded as "<phase>_forward"
        self._windows = attention_windows(model.config)
        self._cache_kwarg = cache_kwarg(model)
        self._dtype = next(model.parameters()).dtype

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
        `valid` [b, N] marks real tokens (default all). Returns logits [b, N', V]."""
        key_pos = torch.cat([self.positions, positions], dim=1)
        masks = {
            kind: additive_mask(visible, positions, key_pos, self._dtype, window)
            for kind, window in self._windows.items()
        }
        mask = masks[""] if "" in masks else masks
        kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      logits_to_keep=logits_to_keep, **{self._cache_kwarg: self.kv})
        if self.timer is None:
            out = self.model(**kwargs)
        else:
            with self.timer(f"{phase}_forward"):
                out = self.model(**kwargs)
        self.positions = key_pos
        new_valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return out.logits
