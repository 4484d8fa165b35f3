"""Figures of a load-generator run: percentiles, per-setting summaries, the knee rule and the verdicts.

Percentiles: linear interpolation between closest ranks (numpy's default "linear" method, Hyndman-Fan type 7):
for sorted values v[0..n-1] and q in [0, 100], h = (n - 1) * q / 100, p = v[floor h] + (h - floor h) *
(v[ceil h] - v[floor h]). Monotone in q, so p50 <= p90 <= p99 always. O(n log n) for the sort.

Throughput = tokens of successful requests / wall time of the setting (first send to last completion).

Knee rule (`find_knee`), over sweep points sorted by load x (concurrency or rate), each with TTFT p50 t, output
throughput r and success rate s. The baseline b is the TTFT p50 of the lowest-load point. Point i (i >= 1) is
*saturated* when
    (a) t_i > ttft_factor * b  and  t_i - b > min_rise_s      (TTFT rose sharply: queueing, not noise), and
    (b) r_i < (1 + min_gain) * r_{i-1}                        (throughput stopped rising),
    (c) max(r_j, j >= i) < (1 + min_gain) * r_{i-1}           (and it does not rise again at any higher load:
                                                               a single stalled setting is noise, not the knee),
or when s_i < min_success (the endpoint fails requests; a request refused with Retry-After, the server's admission
shedding load, is answered, not failed: s counts it with the successes), or when more than 1 - min_success of its
requests are refused (an admission gate in front sheds what it cannot serve: through it the TTFT of the admitted
never rises, and the shedding is the knee). A rate sweep (open loop, `open_loop`)
saturates on (a) alone: arrivals do not slow down when the server does, so measured throughput keeps rising with the
offered rate while requests queue, and a sharp TTFT rise is the knee. The knee is the point just before the first
saturated point; when no point saturates the knee is the highest load tested and `found` is False (the sweep did not
reach it); when the lowest load already fails or is refused there is no knee (`found` False, `saturated_at` that
load) and nothing is recommended. Defaults: ttft_factor 3.0, min_rise_s 0.005, min_gain 0.10, min_success 0.99.
O(points^2) at worst, for (c).

Verdicts (`verdict`), with ratio = t_i / b and the knee load k:
    success < min_success         -> "failing"
    refused > 1 - min_success     -> "shedding"
    x == k                        -> "sweet spot"   (most throughput before queueing)
    x < k and ratio <= 1.5        -> "interactive"
    x < k                         -> "production"
    x > k and ratio <= 10         -> "queueing"
    x > k                         -> "batch only"
With latency targets (`slo_verdict`), a point whose SLO attainment is below `min_attainment` is "misses targets"
whatever its place against the knee: a point where most requests miss their targets is never a sweet spot.

Recommended per-replica gate: floor(k / replicas), at least 1, for a concurrency sweep. For a rate sweep the knee
concurrency comes from Little's law, L = rate * mean e2e latency at the knee (rounded up).

Goodput (with `--slo ttft=500ms,tpot=50ms,e2e=4s`, any subset): a request is *good* when it succeeded and meets
every bound given; SLO attainment = good / all requests of the setting (failures count against it), goodput =
good requests / wall time. The knee by goodput (`find_goodput_knee`) is the highest load before the first point
whose attainment falls below `min_attainment` (default 0.9, DistServe's definition of goodput capacity); when no
point falls below, it is the highest load tested, `found` False; when the lowest load already falls below, no
load tested is within targets: `found` False too, `saturated_at` that lowest load (as the knee rule's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadgen.client import RequestResult

PERCENTILES = (50.0, 90.0, 99.0)
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request latency bounds in seconds; None = no bound on that figure."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, r: RequestResult) -> bool:
        """Succeeded within every bound. A request with no streamed token has no TTFT and misses a TTFT bound; a
        one-token answer has no TPOT and meets a TPOT bound (there is no time between its tokens)."""
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and r.tpot_s is not None and r.tpot_s > self.tpot_s:
            return False
        return self.e2e_s is None or r.e2e_s <= self.e2e_s

    def describe(self) -> str:
        parts = [f"{k}<={v * 1e3:g}ms" for k, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s),
                                                     ("e2e", self.e2e_s)) if v is not None]  # fmt: skip
        return ",".join(parts)


def parse_slo(text: str) -> Slo:
    """`ttft=500ms,tpot=50ms,e2e=4s` (units us, ms or s; a bare number is milliseconds, as vLLM's --goodput)."""
    bounds: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"SLO {item!r}: expected ttft=, tpot= or e2e= followed by a duration")
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", value)
        if m is None or float(m.group(1)) <= 0:
            raise ValueError(f"SLO {item!r}: {value!r} is not a positive duration like 500ms or 2s")
        if name in bounds:
            raise ValueError(f"SLO {item!r}: {name} given twice")
        bounds[name] = float(m.group(1)) * _UNITS[m.group(2) or "ms"]
    if not bounds:
        raise ValueError("SLO: give at least one of ttft=, tpot=, e2e=")
    return Slo(ttft_s=bounds.get("ttft"), tpot_s=bounds.get("tpot"), e2e_s=bounds.get("e2e"))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of values by linear interpolation; NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    v = sorted(values)
    h = (len(v) - 1) * q / 100.0
    lo = math.floor(h)
    hi = math.ceil(h)
    return v[lo] + (h - lo) * (v[hi] - v[lo])


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, min, max of values (None when empty, so the JSON stays valid)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    out: dict[str, float | None] = {"mean": sum(values) / len(values)}
    for q in PERCENTILES:
        out[f"p{q:g}"] = percentile(values, q)
    out["min"] = min(values)
    out["max"] = max(values)
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    """Figures of one setting (one sweep point or one `run`)."""

    requests: int
    succeeded: int
    failed: int
    success_rate: float
    wall_s: float
    req_per_s: float
    output_tok_per_s: float
    input_tok_per_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_fraction: float  # cached / prompt tokens, from usage.prompt_tokens_details.cached_tokens
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    itl_s: dict[str, float | None]  # every gap between streamed tokens of the successful requests
    e2e_s: dict[str, float | None]
    errors: dict[str, int]
    slo_attainment: float | None = None  # good / all requests, with an SLO
    goodput_req_per_s: float | None = None  # good requests / wall time, with an SLO
    refused: int = 0  # of the failed: shed by the server's admission (429 / 503 with Retry-After)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Iterable[RequestResult], wall_s: float, slo: Slo | None = None) -> Summary:
    rs = list(results)
    ok = [r for r in rs if r.ok]
    errors: dict[str, int] = {}
    for r in rs:
        if not r.ok:
            key = r.error_type or "unknown"
            errors[key] = errors.get(key, 0) + 1
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    good = sum(1 for r in rs if slo.met(r)) if slo else 0
    return Summary(
        requests=len(rs),
        succeeded=len(ok),
        failed=len(rs) - len(ok),
        success_rate=len(ok) / len(rs) if rs else 0.0,
        wall_s=wall_s,
        req_per_s=len(ok) / wall,
        output_tok_per_s=completion / wall,
        input_tok_per_s=prompt / wall,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cached_fraction=cached / prompt if prompt else 0.0,
        ttft_s=distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_s=distribution([gap for r in ok for gap in r.itl_s]),
        e2e_s=distribution([r.e2e_s for r in ok]),
        errors=errors,
        slo_attainment=(good / len(rs) if rs else 0.0) if slo else None,
        goodput_req_per_s=good / wall if slo else None,
        refused=sum(1 for r in rs if r.refused),
    )


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """What the knee rule reads of one sweep point."""

    load: float  # concurrency or request rate
    ttft_p50_s: float
    output_tok_per_s: float
    success_rate: float = 1.0
    e2e_mean_s: float = 0.0
    refused_rate: float = 0.0  # answered with a refusal (429/503 + Retry-After): the target shedding load


