"""``python -m mla_ops generate``: greedy generation from a checkpoint directory on the command line.

argparse's conventions: a bad argument value (including a token id past the checkpoint's vocabulary,
or a device this machine lacks) is a usage error, exit status 2 with argparse's usage line and one
error line; an error while loading or generating exits 1 with one line (``--debug`` re-raises it,
traceback and all).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from .. import _checks as checks
from ..models.checkpoint_files import read_json_object
from ..models.wrappers import unwrap
from .generation import GenerationStats, Generator
from .prompts import check_eos, is_int

PROG = "python -m mla_ops generate"
_CLI_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids``: "1,2,3", "1, 2, 3" or "1 2 3" (never "123")."""
    stripped = text.strip()
    if not stripped:
        raise argparse.ArgumentTypeError("empty: give token ids separated by commas or spaces, e.g. 1,2,3")
    ids = []
    for piece in re.split(r"\s*,\s*|\s+", stripped):
        if re.fullmatch(r"[0-9]+", piece):
            ids.append(int(piece))
        elif re.fullmatch(r"-[0-9]+", piece):
            raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {piece} in {text!r}")
        elif not piece:
            raise argparse.ArgumentTypeError(f"an empty token id between commas in {text!r}")
        else:
            raise argparse.ArgumentTypeError(
                f"{piece!r} is not a token id in {text!r} (give ints separated by commas or spaces, e.g. 1,2,3)")
    return ids


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
        return value
    return parse


def _checkpoint_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory (give a checkpoint directory: config.json + "
                                         "safetensors)")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json: not a checkpoint directory")
    return text


