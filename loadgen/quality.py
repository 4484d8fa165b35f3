"""Quality checks for a real model behind the endpoint, and the repetition-loop detector they use.

Repetition loop (`find_repetition_loop`, pure): generation that fell into a loop ends with one block repeated. For
units u[0..n-1] (words, then characters) and each period p (1..max_period), the periodic suffix is the longest tail
where u[i] == u[i + p]; its length L = p + (number of such i counted back from n - 1 - p). A loop is reported for
the smallest p with L // p >= min_repeats and L >= min_fraction * n (and, for characters, L >= min_span_chars, so
"..." is not a loop). Phase-free: a last repetition cut by max_tokens still counts. O(max_period * n).

Checks (`run_quality`):
- long_context: one prompt of `long_input_tokens`; passes when it succeeds and usage counts at least 90% of them.
- long_generation: `long_output_tokens` without ignore_eos at temperature 0; passes when the stream ends with
  `[DONE]` and a finish_reason of stop or length, within the token limit.
- no_repetition_loop: the long generation's text has no loop (above).
- deterministic: `identical` concurrent copies of one prompt at temperature 0 (ignore_eos, fixed length) give
  byte-identical answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import aiohttp

from loadgen.client import RequestResult, RequestSpec, Target, send_request
from loadgen.text import TextMaker


@dataclass(frozen=True, slots=True)
class RepetitionLoop:
    unit: Literal["word", "char"]
    period: int  # units per repeated block
    repeats: int  # whole repetitions in the periodic tail
    span: int  # units in the periodic tail
    fraction: float  # span / total units
    pattern: str  # the repeated block, cut to 80 characters


def _periodic_tail(units: Sequence[str], p: int) -> int:
    n = len(units)
    i = n - 1 - p
    while i >= 0 and units[i] == units[i + p]:
        i -= 1
    return (n - 1 - p - i) + p


def _scan(
    units: Sequence[str], unit: Literal["word", "char"], max_period: int, min_repeats: int, min_fraction: float,
    min_span: int, sep: str,
) -> RepetitionLoop | None:  # fmt: skip
    n = len(units)
    for p in range(1, min(max_period, n // max(min_repeats, 1)) + 1):
        span = _periodic_tail(units, p)
        if span // p >= min_repeats and span >= min_fraction * n and span >= min_span:
            pattern = sep.join(units[n - p :])[:80]
            return RepetitionLoop(unit, p, span // p, span, span / n, pattern)
    return None


def find_repetition_loop(
    text: str,
    *,
    min_repeats: int = 4,
    max_period_words: int = 32,
    max_period_chars: int = 64,
    min_fraction: float = 0.2,
    min_span_chars: int = 40,
) -> RepetitionLoop | None:
    """The trailing repetition loop of text, words first, then characters; None when there is none."""
    words = text.split()
    found = _scan(words, "word", max_period_words, min_repeats, min_fraction, min_repeats, " ")
    if found is not None:
        return found
    return _scan(list(text), "char", max_period_chars, min_repeats, min_fraction, min_span_chars, "")


@dataclass(slots=True)
class CheckResult:
    name: str
    passed: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _spec(name: str, text: str, max_tokens: int) -> RequestSpec:
    return RequestSpec(session_id=name, user_id=name, turn=0, messages=(("user", text),), max_tokens=max_tokens)


def _figures(r: RequestResult) -> dict[str, Any]:
    row = r.to_json()
    return {k: row[k] for k in ("ok", "status", "error_type", "error", "prompt_tokens", "completion_tokens",
                                "finish_reason", "ttft_s", "e2e_s")}  # fmt: skip


async def run_quality(
    http: aiohttp.ClientSession,
    target: Target,
    maker: TextMaker,
    *,
    headers: dict[str, str],
    long_input_tokens: int = 1500,
    long_output_tokens: int = 512,
    identical: int = 4,
    identical_tokens: int = 64,
    seed: int = 0,
) -> list[CheckResult]:
    checks: list[CheckResult] = []

    text = maker.text(f"q-{seed}-long", long_input_tokens)
    r = await send_request(http, target, _spec("long_context", text, 16), (("user", text),), headers=headers)
    passed = r.ok and r.prompt_tokens >= 0.9 * long_input_tokens
    detail = f"prompt_tokens={r.prompt_tokens} (sent ~{long_input_tokens})" if r.ok else f"{r.error_type}: {r.error}"
    checks.append(CheckResult("long_context", passed, detail, _figures(r)))

    free = replace(target, ignore_eos=False, temperature=0.0)
    prompt = maker.text(f"q-{seed}-gen", 64)
    r = await send_request(
        http, free, _spec("long_generation", prompt, long_output_tokens), (("user", prompt),), headers=headers
    )
    clean = r.ok and r.finish_reason in ("stop", "length") and r.completion_tokens <= long_output_tokens
    detail = (
        f"finish_reason={r.finish_reason}, completion_tokens={r.completion_tokens}"
        if r.ok
        else f"{r.error_type}: {r.error}"
    )
    checks.append(CheckResult("long_generation", clean, detail, _figures(r)))
    loop = find_repetition_loop(r.text)
    detail = (
        "no loop" if loop is None else f"{loop.unit} loop of period {loop.period} x{loop.repeats}: {loop.pattern!r}"
    )
    if not r.ok:  # a failed generation has no text to judge: say why, not "no loop" beside a FAIL
        detail = f"not checked: the long generation failed ({r.error_type}: {r.error})"
    checks.append(
        CheckResult("no_repetition_loop", r.ok and loop is None, detail, {"loop": asdict(loop) if loop else None})
    )

    fixed = replace(target, ignore_eos=True, temperature=0.0)
    prompt = maker.text(f"q-{seed}-same", 128)
    spec = _spec("deterministic", prompt, identical_tokens)
    rs = await asyncio.gather(
        *(send_request(http, fixed, spec, (("user", prompt),), headers=headers) for _ in range(identical))
    )
    texts = {x.text for x in rs if x.ok}
    all_ok = all(x.ok for x in rs)
    passed = all_ok and len(texts) == 1
    detail = f"{len(texts)} distinct answers from {identical} identical requests" if all_ok else "some failed"
    checks.append(CheckResult("deterministic", passed, detail, {"distinct": len(texts), "requests": identical}))
    return checks
