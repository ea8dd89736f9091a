"""Replay the lookahead policy offline: many prompts in seconds instead of an hour of `hf-ssd bench`.

Under greedy decoding a speculation's fate is fixed by the text: the draft's chain from output position i agrees
with the target's output for L_i tokens, where L_i counts the consecutive positions from i at which the draft's
teacher-forced argmax equals the target's token (once the draft's token is right, its next prediction is the
teacher-forced one). So one target generation and one draft forward per prompt give every round's outcome for any
K, and the real `LookaheadPolicy` can be driven round by round against a cost profile (a fake clock), as the
decoding loop drives it:

    python benchmarks/replay_policy.py record --prompts humaneval,gsm8k,mt_bench,alpaca --limit 8 --out runs.json
    python benchmarks/replay_policy.py replay runs.json --profile epyc

`replay` prints decode tok/s per set for AR, SD at fixed K (serial drafting), transformers' default schedule (draft
while the draft's confidence is at least 0.4, up to 20 tokens), SSD with the policy, with `--rule` the fastest fixed
rule on the draft's confidence (`ConfidenceRule`, fitted on the other half of the prompts: what confidence alone makes
of the cost curve, without foresight), and the oracle (the fastest serial schedule of depths knowing every L_i: the
bound on what choosing K per round can gain), as ratios to AR. Runs recorded
with the draft's confidences replay the policy as `SSDConfig`'s defaults run it (`draft_confidence=True`): K from the
speculation in hand's calibrated acceptance, serial speculations drafted just in time under the stop rule.

The draft's predictions are recorded one token at a time on its KV cache, as the draft decodes: a teacher-forced
forward over the whole output differs from them for a draft quantized with per-tensor activation scales (int8
dynamic quantization scales each forward's activations together: on the real pair's translation prompts it agreed
with the target on 54 % of positions where its decoding agrees on 69 %).

A profile's costs are exact unless `--noise SIGMA` scales every verification by a lognormal factor of mean 1 (a
shared machine's timing noise, which the policy's cost tables then have to see through; `--seed` picks the stream).
What it leaves out: cache misses are an expected backup cost (`--hit-rate`), not the fan-out's real lookups;
costs do not grow with context; sampling is not modelled; after a rejected token a serial speculation's stop
decisions read the confidences of the target's continuation, not the draft's own. It ranks policy changes;
`hf-ssd bench` measures them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from hf_ssd.generation import confidence as confidence_module
from hf_ssd.generation import lookahead as lookahead_module
from hf_ssd.generation import observations as observations_module
from hf_ssd.generation import probing as probing_module
from hf_ssd.generation.candidate_generator import DraftTimings
from hf_ssd.generation.costs import CPU_SHAPE, FLAT_SHAPE
from hf_ssd.generation.lookahead import LookaheadPolicy

# Cost profiles (ms), measured with the Qwen2.5-Coder 1.5B fp32 / 0.5B int8 pair on 2-core machines:
# verify[k]: the target over k+1 positions on one thread beside the working draft; verify_all[k]: on every core
# with the draft idle (plain steps while paused, serial rounds); draft_token: one draft step on one thread (tree
# rounds cost `draft_token` per level), draft_token_all on every core; contention: a plain step beside a working
# draft (its memory traffic) over one with it paused.
PROFILES = {
    # 2-core AMD EPYC, 2026-12-01 bench (docs/figures/bench_adaptive_k4.md) and docs/design.md's curve
    "epyc": dict(verify=[436, 870, 1254, 826, 981, 1000, 1020, 1040, 1060],
                 verify_all=[466, 900, 1300, 860, 1000, 1020, 1040, 1060, 1080],
                 draft_token=45.0, draft_token_all=42.0, contention=1.19, overhead=5.0),
    # the same kind of machine on 2026-12-02 (its K = 8 bench traces): slower, a steeper curve, a slower draft
    "epyc-slow": dict(verify=[650, 1310, 1970, 1970, 2000, 2050, 2330, 2250, 2380],
                      verify_all=[650, 1340, 1340, 1340, 1340, 2060, 2060, 2060, 2300],
                      draft_token=170.0, draft_token_all=110.0, contention=1.19, overhead=5.0),
    # the 2-core AMD EPYC (AVX-512) with the target packed for oneDNN (`--target-precision fp32-packed`), from the
    # 2026-12-02 bench traces (docs/figures/bench_packed_k4.md) and direct forwards at 200 tokens of context: the
    # curve is flat, the target scales with cores, the draft's tree round on one core is the slower side
    "epyc-packed": dict(verify=[470, 600, 430, 490, 400, 420, 440, 460, 480],
                        verify_all=[345, 400, 350, 340, 300, 320, 340, 360, 400],
                        draft_token=110.0, draft_token_all=55.0, contention=1.19, overhead=3.0, flat=True),
    # the 2-core Intel Xeon (AVX-512) with the target packed, from the 2026-12-05 nine-set bench traces at 40-800
    # tokens of context: serial verifications flat to 4 tokens, a 33 ms jump at 5; a concurrent verification on
    # one thread about twice a plain step; a serial speculation's first token 45 ms, each further one 42 ms
    "xeon-packed": dict(verify=[300, 360, 540, 540, 540, 600, 600, 600, 650, 660, 670, 680, 690, 700, 710, 720, 780],
                        verify_all=[282, 305, 305, 305, 317, 350, 350, 350, 350, 378, 384, 384, 390, 396, 402, 408,
                                    443],
                        draft_token=60.0, draft_token_all=42.0, draft_fixed_all=45.0, contention=1.19, overhead=5.0,
                        flat=True),
    # a 2-core Xeon (AMX) where `--target-precision auto` kept MKL's fp32 kernels, from the 2026-12-05 nine-set bench
    # traces of the fourteenth session (median serial verifications at 40-800 tokens of context): 1-3 positions cost
    # about one plain step, 4-6 twice that, 7-9 2.8x; one beside the working draft measured at 2 and 4 tokens (497, 920
    # ms), the others scaled from the serial ones by that ratio; a serial speculation's first token 44 ms, the next 41
    "xeon-mkl": dict(verify=[500, 500, 500, 920, 920, 950, 1250, 1260, 1280, 1560, 1600, 1610, 1630, 1650, 1670, 1680,
                             1700],
                     verify_all=[246, 270, 274, 476, 491, 514, 675, 682, 693, 845, 864, 870, 880, 890, 900, 910, 920],
                     draft_token=60.0, draft_token_all=41.0, draft_fixed_all=44.0, contention=1.19, overhead=5.0),
    # the same Xeon type on 2026-12-06 (the eighteenth session's nine-set traces, MKL, 40-800 tokens of context):
    # serial verifications of 1-3 positions 218-236 ms, 4-6 about twice that, 7-9 2.8x; 17 positions dip to 660 ms
    # (measured on gsm8k and humaneval); a concurrent verification on one thread about twice the serial one; a
    # serial speculation's first token 40 ms, each further one 36.5 ms, the loop 5 ms
    "xeon-mkl-dec06": dict(verify=[420, 440, 450, 800, 810, 850, 1120, 1120, 1160, 1380, 1320, 1420, 1460, 1500,
                                   1520, 1480, 1300],
                           verify_all=[220, 230, 236, 437, 443, 465, 612, 612, 636, 758, 722, 778, 800, 876, 850,
                                       820, 660],
                           draft_token=38.0, draft_token_all=36.5, draft_fixed_all=40.0, contention=1.19,
                           overhead=5.0),
    # the 2-core AMD EPYC (AVX2, the machine type) of 2026-12-07, MKL fp32, from the twenty-ninth and thirtieth
    # sessions' bench traces (medians over nine sets, 40-1,300 tokens of context): a plain step 643 ms, one more
    # position twice that, 5-17 positions 3.3-4.2x (noisy: contexts differ); a concurrent verification measured at
    # 1-4 tokens only; a serial speculation's fixed part and first token 106 ms, each further token 95 ms
    "epyc-avx2": dict(verify=[760, 1310, 1600, 2080, 2100, 2200, 2300, 2400, 2500, 2600, 2700, 2750, 2800, 2850,
                              2900, 2950, 3000],
                      verify_all=[643, 1290, 1870, 2100, 2150, 2250, 2300, 2350, 2450, 2500, 2550, 2600, 2650, 2700,
                                  2700, 2700, 2700],
                      draft_token=100.0, draft_token_all=95.0, draft_fixed_all=106.0, contention=1.19, overhead=15.0),
    # flat-ish curve (AVX-512 Xeon: 1-3 positions cost one, 4-5 twice that)
    "xeon": dict(verify=[417, 430, 441, 441, 830, 860, 1100, 1170, 1200],
                 verify_all=[245, 260, 270, 270, 500, 520, 660, 700, 720],
                 draft_token=58.0, draft_token_all=53.0, contention=1.19, overhead=5.0),
}


@dataclass
class Run:
    dataset: str
    index: int
    agree: list[int]  # L_i per output position (capped at 32: past SSD's 16-token serial speculations and SD's 20)
    confidence: list[float] | None = None  # the draft's top probability at each output position, as it decodes
    first_tokens: int = 0  # tokens of the first round (excluded from decode tok/s, as the bench does)
    notes: dict = field(default_factory=dict)


def agreement_runs(matches: list[bool], cap: int = 32) -> list[int]:
    """L_i: consecutive matches from position i (capped)."""
    runs, current = [0] * len(matches), 0
    for i in range(len(matches) - 1, -1, -1):
        current = current + 1 if matches[i] else 0
        runs[i] = min(current, cap)
    return runs


def record(args) -> int:
    from hf_ssd.bench import load_models
    from hf_ssd.bench.prompts import encode_prompt, load_prompt_sets

    target, draft, tokenizer, _ = load_models(args.target, args.draft, "fp32", args.draft_precision)
    sets = load_prompt_sets(args.prompts, args.skip + args.limit, args.prompts_dir)
    torch.set_num_threads(args.threads)
    out = []
    for prompt_set in sets:
        for index, text in list(enumerate(prompt_set.prompts))[args.skip:]:
            ids = encode_prompt(tokenizer, text)
            with torch.no_grad():
                generated = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                n = ids.shape[1]
                output = generated[0, n:]
                probs = _draft_predictions(draft, ids, output)
            confidence, predicted = probs.max(-1)
            matches = (predicted == output).tolist()
            out.append({"dataset": prompt_set.name, "index": index, "agree": agreement_runs(matches),
                        "confidence": [round(c, 4) for c in confidence.tolist()], "prompt_tokens": n})
            print(f"{prompt_set.name}[{index}]: {len(matches)} tokens, draft agrees on "
                  f"{sum(matches) / max(len(matches), 1):.2f}", file=sys.stderr)
    Path(args.out).write_text(json.dumps({"runs": out}))
    return 0


class NoisyCurve(list):
    """A profile's cost curve whose every read (one forward) is scaled by a lognormal factor of mean 1 and log
    standard deviation `sigma` (`--noise`): the timing noise of a shared 2-core machine, ±15-25 % a forward, which
    each method meets as it would. The policy's cost tables see it; a fixed schedule's choices do not."""

    def __init__(self, values: list[float], sigma: float, rng: random.Random):
        super().__init__(values)
        self.sigma, self.rng = sigma, rng

    def factor(self) -> float:
        return math.exp(self.rng.gauss(0.0, self.sigma) - self.sigma ** 2 / 2)


def noisy(profile: dict, sigma: float, seed: int = 0) -> dict:
    """`profile` with its verification curves read through `NoisyCurve` (one random stream for both)."""
    rng = random.Random(seed)
    return {**profile, **{key: NoisyCurve(profile[key], sigma, rng) for key in ("verify", "verify_all")}}


def _noiseless(profile: dict) -> dict:
    """`profile` with plain curves: what the oracle's and the rules' searches price (a bound, a fit), not a run."""
    return {**profile, **{key: list(profile[key]) for key in ("verify", "verify_all")}}


def _at(curve: list[float], k: int) -> float:
    """The profile's time at K = k; past its last point, on at the slope of its upper half (times a `NoisyCurve`'s
    factor, one draw a read)."""
    if k < len(curve):
        value = curve[k]
    else:
        middle = len(curve) // 2
        step = (curve[-1] - curve[middle]) / (len(curve) - 1 - middle) if len(curve) - 1 > middle else 0.0
        value = curve[-1] + max(step, 0.0) * (k - len(curve) + 1)
    return value * curve.factor() if isinstance(curve, NoisyCurve) else value


def _draft_predictions(draft, ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The draft's next-token distribution [len(output), V] at each output position, decoding one token at a time
    on its KV cache (see the module docstring)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=draft.config)
    rows = [draft(ids, past_key_values=cache, use_cache=True).logits[0, -1:].float()]
    for t in range(output.shape[0] - 1):
        rows.append(draft(output[None, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1:].float())
    return torch.cat(rows).softmax(-1)


def _stopped_length(stop, confidence: list[float], start: int, cap: int) -> int:
    """Tokens a just-in-time speculation from output position `start` drafts under `stop` (at most `cap`)."""
    cap = min(cap, len(confidence) - start)
    if stop is None or cap <= 0:
        return max(cap, 0)
    reach, rows = torch.ones(1), torch.tensor([True])
    for i in range(cap - 1):  # after the cap-th token there is nothing left to decide
        going, reach = stop.keeps_going(reach, torch.tensor([confidence[start + i]]), rows, i + 1)
        if not going:
            return i + 1
    return cap


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def replay_ssd(agree: list[int], profile: dict, k_max: int, hit_rate: float, serial: bool,
               memory=None, confidence: list[float] | None = None, serial_lookahead: int = 16
               ) -> tuple[float, float, list[int]]:
    """(decode tokens, decode seconds, K per round) of one prompt under the policy (the first round left out). With
    the draft's `confidence` per position the policy conditions on it, as `draft_confidence=True` runs it."""
    clock = _Clock()
    clocked = (lookahead_module, observations_module)  # the policy's modules that read the clock
    saved = [module.time for module in clocked]
    for module in clocked:
        module.time = clock
    try:
        shape = FLAT_SHAPE if profile.get("flat") else CPU_SHAPE
        policy = LookaheadPolicy(k_max, adaptive=True, acceptance_prior=0.75, concurrent=True, memory=memory,
                                 setting=("replay",), draft_key=1, serial=serial, cost_shape=shape,
                                 confidence=confidence is not None, serial_lookahead=serial_lookahead)
        verify, verify_all = profile["verify"], profile["verify_all"]
        t_token, t_token_all = profile["draft_token"] / 1e3, profile["draft_token_all"] / 1e3
        t_fixed_all = profile.get("draft_fixed_all", profile["draft_token_all"]) / 1e3
        timings = DraftTimings()
        pos, spec_len, n = 0, k_max, len(agree)
        decode_tokens, decode_seconds, first = 0, 0.0, True

        def held(length: int) -> torch.Tensor | None:  # the speculation's confidences, past the output: certain
            return None if confidence is None else torch.tensor(
                (confidence[pos:pos + length] + [1.0] * length)[:length], dtype=torch.float32)

        while pos < n:
            k = policy.choose(min(spec_len, max(n - pos - 1, 0)), confidence=[held(spec_len)])
            depth = policy.depth(k)
            accepted = min(agree[pos], k)
            tokens = torch.tensor([1 if j < agree[pos] else 2 for j in range(spec_len)], dtype=torch.long)
            scores = torch.zeros(1, k + 1, 3)
            scores[0, k, 1] = 1.0  # the target's token at position k: 1, so the draft's s_{k+1} matches iff L > k
            # (the recorded runs hold no runner-up: the replay prices none)
            row = SimpleNamespace(index=0, speculation=SimpleNamespace(tokens=tokens, probs=None,
                                                                       confidence=held(spec_len), runner_up=None))
            policy.observe_verification([row], SimpleNamespace(verified=k, accepted=[accepted], scores=scores,
                                                               runner_up=None))
            idle = depth == 0
            beside = _at(verify, k) * (profile["contention"] if k == 0 else 1.0)  # the target beside the working draft
            forward = (_at(verify_all, k) if idle else beside) / 1e3
            drafted = depth * t_token if depth else 0.0
            wall = max(forward, drafted) + profile["overhead"] / 1e3
            miss = 0.0
            if depth:  # a miss next round: the backup drafts the speculation just in time
                miss = (1 - hit_rate) * depth * t_token
                timings = replace(timings, prepare_calls=timings.prepare_calls + 1,
                                  prepare_seconds=timings.prepare_seconds + drafted,
                                  backup_calls=timings.backup_calls + 1,
                                  backup_seconds=timings.backup_seconds + depth * t_token)
            pos += accepted + 1
            just_in_time, stop = policy.just_in_time(max(n - pos - 1, 0))
            serial_len = _stopped_length(stop, confidence, pos, just_in_time) if (
                just_in_time and confidence is not None) else just_in_time
            serial_s = t_fixed_all + (serial_len - 1) * t_token_all if serial_len else 0.0
            if serial_len:
                timings = replace(timings, serial_calls=timings.serial_calls + 1,
                                  serial_seconds=timings.serial_seconds + serial_s,
                                  serial_tokens=timings.serial_tokens + serial_len,
                                  serial_steps=timings.serial_steps + serial_len - 1,
                                  serial_step_seconds=timings.serial_step_seconds + (serial_len - 1) * t_token_all)
            wall += miss + serial_s
            clock.now += wall
            policy.observe_round(forward, timings, hits=hit_rate if depth else 0, lookups=1 if depth else 0)
            if first:
                first = False
            else:
                decode_tokens += accepted + 1
                decode_seconds += wall
            spec_len = depth or serial_len
            steps = policy.plain_stretch() if pos < n else 0
            for _ in range(min(steps, n - pos)):  # plain steps in a row, the draft paused
                policy.plain_step()
                step = _at(verify_all, 0) / 1e3
                clock.now += step + profile["overhead"] / 1e3
                policy.observe_round(step, None, 0, 0)
                pos += 1
                decode_tokens += 1
                decode_seconds += step + profile["overhead"] / 1e3
            if steps:
                spec_len = 0
        policy.metrics()
        return decode_tokens, decode_seconds, [e["k"] for e in policy.trace]
    finally:
        for module, time_module in zip(clocked, saved):
            module.time = time_module


