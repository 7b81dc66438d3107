"""The ``lora-graph`` command and ``python -m lora_graph``: :func:`lora_graph.cli.main`,
imported here, so a Ctrl-C in the second or two torch takes to import ends the command
quietly with status 130, as a Ctrl-C later does (it printed a KeyboardInterrupt
traceback). Nothing here imports torch."""

from __future__ import annotations

import signal
import sys

EXIT_INTERRUPTED = 130  # (lora_graph.cli's, which imports torch)


def main() -> int:
    """Run the command line (``sys.argv``); its exit status. SIGINT is blocked while the
    command's modules import (torch's import can swallow a KeyboardInterrupt, leaving
    numpy half-imported, or abort in C++) and looked for after."""
    blocking = hasattr(signal, "pthread_sigmask")
    if blocking:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from lora_graph.cli import main as cli_main
    except KeyboardInterrupt:  # (where signals cannot be blocked)
        return EXIT_INTERRUPTED
    finally:
        interrupted = blocking and signal.SIGINT in signal.sigpending()
        if interrupted:
            signal.sigwait({signal.SIGINT})  # (taken: it ends the command here)
        if blocking:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if interrupted:
        return EXIT_INTERRUPTED
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
