"""What SSD refuses, checked before any forward pass, with errors that name the problem and the way out."""

from __future__ import annotations

import torch

from ..compat import attn_implementation, is_stateful, model_kwargs_cache_key, pad_token_tensor


def model_vocab_size(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "out_features", None), int):  # nn.Linear, also dynamically quantized
        return head.out_features
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        return head.weight.shape[0]
    return model.config.get_text_config().vocab_size


# Processors that keep state across calls or assume one new token per call: verification scores K+1 positions
# per round and rolls back, so they would silently change the output law. Every other processor is a function of
# (prefix, scores) and is applied to each verified position with its exact prefix, which keeps SSD lossless.
STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "ClassifierFreeGuidanceLogitsProcessor",
    "SynthIDTextWatermarkLogitsProcessor",
    "WhisperTimeStampLogitsProcessor",
    "WhisperNoSpeechDetection",
    "AlternatingCodebooksLogitsProcessor",
    "BarkEosPrioritizerLogitsProcessor",
    "DiaClassifierFreeGuidanceLogitsProcessor",
    "DiaEOSChannelFilterLogitsProcessor",
    "DiaEOSDelayPatternLogitsProcessor",
}


def check_processors(logits_processor) -> None:
    """Refuse logits processors whose state would not survive multi-token verification and rollback."""
    for processor in logits_processor or []:
        name = type(processor).__name__
        if name in STATEFUL_PROCESSORS:
            raise ValueError(
                f"SSD cannot use {name}: it keeps state across decoding steps, which speculative verification "
                "(several positions per forward, then rollback) would silently break. Stateless processors "
                "(penalties, bad words, min length, warpers, ...) are supported."
            )


def check_vocabulary(model, assistant_model, tokenizer=None, assistant_tokenizer=None) -> None:
    """The draft must score the target's vocabulary: SSD exchanges token ids and distributions, never text.

    Vocabularies that differ only by embedding padding (Qwen2.5-7B's 152,064 rows against Qwen2.5-0.5B's 151,936,
    one tokenizer of 151,665 tokens) are accepted when the tokenizers passed to generate() (`tokenizer=`,
    `assistant_tokenizer=`, as transformers asks for drafts of another size) have the same vocabulary and fit in
    both models: ids only the target has are never drafted (q = 0), ids only the draft has are never proposed."""
    target_vocab, draft_vocab = model_vocab_size(model), model_vocab_size(assistant_model)
    if target_vocab == draft_vocab:
        return
    if tokenizer is None or assistant_tokenizer is None:
        raise ValueError(
            f"SSD needs the draft to share the target's vocabulary; the target scores {target_vocab} tokens and the "
            f"draft {draft_vocab}. Vocabularies that differ only by embedding padding (e.g. Qwen2.5-7B and "
            "Qwen2.5-0.5B) are accepted when their tokenizers agree: pass tokenizer= and assistant_tokenizer= to "
            "generate() so SSD can check them."
        )
    if tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
        raise ValueError(
            "The target's and the draft's tokenizers differ: SSD needs one shared vocabulary. For drafts with another "
            "tokenizer use transformers' universal assisted decoding (generate() without ssd_config)."
        )
    real = len(tokenizer)
    if real > min(target_vocab, draft_vocab):
        raise ValueError(
            f"The tokenizer has {real} tokens but the target scores {target_vocab} and the draft scores "
            f"{draft_vocab}: the smaller model cannot score every token, so this is not embedding padding."
        )


def check_supported(model, assistant_model, input_ids, generation_config, synced_gpus, model_kwargs) -> None:
    """Refuse what SSD does not support, with a clear error, before any forward pass."""
    if assistant_model is None:
        raise ValueError("SSD needs a draft model: pass `assistant_model=` to generate() along with `ssd_config`.")
    if model.config.is_encoder_decoder or assistant_model.config.is_encoder_decoder:
        raise ValueError("SSD supports decoder-only target and draft models; got an encoder-decoder model.")
    mask = model_kwargs.get("attention_mask")
    check_prompt(input_ids, mask)
    if mask is not None and mask.dim() == 2 and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "SSD needs left-padded batches (every row's last position a real token); got right padding. Set "
            "`tokenizer.padding_side = 'left'`."
        )
    if input_ids.shape[0] > 1:
        check_batchable(input_ids, generation_config, model_kwargs)
    if synced_gpus:
        raise ValueError("SSD does not support `synced_gpus=True`.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "SSD does not return attentions or hidden states; drop `output_attentions` / `output_hidden_states` "
            "(`output_scores` and `output_logits` are supported)."
        )
    if is_stateful(assistant_model) or is_stateful(model):
        raise ValueError(
            "SSD needs models whose cache can be rolled back; stateful (recurrent) models are not supported."
        )
    attn = attn_implementation(assistant_model.config)
    if "flash" in attn or "flex" in attn:
        raise ValueError(
            f"SSD's tree attention needs a custom 4D mask, which '{attn}' does not take; load the draft with "
            "attn_implementation='sdpa' or 'eager'."
        )
    if model_kwargs_cache_key(model_kwargs) is None:
        raise ValueError("SSD needs the target's KV cache: do not pass `use_cache=False`.")
    cache = model_kwargs.get(model_kwargs_cache_key(model_kwargs))
    if cache is not None and input_ids.shape[0] == 1 and not getattr(cache, "is_croppable", True):
        layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise ValueError(
            f"SSD crops the target's cache after every verification; this {type(cache).__name__} has layers that "
            f"cannot be cropped ({', '.join(layers)}: e.g. static sliding-window layers). Use the default dynamic "
            "cache, or a static cache on a model without sliding-window layers."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("SSD needs `input_ids`; `inputs_embeds` prompts are not supported.")


def check_prompt(input_ids, attention_mask=None) -> None:
    """Every row needs a real token to start from (SSD has no BOS of its own to draft after)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[-1] == 0:
        raise ValueError(
            f"SSD needs a prompt of at least one token per row; got `input_ids` of shape {tuple(input_ids.shape)}. "
            "Start from a BOS token (e.g. `tokenizer.bos_token_id`) to generate from nothing."
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and bool(
            (attention_mask.sum(dim=-1) == 0).any()):
        raise ValueError(
            "SSD needs at least one real token in every row; the attention mask has a row of padding only."
        )


def check_batchable(input_ids, generation_config, model_kwargs) -> None:
    """What batch > 1 additionally needs: a fresh cache, 2D per-row inputs, a pad token and no streamer."""
    rows = input_ids.shape[0]
    cache = model_kwargs.get(model_kwargs_cache_key(model_kwargs) or "cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"SSD continues from a passed cache only at batch size 1; got a filled cache with a batch of {rows}."
        )
    for key in ("position_ids", "token_type_ids", "mm_token_type_ids"):
        value = model_kwargs.get(key)
        if value is not None and (value.dim() != 2 or value.shape[0] != rows):
            raise ValueError(
                f"SSD at batch size {rows} needs `{key}` of shape [batch, length]; got {tuple(value.shape)}."
            )
    if pad_token_tensor(generation_config) is None:
        raise ValueError(
            f"SSD at batch size {rows} fills finished rows with the pad token: set `pad_token_id` (e.g. to the EOS "
            "token) in generate() or the generation config."
        )