def _replay_sd_rounds(agree: list[int], profile: dict, drafted, fixed: float) -> tuple[float, float]:
    """(decode tokens, decode seconds) of assisted generation drafting `drafted(pos, most)` tokens each round (at
    most `most`), serially: the first token at `fixed` ms, each further one at the profile's `draft_token_all`."""
    pos, tokens, seconds, first = 0, 0, 0.0, True
    while pos < len(agree):
        k = drafted(pos, len(agree) - pos - 1)
        accepted = min(agree[pos], k)
        draft = (fixed + (k - 1) * profile["draft_token_all"]) if k else 0.0
        wall = (draft + _at(profile["verify_all"], k) + profile["overhead"]) / 1e3
        pos += accepted + 1
        if not first:
            tokens, seconds = tokens + accepted + 1, seconds + wall
        first = False
    return tokens, seconds


def replay_sd(agree: list[int], profile: dict, k: int) -> tuple[float, float]:
    """SD at a fixed K (transformers' constant schedule, no confidence threshold)."""
    return _replay_sd_rounds(agree, profile, lambda pos, most: min(k, most), profile["draft_token_all"])


def replay_oracle(agree: list[int], profile: dict, deepest: int = 16) -> tuple[float, float]:
    """(decode tokens, decode seconds) of the best serial schedule knowing every L_i in advance: each round drafts
    and verifies the depth (0..`deepest`, 0 a plain step) that makes the whole answer fastest (dynamic programming
    from its end). No policy can beat it with serial rounds; how far above SD at its best fixed K it lies is the
    room adaptive depth has on this cost curve (the first round left out, as everywhere here)."""
    n = len(agree)
    profile = _noiseless(profile)
    fixed = profile.get("draft_fixed_all", profile["draft_token_all"])

    def cost(depth: int) -> float:
        drafting = fixed + (depth - 1) * profile["draft_token_all"] if depth else 0.0
        return (_at(profile["verify_all"], depth) + drafting + profile["overhead"]) / 1e3

    best, after = [0.0] * (n + 1), [n] * (n + 1)  # seconds from output position i to the end; where its round ends
    for i in range(n - 1, -1, -1):
        best[i], after[i] = min((cost(d) + best[end], end) for d in range(deepest + 1)
                                for end in (min(i + min(agree[i], d) + 1, n),))
    start = after[0]  # the first round left out
    return n - start, best[start]


