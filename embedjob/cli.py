"""`embedjob run / submit / status / bench / inspect`.

Exit codes: 0 when the shard finished (error rows included); 2 when the job spec or
the command line is wrong; 1 when the job could not run for another reason (unreadable
input, unwritable output). Either failure prints one line that says what to change.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import yaml

from embedjob.job import Job, JobError, describe, load_job

logger = logging.getLogger("embedjob")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except JobError as exc:
        print(f"embedjob: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"embedjob: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        logger.debug("traceback", exc_info=True)
        return 1
    except KeyboardInterrupt:
        print("embedjob: interrupted; committed parts are kept and a rerun resumes", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedjob", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="embed one shard of a job (all of it by default)")
    _job_arguments(run)
    run.add_argument("--shard", help="I/N: run shard I of N (default: SLURM_ARRAY_TASK_ID/COUNT, else 0/1)")
    run.add_argument("--overwrite", action="store_true", help="replace this shard's earlier output instead of resuming")
    run.set_defaults(func=_cmd_run)

    bench = sub.add_parser("bench", help="benchmark the encoder four ways on one GPU and print a table")
    from embedjob.bench import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    inspect = sub.add_parser("inspect", help="print the job with every default filled in, or every key")
    inspect.add_argument("job", nargs="?", help="job YAML; without it, list every key and its allowed values")
    inspect.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML file (see jobs/)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a job key, e.g. --set output.path=out2"
    )


def _setup_logging(verbose: int) -> None:
    """embedjob logs at INFO (what a batch log should show), -v adds DEBUG; other
    libraries only warn."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("embedjob").setLevel(logging.DEBUG if verbose else logging.INFO)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _cmd_run(args: argparse.Namespace) -> int:
    from embedjob.runner import Shard, run_job

    job = load_job(args.job, args.set)
    shard = Shard.parse(args.shard)
    stats = run_job(job, shard, overwrite=args.overwrite)
    print(_summary(job, stats), file=sys.stderr)
    return 0


def _summary(job: Job, stats: dict[str, Any]) -> str:
    where = f"shard {stats.get('shard', 0)}/{stats.get('num_shards', 1)}"
    if stats.get("skipped"):
        return f"{where}: already complete in {job.output.path} ({stats.get('rows', 0)} rows); nothing to do"
    return (
        f"{where}: {stats['rows']} rows ({stats['errors']} errors) in {stats['seconds']:.1f} s, "
        f"{stats['items_per_second']:.1f} rows/s; {stats['num_graphs']} graphs, hit rate {stats['hit_rate']:.0%}, "
        f"padding {stats['padding_waste']} tokens; output in {job.output.path}"
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from embedjob.bench import main as bench_main

    return bench_main(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.job is None:
        print(describe())
        return 0
    job = load_job(args.job, args.set)
    print(yaml.safe_dump(job.to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
