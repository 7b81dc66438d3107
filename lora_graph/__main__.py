"""The ``lora-graph`` command and ``python -m lora_graph``: :func:`lora_graph.cli.main`,
imported here, so a Ctrl-C in the second or two torch takes to import ends the command
quietly with status 130, as a Ctrl-C later does (it printed a KeyboardInterrupt
traceback). Nothing here imports torch."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # (lora_graph.cli's, which imports torch)


def main() -> int:
    """Run the command line (``sys.argv``); its exit status."""
    try:
        from lora_graph.cli import main as cli_main
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
