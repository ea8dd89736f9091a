"""The documentation site builds strictly: a broken link, a missing page or a stale API name fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text()
    for name in ("SSDConfig", "lookahead_schedule", "compile_draft", "place_models", "SSDMetrics"):
        assert name in reference, name  # generated from the code