def _dtype(text: str) -> torch.dtype:
    try:
        return checks.model_dtype(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose from {', '.join(_CLI_DTYPES)}") from None


def _device(text: str) -> torch.device:
    try:
        return checks.check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def one_line(error: BaseException) -> str:
    """An error as one line: its words, with the exception's name unless it is a usual argument or file error."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, (ValueError, TypeError, OSError)) else f"{type(error).__name__}: {text}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Greedy generation from a checkpoint directory.")
    parser.add_argument("--model", required=True, type=_checkpoint_dir, metavar="DIR",
                        help="checkpoint directory: config.json + safetensors")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt as text (needs DIR/tokenizer.json and the tokenizers package); repeatable")
    parser.add_argument("--prompt-ids", action="append", default=[], type=_token_ids, metavar="IDS",
                        help='a prompt as token ids separated by commas and/or spaces: "1,2,3", "1, 2, 3" or '
                             '"1 2 3" (three tokens); repeatable')
    parser.add_argument("--max-new-tokens", type=_int_at_least(0), default=32, metavar="N",
                        help="new tokens per prompt, >= 0 (default 32)")
    parser.add_argument("--dtype", type=_dtype, default=None,
                        help=f"{', '.join(_CLI_DTYPES)} (default: the checkpoint's)")
    parser.add_argument("--device", type=_device, default=None, help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--block-size", type=_int_at_least(1), default=16, metavar="N",
                        help="rows per cache block, >= 1 (default 16)")
    parser.add_argument("--absorb-max-query-len", type=_int_at_least(0), default=None, metavar="N",
                        help="requests with at most N new tokens and a cached context take the absorbed path; "
                             "0: none (default: the library's threshold)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each step (device plans)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at config.json's eos_token_id")
    parser.add_argument("--debug", action="store_true", help="on an error, raise it with its full traceback")
    return parser


class _Progress:
    """The progress line on stderr, after every step."""

    def __init__(self, total: int):
        self.total, self.shown = total, False

    def __call__(self, stats: GenerationStats) -> None:
        done = stats.generated_tokens
        bar = "#" * (30 * done // max(self.total, 1))
        rate = done / stats.seconds if stats.seconds else 0.0
        sys.stderr.write(f"\r[{bar:<30}] {done}/{self.total} tokens  {rate:.1f} tok/s")
        sys.stderr.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            self.shown = False


def _check_ids_in_vocab(parser, prompt_ids: list[list[int]], vocab_size, model_dir: str) -> None:
    if not is_int(vocab_size) or vocab_size < 1:
        return  # loading the checkpoint reports a bad vocab_size
    for ids in prompt_ids:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            parser.error(f"argument --prompt-ids: token id {bad[0]} is past the vocabulary of {model_dir} "
                         f"(vocab_size {vocab_size}: ids 0..{vocab_size - 1})")


def _config_eos(raw: dict, vocab_size: int) -> list[int] | None:
    """config.json's eos_token_id: ids outside the vocabulary (tiny test models keep the
    tokenizer's) are dropped with a note, since the model can never produce them."""
    eos = raw.get("eos_token_id")
    if eos is None:
        return None
    try:
        ids = sorted(check_eos(eos, sys.maxsize))
    except TypeError as e:
        raise ValueError(f"config.json's {e}") from None
    except ValueError:
        raise ValueError(f"config.json's eos_token_id {eos!r} holds a negative id") from None
    inside = [t for t in ids if t < vocab_size]
    outside = [t for t in ids if t >= vocab_size]
    if outside:
        print(f"note: config.json's eos_token_id {', '.join(map(str, outside))} is past the vocabulary "
              f"(vocab_size {vocab_size}) and never generated; "
              f"{'stopping at ' + ', '.join(map(str, inside)) if inside else 'no stop token'}", file=sys.stderr)
    return inside


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    progress = _Progress(0)
    try:
        _run(parser, args, progress)
    except KeyboardInterrupt:
        progress.end()
        print(f"{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        progress.end()
        if args.debug:
            raise
        print(f"{PROG}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, progress: _Progress) -> None:
    tokenizer = None
    if args.prompt:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            parser.error("--prompt needs the `tokenizers` package; pass --prompt-ids instead")
        tokenizer_path = os.path.join(args.model, "tokenizer.json")
        if not os.path.exists(tokenizer_path):
            parser.error(f"--prompt needs {tokenizer_path}; pass --prompt-ids instead")
    if not args.prompt and not args.prompt_ids:
        parser.error("give at least one --prompt or --prompt-ids")
    raw, _ = unwrap(read_json_object(os.path.join(args.model, "config.json")))  # a wrapper's: its text model's
    _check_ids_in_vocab(parser, args.prompt_ids, raw.get("vocab_size"), args.model)  # before loading the weights
    if args.prompt:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    prompts = [tokenizer.encode(text).ids for text in args.prompt] if tokenizer else []
    for text, ids in zip(args.prompt, prompts):
        if not ids:
            parser.error(f"argument --prompt: {text!r} encodes to no tokens")
    prompts += args.prompt_ids

    from ..models.decoder import MLAForCausalLM

    started = time.perf_counter()
    model = MLAForCausalLM.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    vocab_size = model.config.vocab_size
    _check_ids_in_vocab(parser, args.prompt_ids, vocab_size, args.model)
    eos = None if args.ignore_eos else _config_eos(raw, vocab_size)
    generator = Generator(model, block_size=args.block_size, absorb_max_query_len=args.absorb_max_query_len,
                          compile=args.compile)
    progress.total = len(prompts) * args.max_new_tokens
    outputs = generator.generate(prompts, args.max_new_tokens, eos_token_id=eos, callback=progress)
    progress.end()
    stats = generator.stats
    for prompt, new in zip(prompts, outputs):
        print(tokenizer.decode(prompt + new) if tokenizer else ",".join(map(str, new)))
    rate = f"{stats.generated_tokens / stats.seconds:.1f} tok/s, " if stats.seconds > 0 else ""
    print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s ({rate}{stats.steps} steps); prompt tokens "
          f"{stats.prompt_tokens}, cached {stats.cached_tokens} ({stats.hit_rate:.0%})", file=sys.stderr)
