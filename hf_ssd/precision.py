"""CPU precision options: fp32, or int8 weights with dynamic int8 activations (fbgemm) for every Linear layer.

On AVX2 CPUs a forward over K+1 tokens costs about 3× one token in fp32 but about 1.5× in int8, and the int8
forward is several times faster overall (README, "Real models offline, CPU precision").

Exactness: the DRAFT's numerics never change SSD's output — verification is exact for whatever distribution the
draft proposes from — so an int8 draft keeps greedy output token-identical to the fp32 target. Quantizing the
TARGET changes the model itself: `quantize_dynamic` picks one activation scale per input tensor, so a forward
over K+1 tokens quantizes each token differently than decoding it alone, and verification then disagrees with
plain int8 decoding at some positions. Measure and report agreement with plain decoding whenever the target is
int8.
"""

from __future__ import annotations

import warnings

import torch

PRECISIONS = ("fp32", "int8")


def apply_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Return `model` in `precision` ("fp32": unchanged; "int8": dynamic int8 Linear layers, CPU only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: expected one of {PRECISIONS}.")
    if precision == "fp32":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"precision='int8' (dynamic quantization) runs on CPU only; the model is on {model.device}.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        quantized = torch.ao.quantization.quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8)
    return quantized.eval()


def count_parameters(model: torch.nn.Module) -> int:
    """The model's parameter count as its architecture has it, quantized layers included (a dynamically quantized
    Linear keeps its weight and bias in packed params, which `model.parameters()` does not list; a quantized head
    tied to the input embeddings is that one matrix, counted once)."""
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False)) if config is not None else False
    for module in model.modules():
        if tied and module is head:
            continue
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            weight, bias = module._weight_bias()
            total += weight.numel() + (bias.numel() if bias is not None else 0)
    return total
