"""How many draft tokens to verify each round: K = 0..K_max, chosen for the most expected tokens per second.

Every round the target verifies the first K of the K_max tokens the draft prepared (K = 0 is a plain target step:
one position, its token the bonus). The choice maximises E(K) / R(K), the speed model's tokens per round over its
round time, from what this run has measured:

* E(K) = 1 + Σ_{i<=K} Π_{j<=i} a_j, with a_j the acceptance of draft position j given the ones before were accepted,
  tracked with exponential forgetting so it follows the text (a code block after prose, a quoted passage). Every
  round also gives a free sample one position beyond what it verified when everything verified was accepted (the
  target's distribution there is known: it drew the bonus from it), so a K = 0 round still measures a_1, which is
  how the policy returns to speculation when the text becomes predictable.
* R(K) = the round's time (`costs.py`): the target's verification over K+1 positions, T_v(K), measured online per
  K at the current context and active rows (recent rounds weigh most; a batch's other row counts and earlier calls
  serve, rescaled, until measured); an unmeasured K >= 1 is guessed optimistically (as cheap as the
  measured K below it, or in proportion to positions from the one above), and the plain step (K = 0) is scaled
  by the prior shape `shape` (on a CPU one position is a matrix-vector product and several a matrix product: a
  jump of 2x, then +0.1 per position; on a GPU and with packed CPU kernels 1.02x + 0.02; over a batch's rows x
  (K+1) positions, and in proportion to positions past the knee where the forward turns compute-bound) until it
  is measured itself; next to it the draft's round T_d at the round's fan-out budget (`FanoutBudget`: they
  overlap unless the draft runs inline), the loop's measured overhead and, on a miss, the backup's time. A plain
  step runs on every core (the draft is paused), as plain decoding would.

An unmeasured K whose predicted speed comes within 10 % of the best is tried once (an unmeasured plain step in a
batch within 50 %: `EXPLORE_PLAIN_WITHIN`), so that the cost curve is
learnt where it matters: the curve's shape differs between machines (on one 2-core AMD EPYC, 2 positions cost
2.1x one; on a 2-core Intel Xeon with AVX-512, 3 positions cost 1.06x one and 5 positions 2x).

`depth` says how deep the draft prepares the next speculations: K_max while speculating
pays; on plain steps one token deep twice (the free sample of a_1), then not at all — the draft pauses, since on a
CPU its memory traffic slows the target's plain step — but for one-token probes, every `PROBE_EVERY` rounds at first
(further apart where a probe costs much of a plain step: a batch's) and more rarely while they find nothing
(`probing.py`); between probes the loop takes the plain steps in a row (`plain_stretch`). Returning from plain steps
to speculation asks for a larger promised gain than staying (`RESUME_MARGIN`); a call after calls that found the
draft useless starts with plain steps, the draft paused (`first_depth`). `lookahead_schedule="constant"` verifies
K_max every round.
"""

from __future__ import annotations

import time

from ..ema import DecayedMean
from .budget import FanoutBudget
from .confidence import LATER, ConfidenceCalibration
from .confident_rounds import ConfidentRounds
from .costs import CPU_SHAPE, RoundCosts
from .estimates import COST_DECAY, DECAY, AcceptanceTracker, LookaheadMemory, expected_tokens
from .modes import CONCURRENT, PLAIN, RESUME_MARGIN, SERIAL, SPECULATE_MARGIN, _best, _margin
from .observations import RoundObservations
from .plain_steps import PlainSteps
from .probing import Probing
from .runner_up import RunnerUpCalibration, RunnerUpRounds