@dataclass(frozen=True)
class ConfidenceRule:
    """A fixed rule on the draft's confidence alone, serial rounds as SD's: draft the first token; below `first` it
    is not verified (a plain step that paid for one drafted token); else draft `base` tokens and on while the latest
    one's confidence is at least `sure` (up to 16), and verify the whole speculation when it ran `deep` tokens or more,
    `base` of it otherwise. What the draft's confidence can do without foresight: the policy's reference short of
    the oracle."""

    first: float
    base: int
    sure: float
    deep: int


RULES = [ConfidenceRule(first, base, sure, deep) for first in (0.0, 0.1, 0.2, 0.3, 0.4) for base in (1, 2, 3, 4)
         for sure in (0.5, 0.7, 0.8, 0.9, 0.95, 0.98) for deep in (3, 4, 5, 6, 8, 17)]


def replay_rule(agree: list[int], confidence: list[float], profile: dict, rule: ConfidenceRule, deepest: int = 16
                ) -> tuple[float, float]:
    """(decode tokens, decode seconds) of `rule` (the first round left out, as everywhere here)."""
    fixed = profile.get("draft_fixed_all", profile["draft_token_all"])
    pos, tokens, seconds, first, n = 0, 0, 0.0, True, len(agree)
    while pos < n:
        left = n - pos - 1
        if confidence[pos] < rule.first:
            drafted, k = min(1, left), 0
        else:
            drafted = min(rule.base, left)
            while drafted < min(deepest, left) and confidence[pos + drafted - 1] >= rule.sure:
                drafted += 1
            k = drafted if drafted >= rule.deep else min(drafted, rule.base)
        accepted = min(agree[pos], k)
        draft = fixed + (drafted - 1) * profile["draft_token_all"] if drafted else 0.0
        wall = (_at(profile["verify_all"], k) + draft + profile["overhead"]) / 1e3
        pos += accepted + 1
        if not first:
            tokens, seconds = tokens + accepted + 1, seconds + wall
        first = False
    return tokens, seconds


