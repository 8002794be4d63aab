"""The `lockstep` command line: ``lockstep launch [options] script.py [args...]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="lockstep: synchronous data-parallel training on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="start the worker processes of this node",
                       description="Start worker processes for MultiWorkerMirroredStrategy; stop them all if one fails.")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--coordinator", default=None, help="host:port of the coordinator (node 0); default: a free "
                   "port on 127.0.0.1 (single node)")
    p.add_argument("--devices-per-proc", type=int, default=None, help="CPU devices each worker simulates")
    p.add_argument("--failure-timeout", type=float, default=20.0,
                   help="seconds after which a dead or frozen worker ends the job (default 20)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="start the workers again this many times when one fails or is preempted (default 0)")
    p.add_argument("--socket-ifname", default=None, help="the network interface the workers' collectives use "
                   "(LOCKSTEP_SOCKET_IFNAME; default: the one that routes to the coordinator)")
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lockstep` command."""
    args = _parser().parse_args(argv)
    from .launch import launch

    try:
        return launch(args.script, args.args, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                      node_rank=args.node_rank, coordinator=args.coordinator,
                      devices_per_proc=args.devices_per_proc, failure_timeout=args.failure_timeout,
                      max_restarts=args.max_restarts, socket_ifname=args.socket_ifname)
    except (ValueError, FileNotFoundError) as e:
        print(f"lockstep launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
