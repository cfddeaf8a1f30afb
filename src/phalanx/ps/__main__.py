"""Command line of the parameter servers.

``python -m phalanx.ps serve [--host H] [--port P] [--checkpoint F] ...`` runs one server
until SIGTERM. This is what :func:`phalanx.ps.launcher.start_servers` starts.
(How each placement policy spreads the reference models: ``python -m phalanx.bench.placement``.)

These live here, not in ``server.py``, so that ``python -m`` does not run a module the
package has already imported.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import PhalanxError
from .config import PSConfig
from .server import Server
from .wire import require_zmq


def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the server's math is small element-wise work; leave the cores to the workers
    cfg = PSConfig.from_environ()
    try:
        server = Server(args.host, args.port, token=cfg.token, threads=args.threads, checkpoint=args.checkpoint,
                        checkpoint_every=args.checkpoint_every, index=args.index,
                        max_bytes=None if args.max_mb is None else int(args.max_mb * 2**20),
                        round_timeout=args.round_timeout or cfg.timeout_s, max_message_mb=args.max_message_mb).start()
    except (PhalanxError, require_zmq().ZMQError) as err:  # a bad interface, a port taken
        sys.exit(f"phalanx ps server {args.index}: {err}")
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(server.address)
        os.replace(tmp, args.port_file)  # readers see the whole address or nothing
    print(f"phalanx ps server {args.index} serving on {server.address} ({len(server.store.shards)} shards)",
          file=sys.stderr, flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phalanx.ps", description="phalanx parameter servers")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run one parameter server until SIGTERM")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (non-loopback needs PHALANX_PS_TOKEN)")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--index", type=int, default=0, help="this server's index in the job")
    s.add_argument("--threads", type=int, default=2, help="handler threads")
    s.add_argument("--checkpoint", default=None, help="shard file: resumed from if present, written on exit")
    s.add_argument("--checkpoint-every", type=float, default=None, help="also write it every this many seconds")
    s.add_argument("--port-file", default=None, help="write the bound address here once serving")
    s.add_argument("--max-message-mb", type=int, default=1024, help="drop a peer that sends a larger frame (MiB)")
    s.add_argument("--max-mb", type=float, default=None, help="bound what registrations may allocate (MiB)")
    s.add_argument("--round-timeout", type=float, default=None,
                   help="abandon a synchronous round after this many seconds (default PHALANX_PS_TIMEOUT)")
    args = parser.parse_args(argv)
    serve(args)


if __name__ == "__main__":
    main()
