"""The draft model's KV cache plus, for every slot, its logical position and whether it holds a real token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..compat import cache_kwarg
from .alignment import gather_slots
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


class DraftCache:
    """KV slots of the draft for b rows: a `DynamicCache` with full layers (never evicting), so tree scratch can be
    dropped, plus every slot's logical position and validity ([b, L] each).

    Every forward goes through `forward()` with an explicit visibility pattern; the 4D masks are built here from
    logical positions, also for sliding-window layers. Slots need not be contiguous: invalid slots (padding, dummy
    queries) are never visible, and `keep` compacts the rows.
    """

    def __init__(self, model: torch.nn.Module, rows: int = 1):
        self.model = model
        self.device = model.device
        self.kv = DynamicCache()
        self.positions = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self._windows = attention_windows(model.config)
        self._cache_kwarg = cache_kwarg(model)
        self._dtype = next(model.parameters()).dtype

    def __len__(self) -> int:
        return self.positions.shape[1]

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    def _layers(self):
        return [layer for layer in self.kv.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]

    def crop(self, length: int) -> None:
        """Keep the first `length` slots of every row."""
        extra = len(self) - length
        if extra < 0:
            raise ValueError(f"cannot crop a draft cache of {len(self)} slots to {length}.")
        if extra:
            self.kv.crop(-extra)
            self.positions = self.positions[:, :length]
            self.valid = self.valid[:, :length]

    def keep(self, index: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep, for each row (of `rows`, default all), the slots `index` [b', W] in that order; `valid` [b', W]
        marks which of them stay visible (False for padding). See `alignment.compact`."""
        if rows is not None:
            self.positions, self.valid = self.positions[rows], self.valid[rows]
        for layer in self._layers():
            keys, values = (layer.keys, layer.values) if rows is None else (layer.keys[rows], layer.values[rows])
            layer.keys = gather_slots(keys, index, -2)
            layer.values = gather_slots(values, index, -2)
        self.positions = self.positions.gather(1, index)
        self.valid = self.valid.gather(1, index) & valid

    def memory_bytes(self) -> int:
        """Bytes held by the KV tensors."""
        return sum(t.numel() * t.element_size() for layer in self._layers() for t in (layer.keys, layer.values))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        valid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Append N tokens per row ([b, N]) at logical `positions` [b, N]; `visible` is [b, N, len(self)+N];
        `valid` [b, N] marks real tokens (default all). Returns logits [b, N', V]."""
        key_pos = torch.cat([self.positions, positions], dim=1)
        masks = {
            kind: additive_mask(visible, positions, key_pos, self._dtype, window)
            for kind, window in self._windows.items()
        }
        mask = masks[""] if "" in masks else masks
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: self.kv},
        )
        self.positions = key_pos
        new_valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return out.logits