def fit_rule(runs: list[tuple[list[int], list[float]]], profile: dict, deepest: int = 16) -> ConfidenceRule:
    """The rule of `RULES` fastest over `runs` ((agreement runs, confidences) pairs), pooled."""
    def speed(rule: ConfidenceRule) -> float:
        totals = [replay_rule(agree, confidence, profile, rule, deepest) for agree, confidence in runs]
        return sum(t for t, _ in totals) / max(sum(s for _, s in totals), 1e-9)
    return max(RULES, key=speed)


def held_out_rules(runs: list[dict], profile: dict, max_new_tokens: int, deepest: int = 16
                   ) -> dict[int, ConfidenceRule]:
    """Per run with confidences (its position in `runs`): the rule fitted on the runs of the other prompt-index
    parity, so that each answer is replayed under a rule that never saw it (two folds)."""
    folds = {parity: [(r["agree"][:max_new_tokens], r["confidence"][:max_new_tokens]) for r in runs
                      if r["index"] % 2 != parity and r.get("confidence")] for parity in (0, 1)}
    fitted = {parity: fit_rule(pairs, _noiseless(profile), deepest) for parity, pairs in folds.items() if pairs}
    return {i: fitted[r["index"] % 2] for i, r in enumerate(runs) if r.get("confidence") and r["index"] % 2 in fitted}