@dataclass(frozen=True, slots=True)
class KneeRule:
    ttft_factor: float = 3.0
    min_rise_s: float = 0.005
    min_gain: float = 0.10
    min_success: float = 0.99


@dataclass(frozen=True, slots=True)
class Knee:
    index: int  # index of the knee point in the sorted points
    load: float
    found: bool  # False: no point saturated, the knee is at least the highest load tested
    baseline_ttft_s: float
    saturated_at: float | None  # load of the first saturated point
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _saturated(prev: SweepPoint, cur: SweepPoint, base: float, rule: KneeRule, open_loop: bool) -> str | None:
    if cur.success_rate < rule.min_success:
        return f"success rate {cur.success_rate:.3f} < {rule.min_success}"
    if cur.refused_rate > 1.0 - rule.min_success:  # an admission gate in front refuses what it cannot serve
        return f"{cur.refused_rate * 100:.1f} % refused"
    ttft_jump = cur.ttft_p50_s > rule.ttft_factor * base and cur.ttft_p50_s - base > rule.min_rise_s
    if ttft_jump and open_loop:
        return f"TTFT p50 {cur.ttft_p50_s * 1e3:.1f} ms > {rule.ttft_factor:g} x baseline {base * 1e3:.1f} ms"
    flat = cur.output_tok_per_s < (1.0 + rule.min_gain) * prev.output_tok_per_s
    if ttft_jump and flat:
        return (
            f"TTFT p50 {cur.ttft_p50_s * 1e3:.1f} ms > {rule.ttft_factor:g} x baseline {base * 1e3:.1f} ms "
            f"while throughput {cur.output_tok_per_s:.1f} tok/s < {1 + rule.min_gain:.2f} x "
            f"{prev.output_tok_per_s:.1f}"
        )
    return None


