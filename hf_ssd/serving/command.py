"""`hf-ssd serve`: the command line. Declaring the options imports nothing heavy (`--help` works without the
serving extra); every value is checked before a model loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from typing import Any

from ..config import SSDConfig

SSD_GROUP = "SSD configuration (the server's SSDConfig; a request may override fields with extra_body="\
    "{'ssd_config': {...}})"


def _value(text: str) -> Any:
    """A command-line value as JSON when it parses (3, 0.5, true, [4,2,1,1]), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _field_help() -> dict[str, str]:
    """Each SSDConfig field's description, the first sentence of its entry in the class docstring's Args."""
    described: dict[str, str] = {}
    name = None
    for line in (SSDConfig.__doc__ or "").split("Args:", 1)[-1].splitlines():
        match = re.match(r"\s{8}(\w+): (.*)", line)
        if match:
            name, text = match.groups()
            described[name] = text
        elif name and line.startswith(" " * 12):
            described[name] += " " + line.strip()
    return {key: _first_sentence(text) for key, text in described.items()}


def _first_sentence(text: str) -> str:
    """Up to the first '.' or ';' outside brackets that ends a word."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if depth == 0 and char in ".;" and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i]
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hf-ssd serve`."""
    parser.add_argument("--target", required=True,
                        help="the served model: a local folder, a Hub id in the local cache, or a fetched short "
                             "name such as qwen2.5-coder-1.5b (see `hf-ssd models list`); clients name it so")
    parser.add_argument("--draft", help="the draft model, same forms (e.g. qwen2.5-coder-0.5b); required unless "
                                        "--no-ssd")
    parser.add_argument("--no-ssd", action="store_true",
                        help="serve the target alone (plain decoding) through the same server: the baseline")
    parser.add_argument("--host", default="localhost", help="listen address (default: localhost)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default: 8000; 0 picks a free one)")
    parser.add_argument("--device", default="auto", help="device for both models: auto, cpu, cuda:0, ... "
                                                         "(default: auto)")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto (from the weights), float32, bfloat16, "
                                                        "... (default: auto)")
    parser.add_argument("--draft-precision", default="fp32", choices=["fp32", "int8"],
                        help="the draft's CPU precision; int8 is faster and keeps the output exact (default: fp32)")
    parser.add_argument("--target-precision", default="auto", choices=["auto", "fp32", "fp32-packed"],
                        help="the target's CPU kernels: fp32-packed runs its Linear layers through oneDNN's packed "
                        "kernels (verifying K+1 tokens costs about one); auto packs where that measures faster "
                        "here; with --no-ssd too, so the baseline runs the same target (default: auto)")
    parser.add_argument("--no-draft-worker", action="store_true",
                        help="do not start the draft's worker process before serving (executor auto/process)")
    parser.add_argument("--enable-cors", action="store_true", help="permissive CORS (all origins)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="transformers' and uvicorn's log level (default: warning)")
    group = parser.add_argument_group(SSD_GROUP)
    defaults, described = SSDConfig(), _field_help()
    for field in dataclasses.fields(SSDConfig):
        if field.name.startswith("_"):
            continue
        default = json.dumps(getattr(defaults, field.name))
        group.add_argument(f"--{field.name.replace('_', '-')}", dest=f"ssd_{field.name}", type=_value,
                           metavar="VALUE", help=f"{described.get(field.name, field.name)} (default: {default})")


def ssd_config_from(args: argparse.Namespace) -> SSDConfig:
    """The SSDConfig the options ask for; ValueError naming the bad field and what is allowed."""
    given = {name: getattr(args, f"ssd_{name}") for name in SSDConfig.field_names()}
    return SSDConfig.from_dict({name: value for name, value in given.items() if value is not None})


def check_arguments(args: argparse.Namespace) -> SSDConfig | None:
    """Every check that needs no model; the server's SSDConfig (None with --no-ssd). Raises ValueError."""
    if args.no_ssd and args.draft:
        raise ValueError("--no-ssd serves the target alone: drop --draft")
    if not args.no_ssd and not args.draft:
        raise ValueError("--draft is required (or --no-ssd to serve the target alone)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535; got {args.port}")
    config = None if args.no_ssd else ssd_config_from(args)
    if args.no_ssd and any(getattr(args, f"ssd_{name}") is not None for name in SSDConfig.field_names()):
        raise ValueError("SSD options were given with --no-ssd")
    if args.dtype not in ("auto", None):
        import torch

        if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
            raise ValueError(f"--dtype must be auto or a torch dtype such as float32 or bfloat16; got {args.dtype!r}")
    from ..models import resolve_model

    for name in (args.target, args.draft):
        if name is not None:
            resolve_model(name)  # ModelNotFetchedError (a ValueError's sibling) names the fetch command
    return config


logger = logging.getLogger("hf_ssd.serve")


def _report_to_stderr() -> None:
    """The command's messages (its errors, the address it serves on) go to this call's stderr, whatever the server's
    log level, as `hf-ssd serve: ...` lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hf-ssd serve: %(message)s"))
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def run_command(args: argparse.Namespace) -> int:
    from ..models import ModelsError
    from .compat import ServingUnavailable, require_serving

    _report_to_stderr()
    try:
        config = check_arguments(args)
        require_serving()
    except (ValueError, ModelsError, ServingUnavailable) as error:
        logger.error("error: %s", error)
        return 2
    from .server import SSDServer

    server = SSDServer(args.target, args.draft, config, host=args.host, port=args.port, device=args.device,
                       dtype=args.dtype, draft_precision=args.draft_precision, target_precision=args.target_precision,
                       start_draft_worker=not args.no_draft_worker, enable_cors=args.enable_cors,
                       log_level=args.log_level)
    what = "plain decoding" if config is None else f"SSD with {args.draft}, {config.to_json_string()}"
    logger.info("%s (%s) on http://%s:%s/v1 (/v1/chat/completions, /v1/models, /metrics)", args.target, what,
                args.host, args.port)
    server.run()
    return 0
