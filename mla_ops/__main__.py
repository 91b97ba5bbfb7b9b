"""Command line: ``python -m mla_ops demo [--full]``, ``python -m mla_ops generate --model DIR ...``."""

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "mla_ops.demo", "generate": "mla_ops.serving.generation"}
    if not argv or argv[0] not in commands:
        print("usage: python -m mla_ops {demo,generate} [options]   (python -m mla_ops generate --help)")
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    import importlib

    importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
