"""Command line: ``python -m mla_ops demo [--full]``, ``python -m mla_ops generate --model DIR ...``.

argparse's conventions: help on stdout with status 0; a usage error on stderr with status 2."""

import sys

COMMANDS = {"demo": "mla_ops.demo", "generate": "mla_ops.serving.cli"}
USAGE = "usage: python -m mla_ops {demo,generate} [options]   (python -m mla_ops generate --help)"
HELP = f"""{USAGE}

mla-ops: prefill attention over a chunked, paged latent context for DeepSeek-style MLA models
(PyTorch custom ops, Triton kernels, an exact torch reference).

commands:
  demo      one DeepSeek-V2-Lite-shaped MLA layer on a mixed prefill batch: the chunk count of each
            schedule, mla_prefill on each policy and with per-request routing, each checked against a
            dense float64 reference, then a tiny model under torch.compile (--full: vLLM PR
            #50613's full-size batch; --dtype, --backend, --seed)
  generate  greedy generation from a checkpoint directory (config.json + safetensors weights of an MLA
            model): python -m mla_ops generate --model DIR --prompt-ids 1,2,3 [--max-new-tokens N]

python -m mla_ops COMMAND --help shows a command's options."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\npython -m mla_ops: error: {problem} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        raise SystemExit(2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