def find_knee(points: Sequence[SweepPoint], rule: KneeRule | None = None, *, open_loop: bool = False) -> Knee:
    """Apply the knee rule of the module header; points need not be sorted. Raises ValueError when empty."""
    if not points:
        raise ValueError("find_knee needs at least one sweep point")
    rule = rule or KneeRule()
    pts = sorted(points, key=lambda p: p.load)
    base = pts[0].ttft_p50_s
    if pts[0].success_rate < rule.min_success or pts[0].refused_rate > 1.0 - rule.min_success:
        return Knee(0, pts[0].load, False, base, pts[0].load, "the lowest load already fails or is refused")
    for i in range(1, len(pts)):
        why = _saturated(pts[i - 1], pts[i], base, rule, open_loop)
        if why is None:
            continue
        if open_loop:
            return Knee(i - 1, pts[i - 1].load, True, base, pts[i].load, why)
        later_best = max(p.output_tok_per_s for p in pts[i:])
        if (
            pts[i].success_rate >= rule.min_success
            and later_best >= (1.0 + rule.min_gain) * pts[i - 1].output_tok_per_s
        ):
            continue  # (c): a higher load still gains throughput, so this flat step was a stall, not the knee
        return Knee(i - 1, pts[i - 1].load, True, base, pts[i].load, why)
    return Knee(len(pts) - 1, pts[-1].load, False, base, None, "no saturated point: sweep higher")


def find_goodput_knee(loads_and_attainment: Sequence[tuple[float, float]], min_attainment: float = 0.9) -> Knee:
    """The knee by goodput (module header) over (load, SLO attainment) pairs. Raises ValueError when empty."""
    if not loads_and_attainment:
        raise ValueError("find_goodput_knee needs at least one sweep point")
    pts = sorted(loads_and_attainment)
    for i, (load, att) in enumerate(pts):
        if att < min_attainment:
            why = f"SLO attainment {att:.2f} < {min_attainment:g} at {load:g}"
            if i == 0:  # no load within targets: no knee, and result.json must not say one was found
                return Knee(0, load, False, 0.0, load, why)
            return Knee(i - 1, pts[i - 1][0], True, 0.0, load, why)
    return Knee(len(pts) - 1, pts[-1][0], False, 0.0, None, "every point meets the SLO: sweep higher")


def verdict(point: SweepPoint, knee: Knee, rule: KneeRule | None = None) -> str:
    rule = rule or KneeRule()
    if point.success_rate < rule.min_success:
        return "failing"
    if point.refused_rate > 1.0 - rule.min_success:
        return "shedding"
    ratio = point.ttft_p50_s / knee.baseline_ttft_s if knee.baseline_ttft_s > 0 else 1.0
    if point.load == knee.load:
        return "sweet spot"
    if point.load < knee.load:
        return "interactive" if ratio <= 1.5 else "production"
    return "queueing" if ratio <= 10.0 else "batch only"


def slo_verdict(plain: str, attainment: float, min_attainment: float) -> str:
    """A point's verdict once latency targets are known (module header)."""
    return f"misses targets ({attainment:.0%} within)" if attainment < min_attainment else plain


def recommend_gate(knee: Knee, knee_point: SweepPoint, *, replicas: int, by_rate: bool) -> int:
    """Per-replica concurrency gate from the knee (module header); at least 1."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    total = math.ceil(knee.load * knee_point.e2e_mean_s) if by_rate else int(knee.load)
    return max(1, total // replicas)
