"""`hf-ssd bench`: plain decoding (AR), transformers' assisted generation (SD) and SSD on prompt sets, one process.

One run measures every method on the same model pair, prompts and machine state, interleaved per prompt (the
method order rotates from prompt to prompt, so slow drift of a shared machine hits all methods alike):

- ``ar``       ``target.generate(ids)``
- ``sd``       ``target.generate(ids, assistant_model=draft)`` with ``num_assistant_tokens=K``, the constant
               schedule and confidence threshold 0 (transformers' own assisted generation: the SD baseline)
- ``ssd``      ``target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(lookahead=K, fanout_budget=B,
               executor=E, draft_threads=d, target_threads=t))``, E from ``--executor`` (default "auto", whose
               worker process is started during the warm-up)
- ``ssd-sync`` the same with ``executor="sync"`` (draft work inline, no overlap; optional)

Timing (stated in every output): one ``generate()`` call per prompt, method and repeat; a streamer records when
each emission arrives. ``decode tok/s`` excludes prefill via the time to the first emission:
(new tokens − tokens of the first emission) / (end − time of the first emission). The first emission is the
first token for AR and the whole first round for SD/SSD (prefills plus one speculation; accepted + bonus).
``e2e tok/s`` = new tokens / whole call. Totals are total tokens / total time over prompts (and repeats), with
the spread of the per-repeat totals (and of the per-prompt figures). The same streamer gives per-round emitted
tokens (accepted + bonus) for SD and SSD.

Hardware framing (``--framing``): SSD runs the draft on its own thread(s) or process, so it uses more cores than
AR and SD.
- ``extra-cores``: SSD (draft d + target t threads) against AR and SD with t threads — the paper's setting,
  where the draft gets an extra GPU;
- ``equal-cores``: SSD (d + t) against AR and SD with d + t threads — the same total compute.

Exactness: every greedy output is compared token by token with AR's (the AR run whose thread count equals the
SSD target's, when measured; fp32 reductions can differ between thread counts).

Predicted vs measured: `measure_latencies` times small direct forwards (target over 1 and K+1 tokens, a draft
token, a real SSD draft round of B branches); with the run's own hit rate and acceptance they feed
`hf_ssd.speed_model.predict`, next to the measured figures (`explain_gap` where they differ by more than 10%),
and `predict_h100` gives the paper's H100 setting as a labelled PREDICTION.
"""

from __future__ import annotations

from .aggregate import (  # noqa: F401
    aggregate_acceptance,
    aggregate_ssd_metrics,
    comparisons,
    decode_window,
    fit_power_law,
    round_statistics,
    ssd_decode_window,
    summarise,
    summarise_method,
)
from .command import add_arguments, load_models, print_report, run_command  # noqa: F401
from .common import (  # noqa: F401
    ALL,
    DATASETS,
    DECODE_TIMING,
    FRAMING_TEXT,
    FRAMINGS,
    HUMANEVAL_INSTRUCTION,
    HUMANEVAL_PACKAGE,
    METHOD_KINDS,
    SCHEMA,
)
from .measure import (  # noqa: F401
    BenchSettings,
    ForwardTimer,
    MethodSpec,
    RoundRecorder,
    RunRecord,
    build_methods,
    first_divergence,
    forward_timing,
    generate_once,
    reference_method,
)
from .predict import h100_predictions, latencies_for_model, measure_latencies, predictions, statistics_for_model  # noqa: F401
from .prompts import (  # noqa: F401
    PromptSet,
    encode_prompt,
    load_humaneval_package,
    load_prompt_sets,
    prompt_dirs,
    read_jsonl_prompts,
    resolve_prompt_file,
)
from .report import (  # noqa: F401
    comparison_table,
    gap_lines,
    h100_lines,
    latency_lines,
    method_table,
    prediction_table,
    prompt_table,
    render_markdown,
    window_table,
)
from .run import cpu_model, environment, model_info, recompute, render, run_bench, write_results  # noqa: F401
