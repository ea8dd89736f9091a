"""Where the target and the draft live: the target across all GPUs but one, the draft alone on the last one.

SSD's draft works while the target verifies; on its own GPU it competes with nothing. `plan_placement` computes
the layout with accelerate (`infer_auto_device_map` under per-device budgets, keeping the model's no-split modules
whole); `place_models` applies it to hub ids, folders or loaded models. One GPU: both share it (with a warning:
they contend for its compute). No GPU: both stay on the CPU. A target dispatched by the user (`device_map=...`,
accelerate hooks, layers on several devices or offloaded) works as an SSD target as it is.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

MemoryBudget = dict  # device (GPU index, "cpu" or "disk") -> bytes or a size string ("10GiB"), as accelerate takes


@dataclass
class Placement:
    """A layout for an SSD pair: `target_device_map` in accelerate's form, the draft's device, the GPUs used."""

    target_device_map: dict[str, int | str]
    draft_device: torch.device
    shared_gpu: bool = False  # target and draft on one GPU
    target_bytes: int = 0
    draft_bytes: int = 0
    budgets: dict = field(default_factory=dict)

    @property
    def offloaded(self) -> bool:
        return any(device in ("cpu", "disk") for device in self.target_device_map.values())


def _size_bytes(value) -> int:
    from accelerate.utils import convert_file_size_to_int

    return int(convert_file_size_to_int(value)) if isinstance(value, str) else int(value)


def _skeleton(model_or_path, dtype):
    """A loaded model as is, or a hub id / folder as a model without weights (for its sizes and module tree)."""
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_or_path)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _model_bytes(model, dtype) -> int:
    from accelerate.utils import compute_module_sizes

    return int(compute_module_sizes(model, dtype=dtype)[""])


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def visible_gpus() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def plan_placement(target, draft, gpus: list[int] | None = None, max_memory: MemoryBudget | None = None,
                   dtype: torch.dtype | str | None = None) -> Placement:
    """The layout for `target` and `draft` (loaded models, hub ids or folders) on `gpus` (default: every visible
    one) under `max_memory` (default: what accelerate finds free; keys "cpu"/"disk" allow offloading the target).

    Raises `ValueError` before anything is loaded when the draft does not fit on its GPU, or the target does not
    fit on its GPUs and no "cpu"/"disk" budget allows offloading it."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_max_memory

    gpus = visible_gpus() if gpus is None else list(gpus)
    if len(set(gpus)) != len(gpus) or any(not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"gpus must be distinct GPU indices (ints >= 0); got {gpus!r}.")
    target_model, draft_model = _skeleton(target, dtype), _skeleton(draft, dtype)
    target_bytes, draft_bytes = _model_bytes(target_model, dtype), _model_bytes(draft_model, dtype)
    if not gpus:
        return Placement({"": "cpu"}, torch.device("cpu"), False, target_bytes, draft_bytes)
    if max_memory is None:
        free = get_max_memory()
        max_memory = {g: free[g] for g in gpus if g in free}
    budgets = {k: _size_bytes(v) for k, v in max_memory.items()}
    missing = [g for g in gpus if g not in budgets]
    if missing:
        raise ValueError(f"max_memory has no budget for GPU(s) {missing}; give one per GPU in gpus={gpus} "
                         "(bytes or a size string such as '20GiB'), plus 'cpu'/'disk' to allow offloading.")
    draft_gpu, target_gpus = gpus[-1], gpus[:-1] or gpus[-1:]
    shared = len(gpus) == 1
    if shared:
        warnings.warn(f"hf_ssd: one GPU: the target and the draft share GPU {draft_gpu} and contend for its compute "
                      "(the draft runs in a side stream); a second GPU for the draft is SSD's intended layout.",
                      stacklevel=2)
    if draft_bytes > budgets[draft_gpu]:
        raise ValueError(f"the draft ({_human(draft_bytes)}) does not fit on GPU {draft_gpu} "
                         f"(budget {_human(budgets[draft_gpu])}); raise max_memory[{draft_gpu}] or use a "
                         "smaller draft.")
    target_budget = {g: budgets[g] - (draft_bytes if shared else 0) for g in target_gpus}
    target_budget.update({k: budgets[k] for k in ("cpu", "disk") if k in budgets})
    no_split = list(getattr(target_model, "_no_split_modules", None) or [])
    device_map = dict(infer_auto_device_map(target_model, max_memory=target_budget, no_split_module_classes=no_split,
                                            dtype=dtype))
    spilled = {d for d in device_map.values() if d in ("cpu", "disk") and d not in budgets}
    if spilled:
        raise ValueError(f"the target ({_human(target_bytes)}) does not fit on GPU(s) {target_gpus} (budgets "
                         f"{', '.join(_human(target_budget[g]) for g in target_gpus)}; accelerate also keeps room for "
                         "the largest layer); add GPUs, raise max_memory, or allow offloading with max_memory['cpu'] "
                         "(and 'disk').")
    if set(device_map.values()) <= {target_gpus[0]}:
        device_map = {"": target_gpus[0]}
    return Placement(device_map, torch.device("cuda", draft_gpu), shared, target_bytes, draft_bytes, budgets)


def place_models(target, draft, gpus: list[int] | None = None, max_memory: MemoryBudget | None = None,
                 dtype: torch.dtype | str | None = None, offload_dir: str | os.PathLike | None = None,
                 **from_pretrained_kwargs):
    """Load (hub ids, folders) or move (loaded models) `target` and `draft` to the layout of `plan_placement`,
    enable SSD on the target, and return `(target, draft)`. The target's map is `target.hf_device_map` when it
    spans several devices.

        target, draft = place_models("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", dtype=torch.bfloat16)
        out = target.generate(**inputs, assistant_model=draft, ssd_config=SSDConfig(lookahead=4))
    """
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from ..generation import enable_ssd

    plan = plan_placement(target, draft, gpus, max_memory, dtype)
    if "disk" in plan.target_device_map.values() and offload_dir is None:
        raise ValueError("the placement offloads part of the target to disk: pass offload_dir=<a folder>.")
    kwargs = dict(from_pretrained_kwargs, **({"dtype": dtype} if dtype is not None else {}))
    single = plan.target_device_map.get("") if set(plan.target_device_map) == {""} else None
    if isinstance(target, torch.nn.Module):
        if single is not None:
            target = target.to(_device(single))
        else:
            main = next(d for d in plan.target_device_map.values() if d not in ("cpu", "disk"))
            target = dispatch_model(target, device_map=plan.target_device_map, main_device=_device(main),
                                    offload_dir=offload_dir)
    else:
        target = AutoModelForCausalLM.from_pretrained(target, device_map=plan.target_device_map,
                                                      offload_folder=offload_dir, **kwargs)
    if isinstance(draft, torch.nn.Module):
        draft = draft.to(plan.draft_device)
    else:
        draft = AutoModelForCausalLM.from_pretrained(draft, **kwargs).to(plan.draft_device)
    return enable_ssd(target.eval()), draft.eval()


def _device(spec) -> torch.device:
    return torch.device("cuda", spec) if isinstance(spec, int) else torch.device(spec)