EXPLORE_WITHIN = 0.9
# An unmeasured plain step in a batch is tried once when its guessed speed comes within this of the best: the prior
# curve is least reliable there (a batch's verification can turn compute-bound, where a plain step on every core
# gains from the second core what a verification beside the draft does not), and one plain step costs little.
EXPLORE_PLAIN_WITHIN = 0.5
# The draft's prefill and first speculations took at least this (seconds): the target's prefill is long enough that
# it is made on every core, the draft sitting the first round out (`LookaheadPolicy._prefill_alone`); below it the
# first round is concurrent (the prefill costs milliseconds: either way differs by less than the round's overhead)
PREFILL_ALONE_AFTER = 0.1
# Samples (decayed) of later tokens the pair's calibration holds before a serial speculation runs past K_max. With
# fewer, f(c) rests on its prior and on a call's opening rounds, which are accepted more often than the rest: on the
# real pair, cold calls on nine sets expected 76 tokens from their rounds verifying 3-16 tokens with under 12 such
# samples and got 44 (K = 16 rounds bringing 2-3 tokens on alpaca, gsm8k and qa); with 12 or more, 159 and got 161.
DEEP_AFTER = 12.0
RETIME_AFTER = 16  # rounds after which a close competitor's cost, not measured since, is timed again


def _timed(by_rows: dict[int, dict[int, DecayedMean]]) -> set[int]:
    """The K timed at any count of rows."""
    return {k for table in by_rows.values() for k in table}


