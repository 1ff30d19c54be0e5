"""`python -m engine_core.entrypoints.router --replica URL [--replica URL ...] [--policy P] [--port P]`.

An OpenAI-compatible router over data-parallel replicas (each a `python -m
engine_core.entrypoints.openai` server, or any server with vLLM's `/metrics`): `--policy`
round_robin, least_loaded (polled `/metrics`), prefix_aware (consistent hashing with bounded
loads on the prompt's leading `--prefix-length` characters) or length_aware (prompts of at least
`--long-threshold` tokens to the `--long-replica` pool, the others elsewhere). Loopback (127.0.0.1) unless told
otherwise.
"""
from __future__ import annotations

import argparse

from engine_core.entrypoints.router.policies import POLICIES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine_core.entrypoints.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL (http://127.0.0.1:8001), once per replica")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefix-length", type=int, default=256,
                        help="prefix_aware: the leading characters (or token ids) of a prompt that pick its replica")
    parser.add_argument("--balance-factor", type=float, default=1.25,
                        help="prefix_aware: c in the bound load <= ceil(c * average in-flight requests)")
    parser.add_argument("--long-replica", action="append", default=[], metavar="URL",
                        help="length_aware: a replica of the long-context pool (also given as --replica)")
    parser.add_argument("--long-threshold", type=int, default=4096,
                        help="length_aware: prompt tokens from which a prompt goes to the long-context pool")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /metrics polls")
    parser.add_argument("--poll-timeout", type=float, default=1.0, help="seconds a poll (or a connect) may take")
    parser.add_argument("--down-seconds", type=float, default=5.0,
                        help="how long a replica that refused a connection is skipped (a good poll ends it)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    for name in ("poll_interval", "poll_timeout", "down_seconds"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")

    import uvicorn

    from engine_core.entrypoints.router.app import Router, build_app

    try:
        router = Router(args.replica, args.policy, args.prefix_length, args.balance_factor, args.down_seconds,
                        args.long_replica, args.long_threshold)
    except ValueError as e:
        parser.error(str(e))
    app = build_app(router, args.poll_interval, args.poll_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
