"""The ``phalanx`` command: ``run``, ``join``, ``stacks``, ``demo``, ``bench`` and ``export``.

Each subcommand's module is imported only when it is used, so ``phalanx --help``
is quick. A usage error (:class:`phalanx.ConfigError`) is printed as one line and
exits with status 2; any other phalanx error exits with status 1, also in one line.

Example:
    >>> main(["--version"])
    phalanx 0.1.0
    0
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, Sequence

from . import __version__
from .checkpoint import export
from .errors import ConfigError, PhalanxError, usage

COMMANDS = {
    "run": ("phalanx.launch.run", "start N workers running a script (like torchrun); see `phalanx run --help`"),
    "join": ("phalanx.launch.join", "add workers to a running `phalanx run --elastic` job"),  # elastic
    "stacks": ("phalanx.launch.stacks", "print every worker's Python stacks of a running job, one block per rank"),
    "demo": ("phalanx.bench.demo", "train a small CNN on bundled digits with 1, then 2 workers, and compare"),
    "bench": ("phalanx.bench.cli", "measure throughput and scaling of the strategies"),
    "export": ("phalanx.cli:export_main", "write a checkpoint's model as a plain state_dict file (CKPT OUT)"),
}
# The apps in phalanx.bench need the packages of the extra phalanx[bench], which a core install lacks.
NEEDS = {"demo": ("sklearn",), "bench": ("sklearn", "matplotlib")}

HELP = "usage: phalanx [--help] [--version] COMMAND [args]\n\n" \
       "Data-parallel training for any PyTorch model.\n\ncommands:\n" + \
       "".join(f"  {name:<7}{text}\n" for name, (_, text) in COMMANDS.items()) + \
       "\nexamples:\n  phalanx demo\n  phalanx run -n 2 train.py --epochs 3\n  phalanx bench --help\n"


def _entry(command: str) -> Callable[[list[str]], int | None]:
    """``main`` of the command's module, imported now; a module this installation lacks is a usage error."""
    module, _, function = COMMANDS[command][0].partition(":")
    missing = [name for name in NEEDS.get(command, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(usage(f"`phalanx {command}` without {' and '.join(missing)}",
                                "the packages of the extra phalanx[bench] (scikit-learn, matplotlib)",
                                "pip install 'phalanx[bench]'"))
    try:
        return getattr(importlib.import_module(module), function or "main")
    except ImportError as err:
        if err.name is None or not module.startswith(err.name):  # a missing dependency inside: show it
            raise
        raise ConfigError(usage(f"`phalanx {command}`", f"the module {module}, which this installation lacks",
                                "Reinstall phalanx (`make setup`) or update your checkout.")) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phalanx`` script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help", "help"):
            print(HELP, end="", file=sys.stdout if args else sys.stderr)
            return 0 if args else 2
        if args[0] in ("-V", "--version"):
            print(f"phalanx {__version__}")
            return 0
        if args[0] not in COMMANDS:
            raise ConfigError(usage(f"`phalanx {args[0]}`", "one of " + ", ".join(COMMANDS),
                                    "See `phalanx --help`."))
        status = int(_entry(args[0])(args[1:]) or 0)
        if argv is None and args[0] == "run":
            _exit_now(status)
        return status
    except PhalanxError as err:
        print(f"phalanx: error: {err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ConfigError) else 1
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130


def export_main(argv: list[str]) -> int:
    """``phalanx export CKPT OUT``: the model of a checkpoint as the plain ``state_dict`` ``px.save`` writes."""
    import argparse

    parser = argparse.ArgumentParser(prog="phalanx export", description="Write the model of a px.save_checkpoint "
                                     "checkpoint (a DCP directory, or a one-file checkpoint of an earlier version) "
                                     "as a plain state_dict that loads into the unwrapped model.")
    parser.add_argument("checkpoint", help="the checkpoint directory (or file)")
    parser.add_argument("out", help="the file to write, e.g. model.pt")
    args = parser.parse_args(argv)
    state = export(args.checkpoint, args.out)
    numel = sum(v.numel() for v in state.values() if hasattr(v, "numel"))
    print(f"wrote {len(state)} entries ({numel:,} values) to {args.out}; load with "
          "Net().load_state_dict(torch.load(path, weights_only=True))")
    return 0


def _exit_now(status: int) -> None:
    """End the ``phalanx run`` process now that its workers and servers are stopped.

    Unloading torch at interpreter exit takes from 0.2 s to 2 s on a busy machine, which a
    user (or a scheduler) waiting for a failed job to end would otherwise wait for.
    """
    import atexit
    import logging
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
