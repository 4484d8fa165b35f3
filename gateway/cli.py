"""`kvgate` command line: one entry point, each subcommand implemented by the package that owns it.

Every subcommand module exposes `main(argv: list[str]) -> int`; this file only dispatches, so the packages stay
independent and importing the CLI does not import vLLM, matplotlib or the tokenizer stack.
"""

from __future__ import annotations

import importlib
import sys

_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway (and the engine pool it is configured with)"),
    "sim-engine": ("simengine.cli", "run a simulated vLLM engine (tests, benchmarks)"),
    "make-tiny-model": ("engine_pool.tiny_model", "build the tiny random-weight Llama offline"),
    "make-tiny-lora": ("engine_pool.tiny_lora", "build a tiny LoRA adapter for the tiny model offline"),
    "loadgen": ("loadgen.cli", "load generator: sweep, run, quality, compare"),
    "plan": ("loadgen.plan", "capacity plan from a model's config.json and a device: KV fit, decode ceiling"),
    "admin": ("engine_pool.admin_cli", "drain / rolling-restart / scale a running gateway"),
}


def _usage() -> str:
    lines = ["usage: kvgate COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    lines.append("\n`kvgate COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    entry = _SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"kvgate: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
