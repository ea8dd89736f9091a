"""Load test of `hf-ssd serve`: the same server with SSD and without (`--no-ssd`), under the same load.

For each side the script starts `hf-ssd serve` on 127.0.0.1 (one server at a time, so they never compete for the
cores), waits until it answers, sends one untimed warm-up request, then fires `--requests` streamed chat
completions at `--concurrency` with the official `openai` client (greedy, `temperature=0`, `max_tokens` each) and
stops the server. Per side it reports:

- requests/s   = requests / wall time of the whole load;
- latency      = request sent -> last chunk, p50 / p99 over the requests;
- TTFT         = request sent -> first content chunk, p50 / p99;
- tokens/s     = completion tokens of all requests / wall time (the server's throughput);
- SSD's own figures from its `/metrics` (acceptance rate, mean accepted length, cache hit rate, target wait share).

Greedy answers of the two sides are compared one by one ("identical": SSD is lossless, so it should be N/N).
transformers serve runs one generation at a time per model (requests queue), so at concurrency C latency grows
with the queue; requests/s and tokens/s are the throughput of that one generation stream.

Usage (from the project root)::

    .venv/bin/python benchmarks/serve_load.py --tiny                     # random tiny pair: a smoke check
    .venv/bin/python benchmarks/serve_load.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --requests 32 --concurrency 4 --max-tokens 128 --out serve_load.json
    # already running servers (e.g. on a GPU box): no server is started
    .venv/bin/python benchmarks/serve_load.py --ssd-url http://127.0.0.1:8000/v1 --plain-url http://127.0.0.1:8001/v1

`--serve-args "..."` is appended to both `hf-ssd serve` command lines (e.g. "--dtype float32 --device cpu"),
`--ssd-args "..."` to the SSD side only (e.g. "--lookahead 4 --draft-precision int8").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses a linked list.",
    "Implement binary search over a sorted list in Python and explain the loop invariant.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Parse a CSV line with quoted fields in Python without the csv module.",
    "Write a Python function that merges two sorted lists.",
    "Count the words in a string and return the five most common ones.",
)


# ---- models and prompts -------------------------------------------------------------------------------------------


def tiny_pair(folder: Path) -> tuple[str, str]:
    """A random 4-layer Llama and a draft made of its first layer (same embeddings and head), with a word-level
    tokenizer ("w1".."w255") carrying a chat template, saved under `folder`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 256
    words = ["<unk>"] + [f"w{i}" for i in range(1, vocab)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < 1})
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return str(folder / "target"), str(folder / "draft")


def tiny_prompts(count: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(1, 256)}" for _ in range(rng.randrange(4, 16))) for _ in range(count)]


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a JSONL file (`turns[0]` or `prompt` of each object) or a text file (one a line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            record = json.loads(line)
            prompts.append(record["turns"][0] if "turns" in record else record["prompt"])
        else:
            prompts.append(line)
    return prompts


# ---- servers ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`hf-ssd serve` in a subprocess on 127.0.0.1, its log in a file; a context manager."""

    def __init__(self, arguments: list[str], log: Path, timeout: float):
        self.port = free_port()
        self.command = [sys.executable, "-m", "hf_ssd.cli", "serve", "--host", "127.0.0.1",
                        "--port", str(self.port), *arguments]
        self.log, self.timeout = log, timeout
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.setdefault("HF_HUB_OFFLINE", "1")
        self.process = subprocess.Popen(self.command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}): {' '.join(self.command)}\n"
                                   + self.log.read_text()[-3000:])
            try:
                urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the server did not answer within {self.timeout:.0f}s; log: {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def scrape(url: str) -> dict[str, float]:
    """A server's `/metrics`: {sample name with its non-model labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def ssd_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """SSD's statistics over the timed load, from two scrapes of `/metrics`."""
    if "vllm:spec_decode_num_drafts_total" not in after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, tokens, accepted = (delta(f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens",
                                                                                   "accepted_tokens"))
    rounds, lookups, hits = (delta(f"hf_ssd:{n}_total") for n in ("rounds", "cache_lookups", "cache_hits"))
    return {
        "acceptance_rate": accepted / tokens if tokens else 0.0,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
        "mean_draft_length": tokens / drafts if drafts else 0.0,
        "cache_hit_rate": hits / lookups if lookups else 0.0,
        "target_wait_share": (delta("hf_ssd:target_wait_seconds_total") / delta("hf_ssd:ssd_seconds_total")
                              if delta("hf_ssd:ssd_seconds_total") else 0.0),
        "rounds": rounds,
    }


# ---- load ---------------------------------------------------------------------------------------------------------


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    text, tokens = [], 0
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"prompt": prompt, "text": "".join(text), "completion_tokens": tokens, "latency_s": end - start,
            "ttft_s": (first or end) - start}


