"""`kvgate` command line: one entry point, each subcommand implemented by the package that owns it.

This is the one dispatch table of the project, and it sits above every package (import-linter's top layer): each
entry imports its module explicitly, when called, so the layer contracts see the link and importing the CLI does
not import vLLM, matplotlib or the tokenizer stack. Every subcommand module exposes `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NamedTuple


class Subcommand(NamedTuple):
    run: Callable[[list[str]], int]
    help: str


def _serve(argv: list[str]) -> int:
    from gateway.serve import main

    return main(argv)


def _sim_engine(argv: list[str]) -> int:
    from simengine.cli import main

    return main(argv)


def _make_tiny_model(argv: list[str]) -> int:
    from engine_pool.tiny_model import main

    return main(argv)


def _make_tiny_lora(argv: list[str]) -> int:
    from engine_pool.tiny_lora import main

    return main(argv)


def _loadgen(argv: list[str]) -> int:
    from loadgen.cli import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from loadgen.plan import main

    return main(argv)


def _admin(argv: list[str]) -> int:
    from engine_pool.admin_cli import main

    return main(argv)


def _hash_key(argv: list[str]) -> int:
    """Print the stored form (`sha256:<hex>`) of each key given, for `admission.tenants.*.keys`; without keys (or
    `-`), of each line of standard input, so a key need not stand in the shell's history or the process list."""
    from gateway.admission.config import hash_key

    if argv and argv[0] in ("-h", "--help"):
        print("usage: kvgate hash-key [KEY ...]   (no KEY or '-': one key a line from standard input)")
        return 0
    keys = argv if argv and argv != ["-"] else [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    for key in keys:
        print(hash_key(key))
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(_serve, "run the gateway (and the engine pool it is configured with)"),
    "sim-engine": Subcommand(_sim_engine, "run a simulated vLLM engine (tests, benchmarks)"),
    "make-tiny-model": Subcommand(_make_tiny_model, "build the tiny random-weight Llama offline"),
    "make-tiny-lora": Subcommand(_make_tiny_lora, "build a tiny LoRA adapter for the tiny model offline"),
    "loadgen": Subcommand(_loadgen, "load generator: sweep, run, quality, report, compare"),
    "plan": Subcommand(_plan, "capacity plan from a model's config.json and a device: KV fit, decode ceiling"),
    "admin": Subcommand(_admin, "drain / rolling-restart / scale a running gateway"),
    "hash-key": Subcommand(_hash_key, "print the stored form of API keys (admission.tenants.*.keys)"),
}


def _usage() -> str:
    lines = ["usage: kvgate COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {sub.help}" for name, sub in SUBCOMMANDS.items()]
    lines.append("\n`kvgate COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    sub = SUBCOMMANDS.get(args[0])
    if sub is None:
        print(f"kvgate: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return sub.run(args[1:])
    except BrokenPipeError:  # the reader of its output left (`| head`): no traceback, nothing more written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