class LookaheadPolicy(RoundObservations, ConfidentRounds, PlainSteps, RoundCosts, RunnerUpRounds):
    """Chooses each round's K from the run's own estimates (see the module docstring); records why."""

    def __init__(self, lookahead: int, adaptive: bool, acceptance_prior: float, concurrent: bool,
                 cost_shape: tuple[float, ...] = CPU_SHAPE, memory: LookaheadMemory | None = None,
                 setting: tuple = (), draft_key: int | None = None, serial: bool = False,
                 fanout: FanoutBudget | None = None, confidence: bool = False, serial_lookahead: int = 0,
                 every_core: float = 1.0, prefill_positions: int = 0, runner_up: str = "auto",
                 probed_gain: float | None = None, probed_curve: dict[int, float] | None = None):
        self.k_max, self.adaptive, self.concurrent = lookahead, adaptive, concurrent
        # how many times the cores of a step on every core (a plain step, a serial round) over the target's beside the
        # working draft: the most a step gains by the draft sitting out, for guessing an unmeasured one (b = 2 on
        # 2 cores: a serial K = 2 guessed at 800 ms from the one-thread verifications, measured 511, and not tried)
        self.every_core = max(every_core, 1.0)
        # ... as probed on the target's layers before the first round (`runtime.layer_probe.thread_gain`), within [1,
        # `every_core`]: what the concurrent mode is priced at until a verification beside the draft is timed
        self.probed_gain = None if probed_gain is None else min(max(probed_gain, 1.0), self.every_core)
        # a forward's cost per count of positions relative to one, as probed on the target's layers before the first
        # round (`runtime.layer_probe.cost_curve`): the shape an unmeasured K is priced by, in place of the prior's
        self.probed_curve = dict(probed_curve) if probed_curve else None
        self.fanout = fanout or FanoutBudget(1, adaptive=False, power=1.0, concurrent=concurrent)  # see `budget`
        self.serial_option = serial and concurrent and adaptive  # see `SERIAL` in the module docstring
        self.memory, self.setting, self.draft_key = memory, setting, draft_key
        if memory is not None and draft_key in memory.acceptance:
            acceptance_prior = memory.acceptance[draft_key]
        # f(c), the acceptance of a token given the draft's confidence in it (`confidence.py`): what decides this
        # round's K from the speculation in hand and where just-in-time drafting stops
        self.calibration = None
        known = memory is not None and draft_key is not None
        if confidence and adaptive:
            self.calibration = memory.calibration.setdefault(draft_key, ConfidenceCalibration()) if known else (
                ConfidenceCalibration())
        # this call's own samples, counted apart where the calibration is the pair's, pooled over earlier calls: how
        # far this call's text departs from theirs (`call_shift`)
        self.call_calibration = ConfidenceCalibration() if self.calibration is not None and known else None
        self._calibration_shift = 0.0  # the shift the tables were last read at (`calibrated_tables`)
        self._calibrated = None  # (what they were read from, the tables): `ConfidentRounds.calibrated_tables`
        # how deep a serial speculation may run: past K_max while confident (the stop rule ends it), as SD's
        # confident drafts do; what the draft prepares beside a verification stays K_max deep
        self.k_serial = max(lookahead, serial_lookahead) if self.calibration is not None else lookahead
        self.acceptance = AcceptanceTracker(self.k_serial + 1, acceptance_prior)
        self._confidence: list | None = None  # this round's per-row draft confidences ([n] tensors or None)
        self._rate: float | None = None  # the expected tokens per second of the way chosen at the last decision
        self._confident_speeds: dict[int, float] | None = None  # this round's speeds per K from its confidences
        self._serial_speed: float | None = None  # this round's serial speed as deep as confidence makes worth it
        self._active_rows = 1
        # per active rows (a forward's cost moves with the rows it covers): K -> DecayedMean of the target forward
        # seconds (K = 0: a plain step, on every core) and of a verification on every core while the draft sits it
        # out (K >= 1); `verify` / `serial_verify` are the active rows' tables
        self.verify_by_rows: dict[int, dict[int, DecayedMean]] = {}
        self.serial_verify_by_rows: dict[int, dict[int, DecayedMean]] = {}
        self.serial_token = DecayedMean(COST_DECAY)  # seconds per further token drafted just in time, on every core
        self.serial_fixed = DecayedMean(COST_DECAY)  # seconds of a serial speculation's fixed part and first token
        self.serial_length = DecayedMean(COST_DECAY)  # tokens a serial round drafts (fewer where it stops early)
        # what earlier calls with this draft measured a further just-in-time token at: the stop rule's price until this
        # call has measured its own (`stop_rule`)
        self.remembered_step = memory.serial_step.get((draft_key, setting)) if memory is not None else None
        self.backup_token = DecayedMean(COST_DECAY)  # seconds per token of the draft backup (beside the target)
        # what earlier calls with this draft measured its prepare at (`draft_seconds` until this call measures it)
        self.remembered_draft = memory.draft_round.get((draft_key, setting)) if memory is not None else None
        # the cost curve's prior shape, only until measured (see `shape`); no knee given: never compute-bound
        self.jump, self.slope, self.knee = (*cost_shape, float("inf"))[:3]
        self.draft = DecayedMean(COST_DECAY)  # seconds of one prepare (glue, fork, tree), at whatever depth and budget
        self.backup = DecayedMean(COST_DECAY)  # seconds of one just-in-time backup
        self.overhead = DecayedMean(COST_DECAY)  # round time not explained by the model
        self.plain_round = DecayedMean(COST_DECAY)  # seconds of a plain step's round with the draft paused
        self.probe_round = DecayedMean(COST_DECAY)  # ... with the draft one token deep beside it (a probe)
        self.hit_rate = DecayedMean(DECAY)
        self.trace: list[dict] = []
        self._round_start: float | None = None
        self._timings = None
        self._floor_for = None  # (table, the plain step's time guessed from it): `RoundCosts._plain_floor`
        self._rounds = 0
        self._timed_at: dict[tuple[bool, int], int] = {}  # (serial, K) -> the round its cost was last measured in
        self.probing = Probing()  # the pause/probe/trial state between plain steps (`probing.py`)
        self._exploring = False  # this round's K was chosen to time it
        self._why = ""  # why this round's K was chosen (the trace's "why"; `depth` and `plain_stretch` read it)
        self._wanted = lookahead  # the best K over 0..K_max at the last decision
        self._mode = CONCURRENT  # how the next speculation is made (CONCURRENT, SERIAL or PLAIN), see `depth`
        self.serial = 0  # tokens the draft drafts just in time after this round's verification (SERIAL rounds)
        self._plain_probe_cost = 0.0  # what a probe would add to a plain step, at the last plain depth decision
        self._starts_plain = False  # the call starts with plain steps (`first_depth`)
        # the first verification holds the target's prefill over these positions (rows x prompt length): where it is
        # compute-bound and long, it is made on every core, the draft sitting it out (`_prefill_alone`)
        self.prefill_positions = prefill_positions
        self.first_seconds = 0.0  # what the draft's prefill and first speculations took (`began`)
        self.first_forward = 0.0  # what the target's first forward (its prefill) took (`observe_round`)
        # the draft's runner-up for a first token, verified beside it where that pays (`runner_up.py`): how often it
        # is the target's choice, per target and draft across calls
        self.runner_up_mode = runner_up
        self.runner_ups = (memory.runner_ups.setdefault(draft_key, RunnerUpCalibration()) if known
                           else RunnerUpCalibration())
        self.runner_up_wins = 0

    @property
    def verify(self) -> dict[int, DecayedMean]:
        """K -> the target forward's seconds at the active rows, as measured in this call."""
        return self.verify_by_rows.setdefault(self._active_rows, {})

    @property
    def serial_verify(self) -> dict[int, DecayedMean]:
        """K >= 1 -> the seconds of a verification the draft sat out, at the active rows, as measured in this call."""
        return self.serial_verify_by_rows.setdefault(self._active_rows, {})

    # --- the decision ------------------------------------------------------------------------------------------
    def choose(self, limit: int, rows: int = 1, confidence: list | None = None) -> int:
        """K for this round of `rows` active rows, at most `limit` (what max_length leaves), given the draft's
        confidence in each row's tokens (`Speculation.confidence`, when known); starts the round's clock."""
        self._round_start = time.perf_counter()
        self._active_rows = rows
        self._confidence = confidence
        self._exploring = False
        k = self._choose(min(limit, self.serial_depth))
        self.trace[-1]["limit"] = limit
        if confidence and all(c is not None for c in confidence):
            self.trace[-1]["drafted"] = max(int(c.shape[0]) for c in confidence)  # the speculation in hand
        return k

    @property
    def serial_depth(self) -> int:
        """How deep this round's serial speculation may run: `k_serial` for a single active row, K_max in a batch.
        A batch of rows returns when its last row is done, and a deep speculation widens the rows' spread (one row
        takes 16 tokens, the next 2): the rows that finish early leave, and the last ones decode at a small batch's
        poor efficiency (measured, 8 rows of 48 tokens on 2 cores: depth 16 made 0.78-1.09x plain decoding, depth 4
        0.91-1.36x in the same runs). K_max too until the pair's calibration holds `DEEP_AFTER` samples of later
        tokens (`deep_known`)."""
        return self.k_serial if self._active_rows == 1 and self.deep_known() else self.k_max

    def deep_known(self) -> bool:
        """Whether the pair's calibration (`calibration`, pooled over calls) holds `DEEP_AFTER` samples (decayed) of
        a speculation's later tokens: what a speculation past K_max is priced by."""
        calibration = self.calibration
        return calibration is not None and sum(calibration.reached[LATER]) >= DEEP_AFTER

    def depth(self, k: int) -> int:
        """How many tokens deep the draft prepares the next speculations: K_max while speculating would pay (at any
        K, had this round's speculation been long enough); 0 in a serial round (the draft sits the verification out,
        then drafts `serial` tokens just in time); on plain steps what `Probing` says: 1 on the first ones (the
        free acceptance sample of a_1), then 0 — the draft pauses, so it does not compete with the target for the
        machine — but for one-token probes and trials, which are how the policy returns to speculation when the
        text becomes predictable. A plain step explored for its cost pauses the draft at once."""
        self.probing.decide()
        self.serial = 0
        if k == 0 and self._exploring and self._mode != SERIAL:
            depth = 0  # a plain step tried for its cost: timed with the draft paused
            self.probing.timed_plain_step()
        elif self._why == "trial":
            depth = self._drafted_after(self.k_max)  # probing's counters stay: a trial that fails goes back to them
        elif self._mode == SERIAL:  # the draft sits this verification out, then drafts the next speculation
            # (with its confidence known, as deep as it stays worth it: `stop_rule`; K_max at most while no
            # verification is timed, as past K_max only the prior shape would price it)
            depth, self.serial = 0, self.serial_depth if self.calibration is not None else self._wanted
            if self._why == "prior shape":
                self.serial = min(self.serial, self.k_max)
            self.probing.speculating()
        elif k > 0 or not self.adaptive or self._wanted > 0:
            depth = self.k_max
            self.probing.speculating()
        else:
            self._plain_probe_cost = self._probe_cost()
            depth = self._drafted_after(self.probing.plain_depth(self.k_max, self._plain_probe_cost))
            if self.trace:
                self.trace[-1]["probe_cost"] = round(self._plain_probe_cost, 3)  # in plain steps: spaces probes
        if self.trace:
            self.trace[-1]["depth"] = depth
            if self.serial:
                self.trace[-1]["serial"] = self.serial
        return depth

    def budget(self, depth: int, e_hit: float = 0.0, e_miss: float = 0.0) -> int:
        """The fan-out budget of the prepare `depth` asked for (`FanoutBudget`): decided on rounds that prepare the
        whole depth beside the verification, from this round's verification time at the K speculation wants, the
        backup's time, and tokens per round after a hit (`e_hit`) and a miss (`e_miss`; either 0: E(K) from the
        acceptance estimates); kept as it is otherwise."""
        rates = {}
        if depth == self.k_max and self._mode == CONCURRENT:
            k = self._wanted or self.k_max
            expected = expected_tokens(self.acceptance.estimates(), k)
            hit = self.hit_rate.value
            _, rates = self.fanout.choose(self.verify_seconds(k), self.backup.value or 0.0,
                                          self.overhead.value or 0.0, e_hit or expected, e_miss or expected,
                                          1.0 - hit if hit is not None else 0.0)
        if self.trace:
            self.trace[-1]["budget"] = self.fanout.current
            if rates:
                self.trace[-1]["budget_tok_s"] = {b: round(v, 2) for b, v in rates.items()}
        return self.fanout.current

    def _choose(self, limit: int) -> int:
        """The best K within `limit`; `_wanted` keeps the best K over 0..K_max (what the next speculation should
        allow, see `depth`) and `_mode` how to make it: concurrently (the draft works during this verification),
        serially (it drafts after it, on every core) or not at all (plain steps)."""
        self._mode = CONCURRENT
        self._confident_speeds = None
        self._serial_speed = None
        deep, limit = limit, min(limit, self.k_max)  # deeper only for a serial round's speculation in hand
        if not self.adaptive:
            self._record(limit, None, "constant")
            return limit
        acceptance = self.acceptance.estimates()
        table = self.times()  # once per decision: every K's cost derives from it
        serial_table = self.serial_times() if self.serial_option else {}
        speeds = {}
        for k in range(self.k_max + 1):
            seconds = self.round_seconds(k, table, serial_table)
            if seconds is not None and seconds > 0:
                speeds[k] = expected_tokens(acceptance, k) / seconds
        if self._rounds == 0:  # the first round holds the prefill and its speculation is the first sample: K_max
            self._wanted = self.k_max if not self._starts_plain else 0  # (or a plain step: `first_depth`)
            self._mode = PLAIN if self._starts_plain else SERIAL if self._prefill_alone() else CONCURRENT
            # the speed the next speculation's drafting is priced at (`stop_rule`), at the costs earlier calls timed:
            # unpriced, the first serial speculation ran K_max deep, and the next round verified two of its four
            now = self._serial_speeds(acceptance, table, serial_table) if self._mode == SERIAL else speeds
            self._rate = max(now.values(), default=None)
            self._record(limit, None, "first round")
            if self.probed_curve:
                self.trace[-1]["probed_cost_curve"] = {n: round(c, 3) for n, c in self.probed_curve.items()}
            return limit
        if not speeds:  # acceptance seen, no verification timed yet (the first held the prefill): the prior shape
            speeds = {k: expected_tokens(acceptance, k) / self.shape(k) for k in range(self.k_max + 1)}
            self._wanted = _best(speeds)
            choice = _best({k: v for k, v in speeds.items() if k <= limit})
            self._mode = CONCURRENT if self._wanted else PLAIN
            if self._wanted and self._serial_at_prior(self._wanted):
                self._mode = SERIAL
            self._record(choice, speeds, "prior shape")
            return choice
        serial_speeds = self._serial_speeds(acceptance, table, serial_table)
        margin = _margin(RESUME_MARGIN if self.trace and self.trace[-1]["k"] == 0 else SPECULATE_MARGIN,
                         acceptance, speeds, serial_speeds)
        self._wanted = _best(speeds, margin)
        self._mode = CONCURRENT if self._wanted else PLAIN
        if serial_speeds:
            best_serial = max(serial_speeds, key=serial_speeds.get)
            # serial rounds as deep as the draft's confidence makes worth it, not at the average acceptance
            self._serial_speed = self.confident_serial_speed(table, serial_table)
            serial_top = max(serial_speeds[best_serial], self._serial_speed or 0.0)
            if serial_top > speeds[self._wanted] and (0 not in speeds or serial_top >= margin * speeds[0]):
                self._wanted, self._mode = best_serial, SERIAL
        # this round: a K of the wanted kind (or a plain step) within what was prepared
        if self._mode == SERIAL:
            limit = deep
        now = serial_speeds if self._mode == SERIAL else speeds
        within = {k: v for k, v in now.items() if k <= limit}
        if 0 in speeds:
            within[0] = speeds[0]
        best = _best(within, margin) if within else 0
        now_speeds = serial_speeds if self._mode == SERIAL else speeds
        self._rate = now_speeds.get(self._wanted) or speeds.get(0)
        why = "best"
        if self._mode != PLAIN:
            best = self._confident(best, limit, within, margin, table, serial_table)
        elif self.serial_option and (sure := self._sure_hand(deep, speeds, margin, table, serial_table)):
            best, why = sure, "sure hand"
        if self.probing.take_trial():
            if best == 0 and limit > 0:
                self._mode = SERIAL if self.serial_option else CONCURRENT
                limit = min(limit, self.k_max)
                self._record(limit, speeds, "trial", serial_speeds)
                return limit
        # the best this round can do, the speculation in hand priced by its tokens' confidences included: exploring
        # a plain step drops that speculation (at each call's start a remembered plain step, timed again at once,
        # threw away four sure tokens where one rejected first round had pulled the average acceptance down)
        promised = [v for k, v in (self._confident_speeds or {}).items() if k > 0]
        top = max([*speeds.values(), *serial_speeds.values(), *promised])
        # never timed, or timed long ago: a cost not chosen since it was timed is never measured again, so a close
        # competitor of the best is timed again after `RETIME_AFTER` rounds. A K >= 1 remembered from earlier calls
        # (scaled to this call) counts as timed when the call starts: it is timed again only as it goes stale (the
        # curve's steps move with the context), not at once in every call — which spent 16 % of a nine-set bench's
        # rounds re-timing serial K = 1..4 in each call's first rounds. A remembered plain step is timed again at
        # once when close: one noisy plain step kept a useless draft's speculation going.
        def untimed(mode, mode_speeds, known, timed_now):
            chosen = (mode == SERIAL) == (self._mode == SERIAL)  # `best` is a K of this mode
            remembered = set(self.memory.times(self._setting(mode == SERIAL))) if self.memory is not None else set()

            def stale(k: int) -> bool:
                if k in timed_now:
                    last = self._timed_at.get((mode == SERIAL, k), self._rounds)
                elif k > 0 and k in remembered:
                    last = 0
                else:
                    return True
                return self._rounds - last > RETIME_AFTER

            def close(k: int, v: float) -> bool:
                plain_in_batch = k == 0 and mode == CONCURRENT and self._active_rows > 1 and k not in known
                if mode == CONCURRENT and self.concurrent_floor(k, known, serial_table) is not None:
                    return v >= top  # its cost a bound, not a guess: tried only where it might be best
                return v >= (EXPLORE_PLAIN_WITHIN if plain_in_batch else EXPLORE_WITHIN) * top

            # (past K_max a serial K is not explored: it is chosen from the draft's confidence, then timed)
            return [(v, k, mode) for k, v in mode_speeds.items() if k <= min(limit, self.k_max) and close(k, v) and (
                k not in known or (stale(k) and not (chosen and k == best)))]

        # (a K timed at other rows of this batch counts as timed: rows leave as they finish, and the costs follow
        # them by the prior curve, `RoundCosts._borrowed`, rather than being explored again at each count)
        unmeasured = untimed(CONCURRENT, speeds, table, _timed(self.verify_by_rows)) + untimed(
            SERIAL, serial_speeds, serial_table, _timed(self.serial_verify_by_rows))
        if unmeasured:
            _, choice, mode = max(unmeasured)
            self._exploring = True
            if mode == SERIAL:
                self._mode, self._wanted = SERIAL, max(self._wanted if self._mode == SERIAL else 0, choice)
            elif self._mode == SERIAL and choice > 0:  # a concurrent K timed: the draft works during it
                self._mode, self._wanted = CONCURRENT, self.k_max
            # (a plain step timed where serial rounds are best is one: the draft sits it out, then drafts the next
            # speculation; paused instead, the round after it had nothing to verify and was a plain step too, 290-400
            # ms for its one token with that drafting after it)
            self._record(choice, speeds, "explore", serial_speeds)
            return choice
        self._record(best, speeds, why, serial_speeds)
        return best

    def _serial_at_prior(self, k: int) -> bool:
        """Whether, with no verification timed in this call, a serial round of k tokens is the cheaper way to make
        the next speculation: the verification on every core then k tokens drafted, each at the draft's cost relative
        to the target's (their prefills' times: `first_seconds` over `first_forward`), against a concurrent round,
        whose verification on the target's own cores costs the probed gain (`probed_gain`) times the prior shape's.
        On a 2-core Xeon (Qwen2.5-Coder 1.5B fp32, 0.5B int8, gain probed at 1.9) the concurrent K = 4 this round
        took before cost 0.93-1.17 s, a serial K = 4 ~0.53 s and its four tokens ~0.18. Unprobed: concurrent."""
        if not self.serial_option or self.probed_gain is None or self.first_forward <= 0 or self.first_seconds <= 0:
            return False
        return self.shape(k) + k * self.first_seconds / self.first_forward < self.shape(k) * self.core_gain()

    def _serial_speeds(self, acceptance: list[float], table: dict[int, float], serial_table: dict[int, float]
                       ) -> dict[int, float]:
        """Tokens per second of a serial round of each K (at the run's average acceptance), where it is an option."""
        speeds = {}
        for k in range(1, self.serial_depth + 1) if self.serial_option else ():
            seconds = self.serial_round_seconds(k, table, serial_table)
            if seconds is not None and seconds > 0:
                speeds[k] = expected_tokens(acceptance, k) / seconds
        return speeds

    def began(self, seconds: float) -> None:
        """The draft's prefill and first speculations took `seconds` (on every core, before the first round)."""
        self.first_seconds = seconds

    def _prefill_alone(self) -> bool:
        """Whether the first round's verification, which holds the target's prefill, is made on every core with the
        draft sitting it out, the next speculation then drafted just in time (a serial round): where serial rounds
        are an option and the prefill is compute-bound (at least `knee` positions) and long (the draft's own prefill
        took `PREFILL_ALONE_AFTER` or more: the target's, larger, takes longer), so that the draft preparing beside it
        would take a core the prefill uses in full for longer than drafting K_max tokens after it takes. Measured on
        2 cores (Qwen2.5-Coder 1.5B / 0.5B int8): the first verification of a 52-token prompt took 1.05-1.09 s
        beside the draft preparing, 0.66-0.71 s with the draft sitting it out."""
        return (self.serial_option and self.prefill_positions >= self.knee
                and self.first_seconds >= PREFILL_ALONE_AFTER)

    def _record(self, k: int, speeds: dict | None, why: str, serial_speeds: dict | None = None) -> None:
        self._why = why
        entry = {"k": k, "why": why, "wanted": self._wanted, "mode": self._mode, "rows": self._active_rows,
                 "acceptance": [round(a, 3) for a in self.acceptance.estimates()]}
        if speeds:
            entry["tok_s"] = {n: round(v, 2) for n, v in speeds.items()}
            table = self.times()
            entry["verify_ms"] = {n: round(1e3 * (self.verify_seconds(n, table) or 0.0), 2) for n in speeds}
            entry["draft_ms"] = round(1e3 * (self.draft.value or 0.0), 2)
            entry["overhead_ms"] = round(1e3 * (self.overhead.value or 0.0), 2)
            entry["hit_rate"] = None if self.hit_rate.value is None else round(self.hit_rate.value, 3)
        if self._serial_speed is not None:
            entry["confident_serial_tok_s"] = round(self._serial_speed, 2)
        if self._confident_speeds:  # the hand priced in the way chosen; a sure hand declined was priced serially
            key = "sure_hand_tok_s" if self._mode == PLAIN else "confident_tok_s"
            entry[key] = {n: round(v, 2) for n, v in self._confident_speeds.items()}
        if serial_speeds:
            table, serial = self.times(), self.serial_times()
            entry["serial_tok_s"] = {n: round(v, 2) for n, v in serial_speeds.items()}
            entry["serial_verify_ms"] = {
                n: round(1e3 * (self.serial_verify_seconds(n, table, serial) or 0.0), 2) for n in serial_speeds}
            entry["serial_draft_ms_per_token"] = round(1e3 * (self.serial_step() or 0.0), 2)
            entry["serial_draft_ms_fixed"] = round(1e3 * (self.serial_fixed.value or 0.0), 2)
            entry["core_gain"] = round(self.core_gain(), 3)
        self.trace.append(entry)

    def metrics(self) -> dict:
        if self.memory is not None and self.draft_key is not None and self.acceptance.pooled_reached > 0:
            self.memory.acceptance[self.draft_key] = self.acceptance.pooled()
            reached = self.memory.acceptance_reached
            reached[self.draft_key] = reached.get(self.draft_key, 0.0) + self.acceptance.pooled_reached
        if self.memory is not None and self.plain_round.value and self.probe_round.value is not None:
            self.memory.probe_cost[(self.draft_key, self.setting)] = self._probe_cost()
        if self.memory is not None and self.serial_step() is not None:
            self.memory.serial_step[(self.draft_key, self.setting)] = self.serial_step()
        if self.memory is not None and self.draft.value is not None:
            self.memory.draft_round[(self.draft_key, self.setting)] = self.draft.value
        return {"lookahead_per_round": [entry["k"] for entry in self.trace],
                "fanout_budget_per_round": [entry.get("budget", self.fanout.current) if entry.get("depth", 1) else 0
                                            for entry in self.trace],
                "lookahead_decisions": self.trace,
                "runner_up_rounds": self.runner_up_rounds, "runner_up_accepted": self.runner_up_wins}

