"""The workers of one more machine of a multi-node engine (`nnodes` > 1), torchrun-style:

    # node 0: the engine (the one scheduler) and ranks 0 .. per_node-1
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ENGINE_CORE_AUTHKEY=secret python -c \
        "from engine_core import LLM; LLM('tiny-llama', tensor_parallel_size=2, nnodes=2).generate(...)"
    # node 1 (any start order): ranks per_node .. 2*per_node-1
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ENGINE_CORE_AUTHKEY=secret NODE_RANK=1 \
        python -m engine_core.executor.launch --nproc-per-node 1

Each worker connects to the engine on MASTER_PORT + 1 (retrying until it listens), names its rank,
receives the engine's resolved config and the model folder's parsed config (the model folder must
exist at the same path on every node), and then is exactly a spawned worker (`worker.worker_main`).
The launcher exits when its workers do (the engine's shutdown, or its end: a closed connection), with
a non-zero status if one failed; Ctrl-C or SIGTERM on the launcher ends its workers too (daemons), and
the engine then reports them dead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing.connection import Client

import torch.multiprocessing as mp

from engine_core.executor.multiproc_executor import CONTROL_PORT_OFFSET, STARTUP_TIMEOUT_S, rendezvous
from engine_core.executor.worker_proc import worker_main


def remote_worker_main(rank: int, parent_pid: int) -> None:
    addr, port, key = rendezvous()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            conn = Client((addr, port + CONTROL_PORT_OFFSET), authkey=key)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.send(rank)
    spec, config, model_config = conn.recv()
    worker_main(spec, config, model_config, conn, parent_pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", "-1")),
                        help="this machine's index, >= 1 (node 0 is the engine's); default: $NODE_RANK")
    parser.add_argument("--nproc-per-node", type=int, required=True,
                        help="ranks on each machine: tensor_parallel_size x pipeline_parallel_size / nnodes")
    args = parser.parse_args(argv)
    if args.node_rank < 1:
        parser.error(f"--node-rank (or NODE_RANK) must be an int >= 1, got {args.node_rank}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be an int >= 1, got {args.nproc_per_node}")
    rendezvous()  # a clear error now rather than in every worker
    context = mp.get_context("spawn")
    first = args.node_rank * args.nproc_per_node
    procs = [context.Process(target=remote_worker_main, args=(rank, os.getpid()), name=f"engine-worker-{rank}",
                             daemon=True)
             for rank in range(first, first + args.nproc_per_node)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