def replay_sd_default(agree: list[int], confidence: list[float], profile: dict, threshold: float = 0.4,
                      most: int = 20) -> tuple[float, float]:
    """transformers' default assisted generation: the assistant drafts while its confidence is at least
    `threshold`, up to `most` tokens (the round's first token always)."""
    def drafted(pos: int, left: int) -> int:
        k = 0
        while k < min(most, left):
            k += 1
            if confidence[pos + k - 1] < threshold:
                break
        return k

    return _replay_sd_rounds(agree, profile, drafted, profile.get("draft_fixed_all", profile["draft_token_all"]))


def warm_up(run: dict, profile: dict, k_max: int, hit_rate: float, serial: bool, memory, tokens: int,
            confidence: list[float] | None = None, serial_lookahead: int = 16) -> None:
    """The bench's warm-up call before the measured ones (`BenchSettings.warmup_tokens` new tokens of the first
    prompt, SSD's run through the same `LookaheadMemory`): what the first measured call starts from. The first prompt's
    opening is often its hardest stretch (translation's first tokens), and the policy remembers it: on the real pair
    the measured call on translation's first prompt started at a_1 = 0.38 where a fresh policy assumes 0.75."""
    agree = run["agree"][:tokens]
    replay_ssd(agree, profile, k_max, hit_rate, serial, memory,
               None if confidence is None else confidence[:tokens], serial_lookahead)


