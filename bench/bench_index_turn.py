"""The prefix index's CPU per routed request, alone: the calls the gateway makes for one request (overlap and
footprint on every candidate, the first-block hints, the LRU ages, recording the prompt on the chosen replica).

Workload: 2 replicas of 8,192 blocks (or `--replicas`), every one holding a shared prefix of S blocks (a system
prompt, an agent's history), each request that prefix and N new blocks of its own, routed to the first replica
(`--shape shared`); or (`--shape sessions`) 64 conversations, each on its replica, growing by N blocks a turn up to
S. In process, no I/O; each configuration in its own process, this checkout and (`--baseline DIR`, a checkout of
an earlier commit) the other in turn, `--rounds` times, best of the rounds (this machine's speed drifts).

    python bench/bench_index_turn.py --baseline /tmp/old   # git worktree add /tmp/old <commit>
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import random, sys, time
sys.path.insert(0, sys.argv[1])
from cacheindex.kv_index import KvIndex
shape, shared, new, replicas = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(1)
idx = KvIndex()
ids = [f"r{i}" for i in range(replicas)]
for r in ids:
    idx.add_replica(r, capacity_blocks=8192)
base = [rng.getrandbits(64) for _ in range(16 if shape == "sessions" else shared)]
sessions = [list(base) for _ in range(64)]
def request(i):
    if shape == "shared":
        return ids[0], tuple(base + [rng.getrandbits(64) for _ in range(new)])
    s = sessions[i % 64]
    if len(s) + new > shared:
        del s[len(base):]
    s.extend(rng.getrandbits(64) for _ in range(new))
    return ids[i % 64 % replicas], tuple(s)
for r in ids:
    idx.record_routed(r, tuple(base))
for i in range(500):
    idx.record_routed(*request(i))
n = 3000
t0 = time.perf_counter()
for i in range(n):
    rid, p = request(i)
    overlap = idx.overlap(p, ids)
    idx.footprint(p, ids)
    idx.holders(p[0])
    idx.ages(rid, p, overlap[rid], None)
    idx.record_routed(rid, p)
print((time.perf_counter() - t0) / n * 1e6)
"""


def run(source: Path, shape: str, shared: int, new: int, replicas: int) -> float:
    argv = [sys.executable, "-c", CHILD, str(source), shape, str(shared), str(new), str(replicas)]
    return float(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="a checkout of an earlier commit, measured after this one")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    here = Path(__file__).resolve().parent.parent
    sources = [("this", here)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    configs = [("shared", 1, 1), ("shared", 30, 2), ("shared", 100, 2), ("shared", 1000, 10)]
    configs += [("sessions", 40, 2), ("sessions", 400, 10)]
    print(f"| shape | prefix blocks | new blocks | {' | '.join(f'{name} us/request' for name, _ in sources)} |")
    print("|---|---:|---:|" + "---:|" * len(sources))
    for shape, shared, new in configs:
        rounds = [[run(src, shape, shared, new, args.replicas) for _, src in sources] for _ in range(args.rounds)]
        best = [min(column) for column in zip(*rounds, strict=True)]
        print(f"| {shape} | {shared} | {new} | {' | '.join(f'{b:.1f}' for b in best)} |", flush=True)


if __name__ == "__main__":
    main()
