"""The launcher: ``collectives-run`` / ``python -m collectives.run``, torchrun's flags.

Starts ``--nproc-per-node`` copies of a script (or ``-m module``, or with
``--no-python`` any program) with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK/NODE_RANK, MASTER_ADDR and MASTER_PORT set, prefixes each whole line a
rank prints with ``[rank] `` (a line left unfinished with no more output for 0.3 s, such
as a prompt, is written as one), gives rank 0 the launcher's stdin (as mpiexec; the others read
/dev/null), and supervises them: when one rank fails the others
get SIGTERM, then SIGKILL after ``--term-timeout`` seconds, and the launcher exits
non-zero with a summary (the rank, its exit code or signal, its last stderr lines).
SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to every rank. Each rank
runs in its own session, and its whole process group is signalled, so no
grandchild outlives the launcher; a launcher killed by SIGKILL leaves that to a small
reaper process it starts (:mod:`collectives.launcher.reaper`), which kills every rank's
process group it left running.

Example:
    collectives-run --nproc-per-node 4 train.py --epochs 3
    python -m collectives.run --standalone --nproc_per_node=2 -m mypkg.main
"""

import sys

from .cli import Config, build_parser
from .ports import free_port
from .supervisor import Launcher

__all__ = ["main", "Config", "Launcher", "build_parser", "free_port"]


def main(argv=None):
    """Entry point of ``collectives-run``; returns through sys.exit with the job's status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = Config(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        code = Launcher(cfg).run()
    except ValueError as e:
        print(f"collectives-run: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)
