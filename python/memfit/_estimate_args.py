"""The `memfit estimate` command line: its options (``add_estimate_arguments``), the
memory.Setup they describe (``estimate_setup``), and a parse of such a command line on
its own (``parse_estimate``: what demo.py draws its recipes chart from).

Below both cli.py, which adds these options to its ``estimate`` command, and demo.py,
which reads RECIPES_EXAMPLE with them: imports go cli -> demo -> here -> memory, never
back up (tests/test_import_graph.py). ``int_at_least`` is the argparse type of every
size option of the command line, estimate's and the others'."""

from __future__ import annotations

import argparse


def int_at_least(minimum: int, why: str = "", maximum: int | None = None):
    """An argparse type: an int from minimum to maximum (default memory.MAX_SIZE);
    argparse then says which option is wrong. The range check is memory.size_problem,
    the one check of every size the estimator and profile take."""
    from memfit.memory import MAX_SIZE, shown, size_problem

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        try:
            v = int(text)
        except ValueError:
            if digits.isdigit():  # longer than Python converts (4300 digits): too large anyway
                v = 10 ** (len(digits) - 1) * (-1 if text.strip().startswith("-") else 1)
            else:
                raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)}") from None
        problem = size_problem(v, minimum, MAX_SIZE if maximum is None else maximum)
        if problem:
            raise argparse.ArgumentTypeError(problem + (why if v < minimum else ""))
        return v

    parse.__name__ = "int"
    return parse


POSITIVE = int_at_least(1)


def add_estimate_arguments(e: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `memfit estimate`'s arguments to ``e`` (cli's ``estimate`` subparser, or a
    parser of its own: parse_estimate); returns ``e``."""
    e.add_argument("model", help="a preset (gpt2, gpt2-medium, gpt2-xl, roberta-base, llama-1b, ...) "
                                 "or a path to a Hugging Face config.json")
    e.add_argument("--batch", type=POSITIVE, default=8)
    e.add_argument("--seq", type=POSITIVE, default=1024)
    e.add_argument("--precision", default=None, choices=["fp32", "fp16", "bf16", "bf16-pure"],
                   help="adds the line 'your setting' (with --optimizer: default fp32) to the comparison table")
    e.add_argument("--optimizer", default=None,
                   help="adamw (default), adamw8bit, adamw4bit, muon, muon8bit, ...: adds the line 'your "
                        "setting' (with --precision: default fp32) to the comparison table")
    e.add_argument("--kahan", action="store_true",
                   help="bf16-pure weights keep a Kahan compensation buffer (memfit.optim's kahan=True): "
                        "+2 bytes per parameter")
    e.add_argument("--checkpoint", default="none", choices=["none", "every", "sqrt"])
    e.add_argument("--micro-batch", type=POSITIVE, default=None, help="at most --batch (default: --batch)")
    e.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    e.add_argument("--gpu", default=None, help="t4, l4, a10, v100, a100-40, a100-80, h100, h200 or a size like 24GB")
    e.add_argument("--cpu", action="store_true",
                   help="training on the CPU (no CUDA context; bf16 autocast only where a timed training "
                        "step of a small GPT is faster in bf16 on this CPU, else fp32: memfit.hardware)")
    e.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="the host memory the offload recipes may fill: colab (12.7 GB, a free Colab) or a "
                        "size like 64GB (default: this machine's physical memory); not with --cpu, which "
                        "draws no recipes")
    e.add_argument("--plot", nargs="?", const="memfit-estimate.png", default=None, metavar="PATH",
                   help="draw each recipe's GPU and host bytes as stacked bars into PATH "
                        "(default memfit-estimate.png; needs matplotlib)")
    e.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return e


def parse_estimate(argv: list) -> argparse.Namespace:
    """The arguments of `memfit estimate ARGV...`, as cli's parser reads them."""
    return add_estimate_arguments(argparse.ArgumentParser(prog="memfit estimate")).parse_args(argv)


def estimate_setup(args):
    """The memory.Setup that `memfit estimate`'s options describe (not yet validated)."""
    from memfit import memory as M

    return M.Setup(batch=args.batch, seq=args.seq, precision=args.precision or "fp32",
                   optimizer=args.optimizer or "adamw", checkpoint=args.checkpoint, micro_batch=args.micro_batch,
                   attention=args.attention, gpu=not args.cpu, kahan=args.kahan)
