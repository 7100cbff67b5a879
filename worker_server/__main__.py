"""`python -m worker_server`: run one shard server in the foreground."""

from __future__ import annotations

import argparse
import sys

from worker_server.options import add_serve_arguments, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker_server", description="Run a smoltorrent shard server."
    )
    add_serve_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
