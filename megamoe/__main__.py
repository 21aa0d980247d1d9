"""`python -m megamoe COMMAND`: command-line tools (bench: docs/design.md). Run under torchrun for expert parallelism."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from megamoe.bench.baselines import PEERS
from megamoe.bench.run import BASELINE, DTYPES, run_bench
from megamoe.bench.workloads import WORKLOADS, BenchUsageError, comma_names
from megamoe.config import BACKENDS

TIMED_BACKENDS = (BASELINE, *(b for b in BACKENDS if b != "auto"))


def _add_bench(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser(
        "bench",
        help="time megamoe's backends against a TorchTitan-style baseline (and optional peers)",
        description="Gate each backend against megamoe.reference, then time fwd and fwd+bwd (docs/design.md). "
        f"Speed-ups are against {BASELINE!r}, what TorchTitan users run (token sort, torch._grouped_mm, "
        "all_to_all with host-side split sizes; megamoe.bench.baselines), which always runs; megamoe's portable "
        "'torch' backend is printed as 'portable'. "
        "Under `torchrun --nproc-per-node=N` the N ranks form one expert-parallel group.",
    )
    bench.add_argument(
        "--workload", action="extend", metavar="NAME", type=comma_names(WORKLOADS),
        help=f"repeatable or comma list of {', '.join(WORKLOADS)} (default: the six models on a GPU, cpu-small on CPU)",
    )
    bench.add_argument(
        "--backend", action="extend", metavar="NAME", type=comma_names(TIMED_BACKENDS),
        help=f"repeatable or comma list of {', '.join(TIMED_BACKENDS)} "
        f"(default: torch and triton where they run; {BASELINE} always runs, as the baseline)",
    )
    bench.add_argument(
        "--peers", action="extend", metavar="NAME", type=comma_names(PEERS),
        help=f"repeatable or comma list of {', '.join(PEERS)}: other MoE implementations timed too when installed "
        "(one GPU only; an absent one is a note, not an error). liger autotunes at run time: minutes per shape",
    )
    bench.add_argument("--tokens", type=int, metavar="N", help="tokens per GPU (default: the workload's)")
    bench.add_argument("--routing", choices=("balanced", "skewed", "both"), default="both")
    bench.add_argument("--iters", type=int, help="timed iterations (default: 20 on a GPU, 5 on CPU)")
    bench.add_argument("--warmup", type=int, help="untimed iterations first (default: 5 on a GPU, 2 on CPU)")
    bench.add_argument(
        "--rounds", type=int,
        help="alternating rounds: each round times every backend and pass (and the matmul ceiling) once, in the "
        "next round of a balanced order (n turns: balanced over n rounds, 2n for odd n); a record's ms is the "
        "median of its rounds' medians (default: 3 on a GPU, 1 on CPU)",
    )
    bench.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on a GPU, fp32 on CPU")
    bench.add_argument(
        "--experts-per-gpu", type=int, metavar="N",
        help="cap on experts per GPU (default: deepseek-v3 and kimi-k2 keep 32 on one GPU); "
        "a workload is also halved until it fits the free GPU memory",
    )
    bench.add_argument("--json", metavar="PATH", help="write the results as a JSON list of records (rewritten after "
                       "each workload and routing, so a run stopped early keeps what it finished)")
    bench.add_argument(
        "--plot", metavar="PATH",
        help="draw TFLOP/s per workload and backend (one panel per pass and routing, the bf16 matmul ceiling as a "
        "line) to PATH (.png, .svg, .pdf); needs matplotlib",
    )
    bench.add_argument(
        "--from-json", nargs="+", metavar="FILE",
        help="with --plot: draw the records of earlier --json runs instead of timing anything",
    )
    return bench


# Options that only shape a timed run; with --from-json nothing is timed, so they would be silently ignored.
TIMING_OPTIONS = (
    "workload", "backend", "peers", "tokens", "iters", "warmup", "rounds", "dtype", "experts_per_gpu", "json",
)


def _check_writable(option: str, path: str, bench: argparse.ArgumentParser) -> None:
    """A usage error naming option unless a file can be written at path: not empty, not a folder nor a name ending with
    a path separator, in a folder that exists and takes a new file (tried with a temporary file, which is gone at
    once). A symbolic link is checked where it points."""
    if not path:  # e.g. --json "$UNSET": an error, not a run that silently writes nothing
        bench.error(f"--{option}: empty path; give a file path")
    folder = Path(path).resolve().parent
    if Path(path).is_dir():
        bench.error(f"--{option} {path}: is a folder; give a file path")
    if path.endswith(os.sep):  # a folder's name: Path drops the separator, open() fails on it after the run
        bench.error(f"--{option} {path}: ends with {os.sep}, a folder's name; give a file path")
    if not folder.is_dir():
        bench.error(f"--{option} {path}: folder {folder} does not exist")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        bench.error(f"--{option} {path}: cannot write in folder {folder} ({e.strerror})")


def _check_outputs(args, bench: argparse.ArgumentParser) -> None:
    """--json and --plot paths that cannot be written, or that name one file, are errors before anything is timed, not
    after."""
    if args.plot is not None:
        from megamoe.bench.plot import check_plot_path

        _check_writable("plot", args.plot, bench)
        try:
            check_plot_path(args.plot)  # needs matplotlib: an ImportError says how to install it
        except (ValueError, ImportError) as e:
            bench.error(str(e))
    if args.json is not None:
        _check_writable("json", args.json, bench)
    if args.json is not None and args.plot is not None and Path(args.json).resolve() == Path(args.plot).resolve():
        bench.error(f"--json {args.json} and --plot {args.plot} name the same file: the plot would overwrite the "
                    "records")


def _plot_from_json(args, bench: argparse.ArgumentParser) -> int:
    from megamoe.bench.plot import load_records, plot_records

    if args.plot is None:
        bench.error("--from-json draws saved records: give --plot PATH")
    given = [f"--{name.replace('_', '-')}" for name in TIMING_OPTIONS if getattr(args, name) is not None]
    if given:
        bench.error(f"{', '.join(given)}: not used with --from-json, which draws saved records without timing")
    _check_outputs(args, bench)
    try:
        records = load_records(args.from_json)
        if args.routing != "both":
            records = [r for r in records if r["routing"] == args.routing]
            if not records:
                raise ValueError(f"--routing {args.routing}: no record of that routing in {', '.join(args.from_json)}")
        path = plot_records(records, args.plot)
    except (ValueError, ImportError, OSError) as e:
        bench.error(str(e))
    print(f"wrote the plot of {len(records)} records from {len(args.from_json)} file(s) to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = _add_bench(commands)
    args = parser.parse_args(argv)

    if args.command == "bench":
        if args.from_json:
            return _plot_from_json(args, bench)
        _check_outputs(args, bench)  # before timing: fail in a second, not after an hour of benchmarks
        for option in ("tokens", "iters", "rounds", "experts_per_gpu"):
            value = getattr(args, option)
            if value is not None and value < 1:
                bench.error(f"--{option.replace('_', '-')} must be >= 1, got {value}")
        if args.warmup is not None and args.warmup < 0:
            bench.error(f"--warmup must be >= 0, got {args.warmup}")
        try:
            return run_bench(
                workloads=args.workload,
                backends=args.backend,
                routing=args.routing,
                tokens=args.tokens,
                iters=args.iters,
                warmup=args.warmup,
                dtype=args.dtype,
                experts_per_gpu=args.experts_per_gpu,
                json_path=args.json,
                plot_path=args.plot,
                peers=args.peers,
                rounds=args.rounds,
            )
        except BenchUsageError as e:  # e.g. --experts-per-gpu below a workload's k: raised before any timing
            bench.error(str(e))
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun (seen on CPUs, with gloo) the process group's worker threads now and then abort the
        # interpreter's finalization ("terminate called without an active exception", SIGABRT) after the results
        # are written, with or without destroy_process_group (2 CPU ranks beside two busy loops: 6 of 104 runs; 0
        # of 54 leaving as here). The outputs are closed and flushed: leave without finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
