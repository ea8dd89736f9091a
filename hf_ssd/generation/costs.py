"""The lookahead policy's cost model: R(K), a round's time verifying K draft tokens, in each way a round can run
(concurrent with the draft, serial after it, a plain step), from the verification times the run measured per K
(and earlier calls on the same target remembered, `LookaheadMemory`), the draft's measured times and, until
measured, a prior shape of the verification cost curve. See `lookahead.py` for the decision built on it."""

from __future__ import annotations

import math
import statistics

from ..packing import PackedLinear
from .estimates import memory_key, non_decreasing

# Priors of the verification cost curve's shape (jump, slope, knee: see `LookaheadPolicy.shape`), only until
# measured. Measured on 2-core CPUs with MKL's fp32 kernels (Qwen 1.5B: 2 positions 2.0-2.3x one, each further one
# +0.05-0.1x); near flat on GPUs and with oneDNN's packed kernels (`packing.py`: 5 positions 0.66-1.0x one on a
# 2-core EPYC) until the forward turns compute-bound: from the knee on, cost grows in proportion to positions (the
# packed 1.5B target on one EPYC core: 9 positions cost 0.9x one, a batch of 8 rows verifying 5 each ~2.8x).
CPU_SHAPE, FLAT_SHAPE, GPU_SHAPE = (2.0, 0.1, 16.0), (1.02, 0.02, 16.0), (1.02, 0.02, 256.0)


def prior_cost_shape(model) -> tuple[float, float, float]:
    """The prior shape of `model`'s verification cost curve: flat on accelerators (up to hundreds of positions) and
    for packed CPU Linear layers (up to a dozen), MKL's jump from one position to several otherwise."""
    if model.device.type != "cpu":
        return GPU_SHAPE
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return FLAT_SHAPE
    return CPU_SHAPE