async def load(url: str, model: str | None, prompts: list[str], requests: int, concurrency: int,
               max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    model = model or (await client.models.list()).data[0].id
    await one_request(client, model, prompts[0], max_tokens)  # warm-up, untimed
    before = scrape(url)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> dict:
        async with gate:
            return await one_request(client, model, prompts[i % len(prompts)], max_tokens)

    start = time.perf_counter()
    records = await asyncio.gather(*(gated(i) for i in range(requests)))
    wall = time.perf_counter() - start
    after = scrape(url)
    await client.close()
    return {"model": model, "url": url, "wall_s": wall, "records": records, "ssd": ssd_figures(before, after)}


def summarise(run: dict) -> dict:
    import numpy as np

    records = run["records"]
    latency = np.array([r["latency_s"] for r in records])
    ttft = np.array([r["ttft_s"] for r in records])
    tokens = sum(r["completion_tokens"] for r in records)
    return {
        "requests": len(records),
        "requests_per_s": len(records) / run["wall_s"],
        "latency_p50_s": float(np.percentile(latency, 50)),
        "latency_p99_s": float(np.percentile(latency, 99)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tokens_per_s": tokens / run["wall_s"],
        "completion_tokens": tokens,
        "wall_s": run["wall_s"],
    }


def table(summaries: dict[str, dict]) -> str:
    columns = [("req/s", "requests_per_s", 2), ("p50 lat s", "latency_p50_s", 3), ("p99 lat s", "latency_p99_s", 3),
               ("p50 TTFT s", "ttft_p50_s", 3), ("p99 TTFT s", "ttft_p99_s", 3), ("tok/s", "tokens_per_s", 1)]
    lines = [f"{'':<14}" + "".join(f"{title:>12}" for title, _, _ in columns)]
    for name, summary in summaries.items():
        lines.append(f"{name:<14}" + "".join(f"{summary[key]:>12.{digits}f}" for _, key, digits in columns))
    if {"ssd", "no-ssd"} <= set(summaries):
        ssd, plain = summaries["ssd"], summaries["no-ssd"]
        lines.append(f"{'SSD / no SSD':<14}" + "".join(
            f"{ssd[key] / plain[key] if plain[key] else float('nan'):>11.2f}x" for _, key, _ in columns))
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("what to load")
    source.add_argument("--tiny", action="store_true", help="a random tiny pair built on the fly (a smoke check)")
    source.add_argument("--target", help="target: local folder, cached Hub id or fetched short name")
    source.add_argument("--draft", help="draft, same forms")
    source.add_argument("--ssd-url", help="an SSD server already running (its /v1 base URL): start none")
    source.add_argument("--plain-url", help="a server without SSD already running (its /v1 base URL)")
    source.add_argument("--model", help="the model name to request (default: the server's first listed)")
    parser.add_argument("--requests", type=int, default=16, help="timed requests per side (default 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    parser.add_argument("--prompts", help="JSONL (turns[0] or prompt) or text file (a prompt a line); default: "
                                          "eight coding prompts (--tiny: random word prompts)")
    parser.add_argument("--serve-args", default="", help="extra `hf-ssd serve` options for both servers")
    parser.add_argument("--ssd-args", default="", help="extra `hf-ssd serve` options for the SSD server")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a server to load")
    parser.add_argument("--out", help="write the summaries and per-request records as JSON here")
    args = parser.parse_args(argv)
    connecting = args.ssd_url or args.plain_url
    if not connecting and not args.tiny and not (args.target and args.draft):
        parser.error("give --tiny, or --target and --draft, or --ssd-url/--plain-url")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--requests, --concurrency and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="serve_load_"))
    runs: dict[str, dict] = {}
    if args.ssd_url or args.plain_url:
        prompts = load_prompts(args.prompts)
        for name, url in (("no-ssd", args.plain_url), ("ssd", args.ssd_url)):
            if url:
                runs[name] = asyncio.run(load(url, args.model, prompts, args.requests, args.concurrency,
                                              args.max_tokens))
    else:
        target, draft = tiny_pair(workdir) if args.tiny else (args.target, args.draft)
        prompts = tiny_prompts(max(args.requests, 1)) if args.tiny and not args.prompts else load_prompts(args.prompts)
        common = shlex.split(args.serve_args) + (["--device", "cpu"] if args.tiny else [])
        sides = {"no-ssd": ["--target", target, "--no-ssd", *common],
                 "ssd": ["--target", target, "--draft", draft, *common, *shlex.split(args.ssd_args)]}
        for name, arguments in sides.items():
            print(f"[{name}] hf-ssd serve {' '.join(arguments)}", file=sys.stderr)
            with ServerProcess(arguments, workdir / f"{name}.log", args.start_timeout) as server:
                runs[name] = asyncio.run(load(server.url, args.model, prompts, args.requests, args.concurrency,
                                              args.max_tokens))
    summaries = {name: summarise(run) for name, run in runs.items()}
    print(f"{args.requests} streamed requests per side, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          "greedy")
    print(table(summaries))
    if "ssd" in runs and runs["ssd"]["ssd"]:
        figures = runs["ssd"]["ssd"]
        print("SSD: acceptance rate {acceptance_rate:.2f}, mean accepted length {mean_accepted_length:.2f}, cache hit "
              "rate {cache_hit_rate:.2f}, target waited {target_wait_share:.0%} of SSD time".format(**figures))
    identical = None
    if {"ssd", "no-ssd"} <= set(runs):
        pairs = list(zip(runs["ssd"]["records"], runs["no-ssd"]["records"]))
        identical = sum(a["text"] == b["text"] for a, b in pairs)
        print(f"identical answers (SSD vs no SSD, greedy): {identical}/{len(pairs)}")
    if args.out:
        result = {"settings": {k: v for k, v in vars(args).items()}, "summaries": summaries,
                  "ssd_figures": runs.get("ssd", {}).get("ssd"), "identical_answers": identical,
                  "runs": {name: {k: v for k, v in run.items() if k != "ssd"} for name, run in runs.items()}}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if identical in (None, len(runs.get("ssd", {}).get("records", []))) else 1


if __name__ == "__main__":
    sys.exit(main())