def replay(args) -> int:
    runs = json.loads(Path(args.runs).read_text())["runs"]
    for assignment in args.set:  # a variant of the policy: one of its modules' constants changed
        name, value = assignment.split("=", 1)
        module = next((m for m in (lookahead_module, probing_module, confidence_module) if hasattr(m, name)), None)
        if module is None:
            raise SystemExit(f"--set {assignment}: hf_ssd.generation.lookahead, .probing and .confidence have no "
                             f"{name}")
        setattr(module, name, type(getattr(module, name))(value))
    profile = PROFILES[args.profile]
    if args.noise:
        profile = noisy(profile, args.noise, args.seed)
    memory = lookahead_module.LookaheadMemory() if args.memory else None
    if memory is not None and args.warm_up and runs:
        warm_up(runs[0], profile, args.lookahead, args.hit_rate, not args.no_serial, memory, args.warm_up,
                None if args.no_confidence else runs[0].get("confidence"), args.serial_lookahead)
    by_set: dict[str, dict[str, list[float]]] = {}
    rules = held_out_rules(runs, profile, args.max_new_tokens, args.serial_lookahead) if (
        args.rule and not args.no_confidence) else {}
    for number, run in enumerate(runs):
        agree = run["agree"][: args.max_new_tokens]
        plain = PROFILES[args.profile]["verify_all"][0] / 1e3 + profile["overhead"] / 1e3  # AR: the curve's mean
        rows = by_set.setdefault(run["dataset"], {})

        def add(method: str, tokens: float, seconds: float, rows=rows) -> None:
            total = rows.setdefault(method, [0.0, 0.0])
            total[0] += tokens
            total[1] += seconds

        n = max(len(agree) - 1, 0)
        add("ar", n, n * plain)
        confidence = None if args.no_confidence else run.get("confidence")
        confidence = None if confidence is None else confidence[: args.max_new_tokens]
        for k in args.sd:
            add(f"sd-k{k}", *replay_sd(agree, profile, k))
        if confidence is not None:
            add("sd-default", *replay_sd_default(agree, confidence, profile))
        t, s, ks = replay_ssd(agree, profile, args.lookahead, args.hit_rate, not args.no_serial, memory,
                              confidence, args.serial_lookahead)
        add("ssd", t, s)
        if number in rules:
            add("rule", *replay_rule(agree, confidence, profile, rules[number], args.serial_lookahead))
        add("oracle", *replay_oracle(agree, profile, args.serial_lookahead))
        if args.verbose:
            print(run["dataset"], run["index"], f"{(t / s if s else 0) / (1 / plain):.2f}x", ks)
    methods = ["ar", *[f"sd-k{k}" for k in args.sd], *(["sd-default"] if any(
        "sd-default" in rows for rows in by_set.values()) else []), "ssd", *(["rule"] if rules else []), "oracle"]
    if rules and args.verbose:
        for parity in (0, 1):
            fitted = next((rules[i] for i, r in enumerate(runs) if i in rules and r["index"] % 2 == parity), None)
            if fitted is not None:
                print(f"rule for prompts of index parity {parity} (fitted on the others): {fitted}")
    print("| set | " + " | ".join(f"{m}/AR" for m in methods[1:]) + " |")
    print("|---|" + "---|" * (len(methods) - 1))
    pooled = {m: [0.0, 0.0] for m in methods}
    for name, rows in by_set.items():
        ar = rows["ar"][0] / rows["ar"][1]
        cells = []
        for m in methods[1:]:
            cells.append(f"{rows[m][0] / rows[m][1] / ar:.2f}")
        for m in methods:
            pooled[m][0] += rows[m][0]
            pooled[m][1] += rows[m][1]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ar = pooled["ar"][0] / pooled["ar"][1]
    print("| **all** | " + " | ".join(f"{pooled[m][0] / pooled[m][1] / ar:.2f}" for m in methods[1:]) + " |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="generate greedy outputs and the draft's agreement runs")
    rec.add_argument("--prompts", default="humaneval,gsm8k,mt_bench,alpaca")
    rec.add_argument("--prompts-dir")
    rec.add_argument("--limit", type=int, default=8)
    rec.add_argument("--skip", type=int, default=2, help="leave out the first prompts (the bench's own)")
    rec.add_argument("--max-new-tokens", type=int, default=64)
    rec.add_argument("--target", default="qwen2.5-coder-1.5b")
    rec.add_argument("--draft", default="qwen2.5-coder-0.5b")
    rec.add_argument("--draft-precision", default="int8", choices=["fp32", "int8"])
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="drive the policy over recorded runs against a cost profile")
    rep.add_argument("runs")
    rep.add_argument("--profile", default="epyc", choices=sorted(PROFILES))
    rep.add_argument("--lookahead", "-K", type=int, default=4)
    rep.add_argument("--sd", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    rep.add_argument("--hit-rate", type=float, default=0.85)
    rep.add_argument("--max-new-tokens", type=int, default=64)
    rep.add_argument("--no-serial", action="store_true", help="no serial rounds (the draft on its own cores)")
    rep.add_argument("--no-confidence", action="store_true",
                     help="leave the recorded confidences out (the policy as draft_confidence=False runs it)")
    rep.add_argument("--serial-lookahead", type=int, default=16, help="SSDConfig.max_serial_lookahead")
    rep.add_argument("--memory", action="store_true", help="one LookaheadMemory across prompts (as a bench run)")
    rep.add_argument("--warm-up", type=int, default=8, metavar="TOKENS",
                     help="with --memory: the bench's warm-up call first (this many tokens of the first prompt; "
                          "0: none)")
    rep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="override a constant of hf_ssd.generation.lookahead, .probing or .confidence (e.g. "
                          "PROBE_EVERY=16)")
    rep.add_argument("--rule", action="store_true",
                     help="also replay the fastest fixed rule on the draft's confidence (`ConfidenceRule`), each "
                          "answer under the rule fitted on the answers of the other prompt-index parity")
    rep.add_argument("--noise", type=float, default=0.0, metavar="SIGMA",
                     help="scale every verification's time by a lognormal factor of mean 1 and this log standard "
                          "deviation (0.15: a shared 2-core machine's ±15 %%); the oracle and the rules' fit stay "
                          "noiseless")
    rep.add_argument("--seed", type=int, default=0, help="with --noise: the noise's random seed")
    rep.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