class RoundCosts:
    """R(K) and T_v(K) for `LookaheadPolicy` (a mixin: it reads the policy's measurements — `verify`,
    `serial_verify` (the active rows' tables of `verify_by_rows`, `serial_verify_by_rows`), `serial_token`,
    `serial_fixed`, `remembered_step`, `backup`, `draft`, `remembered_draft`, `overhead`, `hit_rate`, `fanout` — and
    its setting — `k_max`, `concurrent`, `memory`, `setting`, `_active_rows`, the prior shape `jump` / `slope` /
    `knee` and the probed one, `probed_curve`)."""

    def times(self) -> dict[int, float]:
        """T_v per K known now: this call's measurements over the remembered ones (scaled to this call), fitted
        non-decreasing in K >= 1 (`_monotone`) and never below the plain step's (`_floored`)."""
        return _floored(_monotone(self._remembered(), self.verify))

    def serial_times(self) -> dict[int, float]:
        """T_v per K >= 1 of verifications the draft sat out (on every core), as `times`."""
        return _floored(_monotone(self._remembered(serial=True), self.serial_verify), self.times().get(0))

    def serial_verify_seconds(self, k: int, table: dict[int, float], serial: dict[int, float]) -> float | None:
        """T_v(k) on every core with the draft idle: measured; else along the measured serial ones as
        `verify_seconds` guesses; with none measured yet, the plain step's time (also on every core; until measured,
        as `verify_seconds` guesses it) times the concurrent curve's rise from its smallest measured K (optimistic
        below it, so that it gets tried), or with no verification of several positions measured at all, the prior
        shape's rise from K = 1 (K = 1 at the plain step's time, so that the cheapest serial round is the one tried
        first). Never below the plain step: verifying draft tokens costs at least what a step without them does (a
        serial K = 4 timed at 475 ms guessed K = 1 at 190 ms beside a 242 ms plain step, and a useless draft's first
        call tried it)."""
        if k in serial:
            return serial[k]
        # (with nothing timed beside the draft the plain step is guessed from these very verifications, as dear as
        # the cheapest: no floor of theirs)
        plain = self._plain_floor(table) if table else None
        if serial:
            guess = self.verify_seconds(k, serial)
            return guess if guess is None or plain is None else max(guess, plain)
        if plain is None:
            return None
        several = sorted((n, t) for n, t in table.items() if n >= 1)
        if not several:  # (flat, a useless draft's first call tried K = 4: 2x a plain step's time for one token)
            return plain * self.shape(k) / self.shape(1)
        return plain * max(1.0, (self.verify_seconds(k, table) or 0.0) / several[0][1])

    def _plain_floor(self, table: dict[int, float]) -> float | None:
        """`verify_seconds(0, table)`, once per table: a decision prices up to 16 serial K against one table, and where
        no plain step was timed the guess walks the serial and concurrent tables again each time."""
        cached = self._floor_for
        if cached is None or cached[0] is not table:
            cached = self._floor_for = (table, self.verify_seconds(0, table))
        return cached[1]

    def serial_round_seconds(self, k: int, table: dict[int, float], serial: dict[int, float]) -> float | None:
        """R(k) of a serial round: the verification on every core, then k tokens drafted just in time (on every core
        or the draft's own threads, as `ThreadChoice` picks: `serial_drafting_seconds`; until this call measures a
        further token's cost, as earlier calls with this draft did: `remembered_step`, the price the stop rule also
        reads), and the loop's overhead."""
        verify = self.serial_verify_seconds(k, table, serial)
        if verify is None:
            return None
        return verify + self.serial_drafting_seconds(k, self.remembered_step) + max(self.overhead.value or 0.0, 0.0)

    def serial_step(self) -> float | None:
        """Seconds per further token of a serial speculation: as measured, never above the fixed part (a forward of
        the committed tokens and the first one, and more). A step is measured only where a speculation runs two
        tokens or more, so a slow first measurement (the call's first drafts) would otherwise stand for as long as
        it keeps the speculations one token deep; the fixed part is measured every serial round."""
        step, fixed = self.serial_token.value, self.serial_fixed.value
        return step if step is None or fixed is None else min(step, fixed)

    def serial_drafting_seconds(self, n: float, unmeasured_step: float | None = None) -> float:
        """A serial speculation of n tokens drafted just in time: its fixed cost (the committed tokens fed with the
        first token's forward, the cache's compaction, the bookkeeping) and a step per further token, as measured
        (the step, until measured, `unmeasured_step` where given: what earlier calls measured it at); until then, per
        token as measured on average, else as a backup's or a tree step's."""
        step = self.serial_step()
        if step is None:
            step = unmeasured_step
        fixed = self.serial_fixed.value
        if step is None or fixed is None:
            per_token = step or fixed
            if per_token is None:
                per_token = (self.backup.value / self.k_max if self.backup.value is not None
                             else (self.draft.value or 0.0) / (self.k_max + 1))
            return n * per_token
        return fixed + max(n - 1.0, 0.0) * step

    def verify_seconds(self, k: int, measured: dict[int, float] | None = None) -> float | None:
        """T_v(k): measured (in this call, or in earlier ones on this target: `LookaheadMemory`, scaled to this
        call), else an optimistic guess that gets it tried (see `_choose`: an unmeasured K that might be best is
        explored once, then its measurement decides).

        An unmeasured K >= 1 costs what the largest measured K below it costs (the curve's lower bound if it rises;
        on CPUs it rises in steps — 1-3 positions cost the same with AVX-512, 4-5 twice that — and is not even
        monotone with oneDNN, so nothing between measured points is assumed dearer than its lower neighbour; the
        measured ones are fitted non-decreasing first, `_monotone`); past
        K_max, where no K is explored, it rises from there by the prior shape `shape`); with
        none measured below it, the nearest measured one above scaled down in proportion to positions. The plain
        step (K = 0), until measured while the draft is paused: the most optimistic of the measured ones (concurrent,
        divided by `core_gain`, what a step on every core gains over one beside the draft; or serial: like a plain
        step, on every core) scaled by the prior shape."""
        measured = self.times() if measured is None else measured
        if not measured:  # nothing timed beside the draft (as where the probed gain priced that mode out)
            serial = self.serial_times() if k == 0 else {}
            # a plain step from the serial verifications alone: as dear as the cheapest (1 to 3 positions cost one
            # price with AVX-512; the prior shape's jump guessed 170 ms beside 356 ms serial rounds, and calls then
            # started with plain steps)
            return min(serial.values()) if serial else None
        if k in measured:
            return measured[k]
        if k == 0:  # a serial verification runs on every core with the draft idle, as a plain step does; one beside
            # the draft on the target's share of them: the step speeds up with the cores as far as measured
            # (`core_gain`), at best in proportion to them (`every_core`)
            gain = self.core_gain()
            known = [(n, t / gain) for n, t in measured.items()] + list(self.serial_times().items())
            return min(t * self.shape(0) / self.shape(n) for n, t in known)
        several = sorted((n, t) for n, t in measured.items() if n >= 1)  # verifications of several positions
        if not several:
            return measured[0] * self.shape(k)
        below = [(n, t) for n, t in several if n < k]
        if self.probed_curve:  # the nearest measured K times the probed rise, never above a measured K above it
            n, t = below[-1] if below else several[0]
            guess = t * self.shape(k) / self.shape(n)
            above = [u for m, u in several if m > k]
            return min(guess, above[0]) if above and below else guess
        if below:
            n, t = below[-1]
            # past K_max (a serial speculation verified deeper: never explored) the prior shape's rise on top
            return t * self.shape(k) / self.shape(n) if k > self.k_max else t
        n, t = several[0]
        return t * (k + 1) / (n + 1)

    def core_gain(self) -> float:
        """How many times faster the target verifies on every core, the draft idle (a serial round's verification),
        than on its own cores beside the working draft (a concurrent one): the median ratio over the (rows, K >= 1)
        timed both ways, this call's own where it has any, else earlier calls' (`LookaheadMemory`), within [1,
        `every_core`]; until then the gain probed on the target's own layers before the first round
        (`probed_gain`, `runtime.layer_probe.thread_gain`), else `every_core`, the bound (cores in proportion). What a
        plain step, on every core, is guessed at before it is timed (`verify_seconds`): on a 2-core EPYC with MKL's
        kernels the second core gains the target nothing (a serial K = 4 in 692 ms, a concurrent one in 733), and
        the bound, 2x, guessed a 2-row plain step at 327 ms that took 684: two rounds of a 48-token batch spent on
        plain steps and a serial K = 1 tried beside concurrent K = 4 rounds that brought five tokens a row."""
        known = self.known_core_gain()
        return self.every_core if known is None else known

    def known_core_gain(self) -> float | None:
        """`core_gain` as measured, else as probed; None where neither is known (the bound is not knowledge)."""
        measured = self.measured_core_gain()
        return self.probed_gain if measured is None else measured

    def measured_core_gain(self) -> float | None:
        """`core_gain` as measured (this call's timings, else earlier calls'); None before any K was timed both
        ways."""
        sources = [(_values(self.verify_by_rows), _values(self.serial_verify_by_rows))]
        if self.memory is not None:
            sources.append((self.memory.by_rows(self.setting), self.memory.by_rows(self.setting, serial=True)))
        for beside, alone in sources:
            ratios = [beside[rows][k] / t for rows, serial in alone.items() for k, t in serial.items()
                      if k >= 1 and t > 0 and k in beside.get(rows, {})]
            if ratios:
                return min(max(statistics.median(ratios), 1.0), self.every_core)
        return None

    def _remembered(self, serial: bool = False) -> dict[int, float]:
        """Times known beside this call's own at the active rows: earlier calls' in this setting (`LookaheadMemory`),
        else this call's at the nearest other count of rows (`_borrowed`); scaled by this call's measured / known
        ratio where both exist (as known when nothing overlaps yet)."""
        times = self.memory.times(self._setting(serial)) if self.memory is not None else {}
        if not times:
            times = self._borrowed(serial)
        own = self.serial_verify if serial else self.verify
        ratios = [e.value / times[n] for n, e in own.items() if n in times and times[n] > 0 and e.value is not None]
        scale = sum(ratios) / len(ratios) if ratios else 1.0
        return {n: t * scale for n, t in times.items()}

    def _borrowed(self, serial: bool = False) -> dict[int, float]:
        """The times at the nearest other count of rows (this call's first, then earlier calls'), rescaled to the
        active rows by the prior `positions_cost` (rows x (K + 1) positions against r x (K + 1)). A batch's rows
        leave as they finish: the 8-row costs taken as they were for the last row made its verifications look 3x
        dearer than they were (1.5 s against 0.5 s) and kept its speculation one token deep."""
        rows = max(self._active_rows, 1)
        tables = self.serial_verify_by_rows if serial else self.verify_by_rows
        known = [(r, 0, t) for r, t in _values(tables).items()]
        if self.memory is not None:
            known += [(r, 1, t) for r, t in self.memory.by_rows(self.setting, serial).items()]
        known = [(r, source, t) for r, source, t in known if r != rows and t]
        if not known:
            return {}
        r, _, table = min(known, key=lambda item: (abs(math.log(item[0] / rows)), item[1], item[0]))
        return {k: t * self.positions_cost(rows * (k + 1)) / self.positions_cost(r * (k + 1))
                for k, t in table.items()}

    def _setting(self, serial: bool = False) -> tuple:
        return memory_key(self.setting, self._active_rows, serial)

    def shape(self, k: int) -> float:
        """The prior cost curve T_v(k) / T_v(0) at the active rows: the forward's cost over its rows * (k + 1)
        positions relative to a plain step's over its rows (`positions_cost`)."""
        rows = max(self._active_rows, 1)
        return self.positions_cost(rows * (k + 1)) / self.positions_cost(rows)

    def positions_cost(self, n: int) -> float:
        """A forward over `n` positions relative to one: as probed on the target's layers before the first round
        (`probed_curve`, `runtime.layer_probe.cost_curve`: linear between the probed counts, past the largest rising
        from it as the prior does), else the prior (`prior_positions_cost`)."""
        curve = self.probed_curve
        if n <= 1 or not curve:
            return self.prior_positions_cost(n)
        if n in curve:
            return curve[n]
        below = max(m for m in curve if m < n)
        above = [m for m in curve if m > n]
        if not above:
            return curve[below] * self.prior_positions_cost(n) / self.prior_positions_cost(below)
        high = min(above)
        return curve[below] + (curve[high] - curve[below]) * (n - below) / (high - below)

    def prior_positions_cost(self, n: int) -> float:
        """The prior `positions_cost`: one position is a plain step (on a CPU a matrix-vector product, several a matrix
        product, which costs twice as much per weight read: `jump`), then `slope` per extra position; from `knee`
        positions on at least in proportion to positions (compute-bound)."""
        return 1.0 if n <= 1 else max(self.jump + self.slope * (n - 2), n / self.knee)

    def round_seconds(self, k: int, measured: dict[int, float] | None = None,
                      serial: dict[int, float] | None = None) -> float | None:
        """R(k): the verification, beside (or after) the draft's round, the loop's overhead and the expected backup
        time of a miss; a plain step has neither draft work nor lookups (the draft pauses when plain steps win).
        An unmeasured verification beside the draft costs at least the same one measured with the draft idle on
        every core (`serial`, `concurrent_floor`) times the gain of every core over the target's own: as measured, else
        as probed (`probed_gain`). With none beside the draft timed yet, that is its guess: the serial ones, timed in
        earlier calls, price the concurrent mode before it is tried. Unpriced (the gain unknown), a second call on a
        2-core Xeon fell back to the prior shape and tried the concurrent mode again, a plain step beside the draft in
        590 ms and a K = 4 in 1082 ms (a serial K = 4 takes 607), where the first call had timed it at 1088 ms."""
        measured = self.times() if measured is None else measured
        verify = self.verify_seconds(k, measured)
        floor = self.concurrent_floor(k, measured, serial)
        if floor is not None:  # the gain the cores were measured (else probed) to bring; 1 where neither is known
            floor *= self.known_core_gain() or 1.0
            verify = floor if verify is None else max(verify, floor)  # (none beside the draft timed yet: the floor)
        if verify is None:
            return None
        if k == 0:
            return verify + max(self.overhead.value or 0.0, 0.0)
        draft = self.draft_seconds()
        body = max(verify, draft) if self.concurrent else verify + draft
        miss = (1 - (self.hit_rate.value if self.hit_rate.value is not None else 1.0)) * (self.backup.value or 0.0)
        return body + max(self.overhead.value or 0.0, 0.0) + miss

    def concurrent_floor(self, k: int, measured: dict[int, float], serial: dict[int, float] | None) -> float | None:
        """A lower bound of an unmeasured verification of k >= 1 tokens beside the working draft: a serial round's
        (on every core, the draft idle) of k tokens or fewer, which it can only match with the draft competing for
        the machine (on 2 cores one target thread took 527 ms where two took 275); None where none is timed or k is
        measured. `round_seconds` raises it by the gain the cores were measured to bring (`measured_core_gain`):
        guessed as cheap as the concurrent K below it instead, a 4-token verification beside the draft was tried at
        long contexts (rag on a 2-core Xeon: serial K = 4 timed at 468 ms, a concurrent K = 2 at 487, a gain of
        1.87) and took 910 ms for three tokens, once in each call."""
        below = [(n, t) for n, t in (serial or {}).items() if 1 <= n <= k]
        if k < 1 or k in measured or not below:
            return None
        if self.probed_curve:  # each raised to k's positions along the probed shape (a serial K = 2 at 268 ms priced
            # a concurrent K = 4 at 1.9 x 268 ms; it took 892 where a serial K = 4 takes 475)
            return max(t * self.shape(k) / self.shape(n) for n, t in below)
        return max(t for _, t in below)

    def draft_seconds(self) -> float:
        """T_d: the draft's full-depth round at the fan-out budget in use, as measured (any round's until then; before
        this call measures one, as earlier calls with this draft did: `remembered_draft`). Priced at 0 instead, a
        call deciding whether to start with plain steps (`first_depth`) on a target whose verification costs about
        what a plain step does saw no cost in speculating, and a useless draft's calls never started paused."""
        at_budget = self.fanout.draft.get(self.fanout.current)
        if at_budget is not None:
            return at_budget
        return self.draft.value if self.draft.value is not None else self.remembered_draft or 0.0


