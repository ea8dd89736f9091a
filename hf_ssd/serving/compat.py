"""What `hf-ssd serve` needs from transformers' serving code, checked once, with an error that names the fix.

The server reuses `transformers.cli.serving` (the code behind `transformers serve`) and hooks into it at the
seams listed in `SEAMS`. They exist in transformers 5.23 and 5.24; a release that moved one of them fails here,
naming what is missing and the versions that work, instead of deep inside a request.
"""

from __future__ import annotations

import importlib
import importlib.util

TESTED = "5.23 and 5.24"
INSTALL = "pip install 'hf-ssd[serving]'  (transformers[serving] and prometheus-client)"

# module (under transformers.cli.serving) -> attribute paths used by hf_ssd.serving
SEAMS = {
    "utils": (
        "GenerateManager.generate_streaming",
        "GenerateManager.generate_non_streaming",
        "GenerationState.get_manager",
        "BaseHandler._build_generation_config",
        "BaseHandler._valid_params_class",
        "_GenerationCancelled",
    ),
    "chat_completion": ("ChatCompletionHandler", "TransformersCompletionCreateParamsStreaming"),
    "completion": ("CompletionHandler",),
    "response": ("ResponseHandler",),
    "transcription": ("TranscriptionHandler",),
    "systemone": ("SystemOneHandler",),
    "model_manager": ("ModelManager.load_model_and_processor", "ModelManager._load_model",
                      "ModelManager._load_processor", "ModelManager.process_model_name"),
    "server": ("build_server",),
}


class ServingUnavailable(RuntimeError):
    """`hf-ssd serve` cannot run here: a dependency is missing or transformers' serving code is laid out
    differently from the releases it was built against."""


def missing_packages() -> list[str]:
    """The serving dependencies that are not installed (import names)."""
    needed = ("fastapi", "uvicorn", "openai", "pydantic", "prometheus_client")
    return [name for name in needed if importlib.util.find_spec(name) is None]


def require_serving() -> None:
    """Raise `ServingUnavailable` unless the serving dependencies are installed and every seam is where
    `hf_ssd.serving` expects it."""
    missing = missing_packages()
    if missing:
        raise ServingUnavailable(f"hf-ssd serve needs {', '.join(missing)}: {INSTALL}")
    import transformers

    version = transformers.__version__
    absent = []
    for module_name, paths in SEAMS.items():
        try:
            module = importlib.import_module(f"transformers.cli.serving.{module_name}")
        except ImportError as error:
            absent.append(f"transformers.cli.serving.{module_name} ({error})")
            continue
        for path in paths:
            target = module
            for part in path.split("."):
                if not hasattr(target, part):
                    absent.append(f"transformers.cli.serving.{module_name}.{path}")
                    break
                target = getattr(target, part)
    if absent:
        raise ServingUnavailable(
            f"hf-ssd serve hooks into transformers' serving code as laid out in transformers {TESTED}; "
            f"transformers {version} lacks: {'; '.join(absent)}. Install a supported release, e.g. "
            "pip install 'transformers[serving]==5.24.*'."
        )
