"""The device check script runs end to end in its CPU tiny mode, so it cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny_on_cpu(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny", "--out",
         str(tmp_path), "--batch-sizes", "1,2", "--max-new-tokens", "8", "--compile-backend", "aot_eager",
         "--sd-lookaheads", "2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.md").read_text().startswith("# hf_ssd device check")
    assert report["skipped"] == [] and report["failed"] == []
    methods = {(r["method"], r["batch"], r["sampling"]) for r in report["results"]}
    for sampling in (False, True):
        for batch in (1, 2):
            assert {("ar", batch, sampling), ("ssd-thread", batch, sampling), ("ssd-stream", batch, sampling),
                    ("ssd-process", batch, sampling), ("ssd-stream-compiled", batch, sampling)} <= methods
        assert {("sd-k2", 1, sampling), ("sd-default", 1, sampling)} <= methods
    for r in report["results"]:
        assert r["tok_s"] > 0 and r["new_tokens"] == 8 * r["batch"]
        if not r["sampling"] and r["method"] != "ar":
            assert r["identical_rows"] == 1.0, r["key"]  # greedy: exactly AR's tokens
        if r["method"].startswith("ssd"):
            assert 0 <= r["target_idle"] <= 1 and r["rounds"] > 0 and r["target_phase_ms"]
            assert r["vs_ar"] is not None


def test_gpu_plain_rounds_tiny_on_cpu(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_plain_rounds.py"), "--device", "cpu", "--tiny", "--out",
         str(tmp_path), "--new-tokens", "8", "--batch-sizes", "1,2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "plain_rounds.json").read_text())
    assert {(r["name"], r["batch"]) for r in rows} == {(n, b) for n in ("ar", "ssd-thread", "ssd-stream")
                                                      for b in (1, 2)}
    for r in rows:
        assert r["tok_s"] > 0 and r["vs_ar"] > 0 and r["plain_forward_ms"] > 0
        if r["name"] != "ar":
            assert 0 <= r["plain_round_share"] <= 1 and r["phases_ms"]["target_forward"] > 0
    assert "ssd_decoding" in (tmp_path / "profile.txt").read_text()