def probed_positions(lookahead: int, serial_lookahead: int = 0) -> tuple[int, ...]:
    """The positions a verification's cost is probed at (`runtime.layer_probe.cost_curve`): every count up to K_max +
    1 (at most 8: the curve's steps there decide K), then ~1.5x apart up to the deepest serial speculation's + 1."""
    dense = min(lookahead + 1, 8)
    sizes, deepest = list(range(1, dense + 1)), max(lookahead, serial_lookahead) + 1
    while sizes[-1] < deepest:
        sizes.append(min(deepest, -(-sizes[-1] * 3 // 2)))
    return tuple(sizes)


def position_slope(times: dict[int, float]) -> float:
    """Seconds per further verified position: the median of the slopes of T_v between every two measured K
    (Theil-Sen; at least 0, and 0 with fewer than two K). The end-to-end slope moved with one outlying end timing
    (and with it where just-in-time drafting stops); the median of pairwise slopes does not."""
    points = sorted(times.items())
    slopes = [(t1 - t0) / (k1 - k0) for i, (k0, t0) in enumerate(points) for k1, t1 in points[i + 1:]]
    return max(0.0, statistics.median(slopes)) if slopes else 0.0


def position_costs(times: dict[int, float], n: int) -> list[float]:
    """Seconds a verification of k + 1 draft tokens takes over one of k, for k = 1..n: the curve's own step where both
    K are timed, else the robust slope (`position_slope`). The curve need not be a line: a packed target's is flat,
    then jumps where its kernels change (one 2-core Xeon: 1-3 positions 240-250 ms, 4 positions 450 ms); priced at
    the average slope, a second drafted token looked as dear as the jump and speculations stayed one token deep
    where SD's K = 2 verified three positions for the price of one."""
    measured = {k: t for k, t in times.items() if k >= 1}
    slope = position_slope(measured)
    return [max(0.0, measured[k + 1] - measured[k]) if k in measured and k + 1 in measured else slope
            for k in range(1, n + 1)]


def _floored(times: dict[int, float], plain: float | None = None) -> dict[int, float]:
    """`times` with every K >= 1 at least the plain step's time (`plain`, default `times[0]`, when known): a
    verification scores the plain step's position and more, on no more cores. Timed apart, noise can say otherwise
    (measured: a useless draft's serial K = 1 at 362 ms against a 385 ms plain step, a 2-position forward of a
    packed target costing about one), and the policy then verified a token that was never accepted for 20 rounds."""
    plain = times.get(0) if plain is None else plain
    if plain is None:
        return times
    return {k: t if k == 0 else max(t, plain) for k, t in times.items()}


def _values(by_rows: dict[int, dict[int, object]]) -> dict[int, dict[int, float]]:
    """Per count of rows, the K -> seconds of the `DecayedMean`s that hold a value."""
    return {r: {k: e.value for k, e in t.items() if e.value is not None} for r, t in by_rows.items()}


def _monotone(remembered: dict[int, float], measured: dict) -> dict[int, float]:
    """T_v per K: `measured` (K -> `DecayedMean`) over `remembered`, the K >= 1 ones replaced by their weighted
    non-decreasing fit (each measured K weighs the samples its mean holds, a remembered one as one sample).

    A single verification's time is noisy (±15-25 % on a shared 2-core machine, more than the curve rises between
    neighbouring K), and each K is timed only when chosen: per-K means alone made a deeper K look cheaper than a
    shallower one by chance, and the choice of K followed the noise. A verification over more positions never has
    to cost less (where one truly does, pooling costs nothing: the deeper K then wins on tokens either way), so
    neighbours that disagree are pooled. The plain step (K = 0) stands apart: one position is a different kernel."""
    times = dict(remembered)
    weights = {n: 1.0 for n in remembered}
    for n, ema in measured.items():
        if ema.value is not None:
            times[n], weights[n] = ema.value, max(ema.weight, 1.0)
    several = sorted(n for n in times if n >= 1)
    if len(several) > 1:
        fitted = non_decreasing([times[n] for n in several], [weights[n] for n in several])
        times.update(zip(several, fitted))
    return times
