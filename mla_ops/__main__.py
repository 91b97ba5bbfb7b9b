"""Command line: ``python -m mla_ops demo [--full]``, ``python -m mla_ops generate --model DIR ...``.

argparse's conventions: help on stdout with status 0; a usage error on stderr with status 2."""

import sys

COMMANDS = {"demo": "mla_ops.demo", "generate": "mla_ops.serving.cli"}
USAGE = "usage: python -m mla_ops {demo,generate} [options]   (python -m mla_ops generate --help)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\npython -m mla_ops: error: {problem} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        raise SystemExit(2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
