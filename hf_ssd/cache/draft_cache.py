"""The draft model's KV cache plus, for every slot, its logical position and whether it holds a real token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..compat import cache_kwarg
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
    """KV slots of the draft: a `DynamicCache` with full layers (never evicting), so tree scratch can be cropped.

    Every forward goes through `forward()` with an explicit visibility pattern; the 4D masks are built here from
    logical positions, also for sliding-window layers.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = model.device
        self.kv = DynamicCache()
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(0, dtype=torch.bool, device=self.device)
        self._windows = attention_windows(model.config)
        self._cache_kwarg = cache_kwarg(model)
        self._dtype = next(model.parameters()).dtype

    def __len__(self) -> int:
        return self.positions.shape[0]

    def crop(self, length: int) -> None:
        """Keep the first `length` slots."""
        extra = len(self) - length
        if extra < 0:
            raise ValueError(f"cannot crop a draft cache of {len(self)} slots to {length}.")
        if extra:
            self.kv.crop(-extra)
            self.positions = self.positions[:length]
            self.valid = self.valid[:length]

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only the listed slots, in that order (e.g. the committed prefix plus one tree branch)."""
        for layer in self.kv.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, slots)
                layer.values = layer.values.index_select(-2, slots)
        self.positions = self.positions[slots]
        self.valid = self.valid[slots]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        valid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Append N tokens at logical `positions`; `visible` is [N, len(self)+N]. Returns logits [N', V]."""
        key_pos = torch.cat([self.positions, positions])
        masks = {
            kind: additive_mask(visible, positions, key_pos, self._dtype, window)
            for kind, window in self._windows.items()
        }
        mask = masks[""] if "" in masks else masks
        out = self.model(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: self.kv},
        )
        self.positions = key_pos
        new_valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        self.valid = torch.cat([self.valid, new_valid])
        return out.logits[0]
