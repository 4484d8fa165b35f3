"""Run `kvgate serve` with a chosen event loop: `python -m bench.routing_gateway --loop asyncio -- SERVE_ARGS...`.

The benchmark needs this while `gateway/upstream.py` asserts `isinstance(transport, asyncio.Transport)`, which
uvloop's transports fail (every proxied request answers 500 under uvloop, the loop `kvgate serve` picks when it is
installed). Same code path as `gateway.serve.main` otherwise.
"""

from __future__ import annotations

import asyncio
import sys

from gateway import serve as gw_serve


def main(argv: list[str]) -> int:
    loop = "uvloop"
    if argv[:1] == ["--loop"]:
        loop, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if loop == "uvloop":
        return gw_serve.main(argv)
    args = gw_serve.build_parser().parse_args(argv)
    gw_serve.setup_logging(args.log_level)
    config = gw_serve.load_config(args.config, overrides=gw_serve.flag_overrides(args))
    asyncio.run(gw_serve.serve(config, config_path=args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
