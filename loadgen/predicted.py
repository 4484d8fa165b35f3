"""Prediction next to measurement: the capacity plan's knee and decode ceiling beside what a sweep measured.

Where the prediction comes from (`--plan`):
- a plan file (`kvgate plan MODEL --json > plan.json`): its per-replica `predicted_knee` (sequences whose KV fits
  at the plan's `context`) and `decode_tok_s_aggregate`, times the replicas behind the URL;
- `auto`: the KV capacity the engines report, read from the `--metrics-url` pages once before the sweep:
  kvgate's `kvgate_prefix_index_capacity_blocks{source="engine"}` (one sample per replica, with its block size;
  a kvgate-launched pool) or vLLM's `vllm:cache_config_info` (`num_gpu_blocks`, `block_size`; one per engine
  URL). The knee = sum over replicas of floor(blocks / ceil(T / block_size)), T = tokens one sequence holds at
  its end = mean prompt + completion tokens of the lowest-load setting's requests. No device figures, so no
  ceiling. Shared prefix blocks are counted once by the engine, so a prefix-sharing workload fits more: check the
  arithmetic on unique prompts (`--workload random`).
Comparison (`compare`), in concurrency (sequences in flight): a rate sweep's loads are req/s, so each of its
points counts as its rate x mean latency in flight (Little's law, as its gate is derived). The measured knee is a
tested load; the prediction's step is the largest tested load <=
the predicted knee (the lowest when the prediction is below all); "within one step" when the two steps' positions
in the sorted loads differ by at most one. A sweep that found no knee is compared with nothing when the predicted
knee is past its highest load (within: unknown), else within one step only when the prediction is its last step.
Pure arithmetic over the sweep's points: O(points).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvcommon.promtext import samples
from loadgen.promscrape import fetch_text


@dataclass(frozen=True, slots=True)
class Capacity:
    source: str  # replica id or engine URL
    blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Prediction:
    knee: int  # concurrency over the whole pool behind the URL
    ceiling_tok_s: float | None  # aggregate decode ceiling, None when not known
    source: str  # what the figures come from, for the report

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_capacities(text: str, url: str) -> list[Capacity]:
    """KV capacities in a metrics page: kvgate's per-replica gauge when present, else vLLM's cache_config_info."""
    kvgate: list[Capacity] = []
    vllm: list[Capacity] = []
    for s in samples(text, ("kvgate_prefix_index_capacity_blocks{", "vllm:cache_config_info{")):
        if s.name == "kvgate_prefix_index_capacity_blocks" and s.labels.get("source") == "engine":
            kvgate.append(Capacity(s.labels["replica"], int(s.value), int(s.labels.get("block_size", 16))))
        elif s.name == "vllm:cache_config_info" and s.labels.get("num_gpu_blocks", "").isdigit():
            vllm.append(Capacity(url, int(s.labels["num_gpu_blocks"]), int(s.labels.get("block_size") or 16)))
    return kvgate or vllm[:1]  # one engine per vLLM URL (its info gauge may repeat per engine index)


async def scrape_capacities(http: aiohttp.ClientSession, urls: Sequence[str]) -> list[Capacity]:
    """Capacities from every URL, deduplicated by source; a gateway's per-replica figures win over engine pages
    scraped beside it (the same engines, counted once). Raises ValueError when none reports any."""
    found: dict[str, Capacity] = {}
    for url in urls:
        try:
            text = await fetch_text(http, url)
        except ValueError:
            continue  # no page there: no capacity from it
        for c in parse_capacities(text, url):
            found[c.source] = c
    if any(c.source not in urls for c in found.values()):
        found = {k: c for k, c in found.items() if k not in urls}
    if not found:
        raise ValueError("--plan auto: no --metrics-url reports a KV capacity (kvgate's "
                         "kvgate_prefix_index_capacity_blocks or vLLM's vllm:cache_config_info)")  # fmt: skip
    return sorted(found.values(), key=lambda c: c.source)


def from_capacities(caps: Sequence[Capacity], tokens_per_sequence: float) -> Prediction:
    per_seq = max(1, math.ceil(tokens_per_sequence))
    knee = sum(c.blocks // math.ceil(per_seq / c.block_size) for c in caps)
    blocks = ", ".join(f"{c.blocks} x {c.block_size}" for c in caps)
    return Prediction(knee, None, f"engines' KV capacity ({blocks} tokens) at {per_seq} tokens per sequence")


def read_plan_file(path: str) -> tuple[int, float, Any]:
    """(predicted_knee, decode_tok_s_aggregate, context) per replica of a `kvgate plan --json` file; ValueError naming
    the file when it is not one (read before the sweep, so a bad --plan costs no load)."""
    try:
        doc = json.loads(Path(path).read_text())
        knee, ceiling = int(doc["predicted_knee"]), float(doc["decode_tok_s_aggregate"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--plan {path}: not the JSON of `kvgate plan --json` ({exc!r})") from exc
    if knee < 1:  # `kvgate plan` refuses a model of which nothing fits: such a file predicts nothing
        raise ValueError(f"--plan {path}: its predicted_knee is {knee}, not a concurrency to compare with")
    return knee, ceiling, doc.get("context", "?")


def from_plan_file(path: str, replicas: int, figures: tuple[int, float, Any] | None = None) -> Prediction:
    """The plan file's prediction times `replicas`; `figures`: what `read_plan_file` read of it already."""
    knee, ceiling, context = figures or read_plan_file(path)
    return Prediction(knee * replicas, ceiling * replicas, f"{path} (context {context}) x {replicas} replica(s)")


def compare(
    prediction: Prediction, loads: Sequence[float], knee_load: float | None, ceiling_tok_s: float, unit: str = ""
) -> dict[str, Any]:
    """The prediction beside the measured knee (None: the sweep found none) and best throughput (module header);
    `loads` are concurrencies, as the prediction (`unit` names how they were derived, for the text)."""
    ordered = sorted(loads)
    below = [i for i, x in enumerate(ordered) if x <= prediction.knee]
    predicted_step = below[-1] if below else 0
    step = f"plan: knee {prediction.knee}{unit} (tested step {ordered[predicted_step]:g})"
    steps: int | None = None
    within: bool | None = None  # unknown: no knee measured, and the plan's is past the sweep
    if knee_load is not None:
        steps = abs(predicted_step - ordered.index(knee_load))
        within = steps <= 1
        text = f"{step}, measured {knee_load:g}: {steps} step(s) apart, {'within' if within else 'NOT within'} one step"
    elif prediction.knee > ordered[-1]:
        text = f"{step}: past the sweep, which found no knee up to {ordered[-1]:g}; not compared (sweep higher)"
    else:
        within = predicted_step >= len(ordered) - 1  # the knee may be just past the last step
        text = (f"{step}, but no knee was measured up to {ordered[-1]:g}: "
                f"{'within' if within else 'NOT within'} one step at best")  # fmt: skip
    return {
        **prediction.to_json(),
        "predicted_step": ordered[predicted_step],
        "measured_knee": knee_load,
        "measured_ceiling_tok_s": ceiling_tok_s,
        "steps_apart": steps,
        "within_one_step": within,
        "text": text,
    }
