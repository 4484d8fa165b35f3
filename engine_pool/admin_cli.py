"""`kvgate admin`: drive a running gateway's engine pool through its /admin endpoints.

    kvgate admin --url http://127.0.0.1:8000 --key KEY status
    kvgate admin ... drain REPLICA          drain then stop one replica
    kvgate admin ... restart REPLICA        drain, stop, relaunch one replica (never below N-1 ready)
    kvgate admin ... restart --model MODEL  rolling restart of every replica of MODEL
    kvgate admin ... scale MODEL N          set the number of replicas (removal drains first)

The key may come from KVGATE_ADMIN_KEY instead of --key. Exit status 0 on success, 1 when the gateway refused
(the OpenAI-shaped error is printed), 2 on bad usage or when the gateway cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate admin", description="Operate a running gateway's engine pool.")
    p.add_argument("--url", default=os.environ.get("KVGATE_URL", "http://127.0.0.1:8000"), help="gateway base URL")
    p.add_argument("--key", default=os.environ.get("KVGATE_ADMIN_KEY"), help="admin key (or KVGATE_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the operation")
    p.add_argument("--no-wait", action="store_true", help="return once the operation started")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="list replicas and their states")
    d = sub.add_parser("drain", help="drain then stop a replica")
    d.add_argument("replica")
    r = sub.add_parser("restart", help="restart a replica, or every replica of --model one at a time")
    r.add_argument("replica", nargs="?")
    r.add_argument("--model", help="rolling restart of this model")
    s = sub.add_parser("scale", help="set the number of replicas of a model")
    s.add_argument("model")
    s.add_argument("replicas", type=int)
    return p


def request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    url = args.url.rstrip("/") + path
    if method == "POST" and args.no_wait:
        url += "?wait=false"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"error": {"message": raw.decode(errors="replace")}}


def _print_status(data: Any) -> None:
    print(f"{'REPLICA':<24} {'MODEL':<16} {'STATE':<10} {'ROUTABLE':<8} {'IN-FLIGHT':>9} {'RESTARTS':>8}  URL")
    for r in data.get("replicas", []):
        state = r.get("state", "attached")
        print(
            f"{r['id']:<24} {r.get('model') or '?':<16} {state:<10} {r.get('routable', False)!s:<8} "
            f"{r.get('in_flight', 0):>9} {r.get('restarts', 0):>8}  {r.get('url')}"
        )
        if r.get("last_error"):
            print(f"    last error: {r['last_error']}")


def _seg(name: str) -> str:
    """A replica or model name as one path segment (spaces, '?', '/' quoted)."""
    return urllib.parse.quote(name, safe="")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.key:
        print("kvgate admin: no admin key (--key or KVGATE_ADMIN_KEY)", file=sys.stderr)
        return 2
    try:
        if args.cmd == "status":
            status, data = request(args, "GET", "/admin/replicas")
        elif args.cmd == "drain":
            status, data = request(args, "POST", f"/admin/replicas/{_seg(args.replica)}/drain")
        elif args.cmd == "restart":
            if bool(args.model) == bool(args.replica):
                print("kvgate admin restart: give either REPLICA or --model MODEL", file=sys.stderr)
                return 2
            path = (
                f"/admin/models/{_seg(args.model)}/rolling-restart"
                if args.model
                else f"/admin/replicas/{_seg(args.replica)}/restart"
            )
            status, data = request(args, "POST", path)
        else:
            status, data = request(args, "POST", f"/admin/models/{_seg(args.model)}/scale", {"replicas": args.replicas})
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        if isinstance(exc.reason if isinstance(exc, urllib.error.URLError) else exc, TimeoutError):
            print(f"kvgate admin: no answer within {args.timeout:g} s; the operation may still be running on the "
                  "gateway: see `kvgate admin status`", file=sys.stderr)  # fmt: skip
        else:
            print(f"kvgate admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if status >= 400:
        print(json.dumps(data, indent=2), file=sys.stderr)
        return 1
    if args.cmd == "status":
        _print_status(data)
    else:
        print(json.dumps(data, indent=2))
    return 0
