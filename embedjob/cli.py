"""`embedjob run / submit / status / verify / report / export / bench / inspect`.

Exit codes: 0 when the shard finished (error rows included), or the output verified
intact; 2 when something the user names must change: the job spec or the command
line, an input.path or model.path that cannot be used (a checkpoint torch refuses to
unpickle included), an output.path that holds another job's output or a shard another
process writes; 1 when the job could not run for another reason (a full disk or an
unwritable output, at start as mid-run; a failed rank; a shard that `run --engine ray`
could not finish; sbatch failing; more error rows than `runtime.max_error_rate`
allows), or `verify` (`status --verify`) found a damaged output; 143 (SIGTERM) or 130
(SIGINT, Ctrl-C) when a signal stopped a run, which commits what it had encoded first
(`stopping`). Every failure prints one
line (a Ray run: one per shard that failed, then one); the libraries' warnings go to the
log only with -v.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from embedjob.config import Job, JobError, RunFailure, describe, load_job, prepare_process, reference_markdown
from embedjob.io.checkpoint import OutputError
from embedjob.io.export import FLAT_LIMIT, FORMATS, ROWS_PER_FILE, export_output, summary
from embedjob.io.writer import ErrorRateExceeded
from embedjob.report.counts import codes_text, plural, route_warnings
from embedjob.stopping import Stopped, on_signals

logger = logging.getLogger("embedjob")

STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""The exit codes of a run a signal stopped (130, 143)."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # `embedjob status | head`: the reader left; nothing is wrong with the job.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except JobError as exc:
        print(f"embedjob: error: {exc}", file=sys.stderr)
        return 2
    except pickle.UnpicklingError as exc:
        # torch (weights_only) refusing a pickled checkpoint: the model.path must change.
        print(f"embedjob: error: {_unsafe_checkpoint(exc)}", file=sys.stderr)
        logger.debug("traceback", exc_info=True)
        return 2
    except Exception as exc:
        # Whatever a library raised (a network error, a bug): one line; -v logs the traceback.
        print(f"embedjob: failed: {_failure(exc)}", file=sys.stderr)
        logger.debug("traceback", exc_info=True)
        return 1
    except Stopped as exc:
        print(f"embedjob: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("embedjob: interrupted; committed parts are kept and a rerun resumes", file=sys.stderr)
        return 130


def _unsafe_checkpoint(exc: pickle.UnpicklingError) -> str:
    """One line for torch's weights-only refusal, which spans paragraphs and suggests
    the unsafe way round: what it refused, and what to use instead."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    refused = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
    return (
        f"the model checkpoint holds pickled objects that torch refuses to load ({refused}); "
        "set model.path to a checkpoint in safetensors format"
    )


def _failure(exc: BaseException) -> str:
    """The first line of an unexpected failure (-v logs the traceback); our own
    failures (OutputError, RunFailure, ...) already say what they are."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return first if isinstance(exc, (OutputError, ErrorRateExceeded, RunFailure)) else f"{type(exc).__name__}: {first}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedjob", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="embed one shard of a job (all of it by default), or every shard (--shards N), here or on Ray"
    )
    _job_arguments(run)
    run.add_argument("--shard", help="I/N: run shard I of N (default: SLURM_ARRAY_TASK_ID/COUNT, else 0/1)")
    run.add_argument(
        "--overwrite", action="store_true",
        help="replace the earlier output of the shards this run covers instead of resuming",
    )
    run.add_argument(
        "--gpus", type=int, metavar="N", help="GPUs (one process each) for this shard; same as --set runtime.gpus=N"
    )
    run.add_argument(
        "--require-cuda", action="store_true",
        help="fail (exit 1) where no CUDA device is visible, unless runtime.device is cpu (embedjob submit's tasks pass it)",
    )
    _engine_arguments(run)
    run.set_defaults(func=_cmd_run)
    _slurm_commands(sub)
    _report_command(sub)
    _export_command(sub)

    _bench_command(sub)

    inspect = sub.add_parser("inspect", help="print the job with every default filled in, or every key")
    inspect.add_argument("job", nargs="?", help="job YAML; without it, list every key and its allowed values")
    inspect.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    inspect.add_argument("--markdown", action="store_true", help="without a job: every key as the tables of docs/configuration.md")
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def _bench_command(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark the encoder four ways on one GPU and print a table")
    mixes = ["mixed", "224px", "video"]
    bench.add_argument(
        "--mixes", nargs="*", default=mixes, choices=mixes,
        help="the Qwen2.5-VL-7B-size tower's mixes; none (a bare --mixes) skips that tower and times only the other families",
    )
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--fidelity-items", type=int, default=16, help="images compared with the fp32 reference")
    bench.add_argument("--hf-repeats", type=int, default=2)
    bench.add_argument("--skip", nargs="*", default=[], choices=["hf_sdpa", "hf_varlen"])
    bench.add_argument(
        "--compile-modes",
        nargs="*",
        default=["dynamic", "static"],
        choices=["dynamic", "static"],
        help="compiled variants: dynamic sequence length (all mixes), static shapes per budget (first mix)",
    )
    bench.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="kernel table of a compiled forward")
    bench.add_argument(
        "--fp8", action=argparse.BooleanOptionalAction, default=True, help="the compiled graphs again with model.precision fp8"
    )
    bench.add_argument("--e2e-images", type=int, default=768, help="rows of the real-JPEG Parquet file (0: skip)")
    bench.add_argument("--e2e-profile", action="store_true", help="profile the end-to-end run (cProfile)")
    bench.add_argument(
        "--fixed", action=argparse.BooleanOptionalAction, default=True,
        help="also the fixed-resolution towers (--fixed-towers) at batch 256 against plain transformers (open_clip) + torch.compile",
    )
    towers = ["siglip", "clip", "dinov3", "metaclip2", "open_clip"]
    bench.add_argument(
        "--fixed-towers", nargs="*", default=towers, choices=towers,
        help="which fixed-resolution towers --fixed times (all by default; a device call's time can hold a few)",
    )
    bench.add_argument(
        "--naflex", action=argparse.BooleanOptionalAction, default=True,
        help="also a SigLIP 2 so400m-patch16-naflex-size tower: packed graphs against transformers' padded batches",
    )
    bench.add_argument(
        "--qwen3-5", action=argparse.BooleanOptionalAction, default=True,
        help="also a Qwen3.5-27B-size vision tower on 64 mixed images against plain transformers",
    )
    bench.add_argument("--workdir", default="bench-work")
    bench.set_defaults(func=_cmd_bench)


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML file (see jobs/)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a job key, e.g. --set output.path=out2"
    )


def _setup_logging(verbose: int) -> None:
    """embedjob logs at INFO (what a batch log should show), -v adds DEBUG; other
    libraries' log records only from WARNING, and their Python warnings only with -v."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("embedjob").setLevel(logging.DEBUG if verbose else logging.INFO)
    route_warnings(bool(verbose))


def _quiet_transformers() -> None:
    """Model loading chatter (weight-loading bars, warnings) is not what a batch log needs;
    imported only by the commands that load models, so `status` stays instant."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _engine_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--shards", type=int, metavar="N",
        help="run every unfinished shard of N (default with --engine ray: the count the output records)",
    )
    run.add_argument(
        "--engine", choices=["local", "ray"], default="local",
        help="local: the shards one after another in this process (default); ray: each shard a task on a Ray cluster",
    )
    run.add_argument(
        "--address", metavar="ADDR",
        help="--engine ray: the cluster, ray://HOST:PORT, HOST:PORT or auto "
        "(default: RAY_ADDRESS, else a cluster of the run's own on 127.0.0.1, with token authentication)",
    )
    run.add_argument(
        "--max-retries", type=int, metavar="K",
        help="--engine ray: restarts of a shard's task whose process or node died (default 3); it resumes",
    )
    run.add_argument(
        "--cpus-per-task", type=int, metavar="C",
        help="--engine ray: CPUs each task reserves, its decode workers (default: the cores per GPU; 1 per CPU task)",
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from embedjob.parallel.engines import pick_engine, shards_to_run, status_report

    gpus = [] if args.gpus is None else [f"runtime.gpus={args.gpus}"]
    job = load_job(args.job, [*args.set, *gpus])
    prepare_process(job.runtime.cache_dir)
    if args.require_cuda:
        _require_cuda(job)
    engine = pick_engine(args.engine, args.address, args.max_retries, args.cpus_per_task)
    _quiet_transformers()
    shards = shards_to_run(job, args.shard, args.shards, args.engine)
    # The local engine's pipeline stops on a signal and keeps its work; Ray's driver
    # only waits, and Ctrl-C there cancels its tasks (KeyboardInterrupt, as before).
    with on_signals() if args.engine == "local" else contextlib.nullcontext():
        outcomes = engine(job, shards, overwrite=args.overwrite)
    if len(outcomes) > 1:
        print(status_report(job, outcomes), file=sys.stderr)
    elif outcomes[0].stats:  # empty on the ranks of a torchrun group that only encode
        print(_summary(job, outcomes[0].stats), file=sys.stderr)
    failed = [o for o in outcomes if o.error is not None]
    for o in failed:
        tries = f" after {o.attempts} attempts" if o.attempts > 1 else ""
        print(f"embedjob: shard {o.shard.index}/{o.shard.count} failed{tries}: {o.error}", file=sys.stderr)
    if failed:
        print(
            f"embedjob: failed: {len(failed)} of {len(outcomes)} shards did not finish; "
            "committed parts are kept, rerun the same command to finish them",
            file=sys.stderr,
        )
    return 1 if failed else 0


class NoCuda(RunFailure):
    """A task given GPUs (`--require-cuda`) whose job runs on CUDA sees none (exit 1)."""


def _require_cuda(job: Job) -> None:
    """A task SLURM was asked to give GPUs: a job on CUDA (`runtime.device` auto or
    cuda) that finds none fails now (exit 1) rather than run for hours on the node's
    CPU; `runtime.device: cpu` runs as asked."""
    if job.runtime.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise NoCuda(
            f"this task was to run on a GPU but sees none (runtime.device: {job.runtime.device}, CUDA_VISIBLE_DEVICES="
            f"{visible if visible is not None else 'unset'}); check the partition and --gpus-per-task of embedjob submit, "
            "or set runtime.device: cpu to run on the CPU"
        )


def _summary(job: Job, stats: dict[str, Any]) -> str:
    """One line: the shard's rows and errors (by code), then this run's rows over this
    run's pipeline seconds, setup apart (a resumed run counts only what it did)."""
    where = f"shard {stats.get('shard', 0)}/{stats.get('num_shards', 1)}"
    if stats.get("skipped"):
        return f"{where}: already complete in {job.output.path} ({plural(stats.get('rows', 0), 'row')}); nothing to do"
    codes = stats.get("error_codes") or {}
    errors = plural(stats["errors"], "error") + (f" ({codes_text(codes)})" if codes else "")
    resumed = stats.get("resumed_from_row")
    since = f", resumed at row {resumed}" if stats["rows_this_run"] < stats["rows"] and resumed is not None else ""
    return (
        f"{where}: {plural(stats['rows'], 'row')}, {errors}; this run: {plural(stats['rows_this_run'], 'row')}{since} "
        f"in {stats['pipeline_seconds']:.1f} s after {stats['setup_seconds']:.1f} s of setup, "
        f"{stats['items_per_second']:.1f} rows/s; {plural(stats['num_graphs'], 'graph')}{_added(stats)}, "
        f"hit rate {stats['hit_rate']:.0%}, "
        f"padding {plural(stats['padding_waste'], 'token')};{_ranks(stats)} output in {job.output.path}; "
        f"report: embedjob report {shlex.quote(job.output.path)}"
    )


def _added(stats: dict[str, Any]) -> str:
    """The budgets added during the run (`batching.refine_budgets`), if any."""
    added = stats.get("added_budgets") or []
    return f" ({len(added)} added for items of one size: {added})" if added else ""


def _ranks(stats: dict[str, Any]) -> str:
    if stats.get("world_size", 1) == 1:
        return ""
    ratio = stats["balance_ratio"]
    return f" {plural(stats['world_size'], 'rank')}, balance ratio {'n/a' if ratio is None else f'{ratio:.3f}'};"


def _cmd_bench(args: argparse.Namespace) -> int:
    prepare_process(None)
    from embedjob.bench import main as bench_main

    _quiet_transformers()
    return bench_main(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.job is None:
        print(reference_markdown() if args.markdown else describe(), end="\n" * (not args.markdown))
        return 0
    job = load_job(args.job, args.set)
    print(yaml.safe_dump(job.to_dict(), sort_keys=False), end="")
    return 0


def _slurm_commands(sub: Any) -> None:
    submit = sub.add_parser("submit", help="submit a job to SLURM: one array task per shard, unfinished shards only")
    _job_arguments(submit)
    submit.add_argument("--shards", type=int, required=True, metavar="N", help="number of shards (array tasks)")
    submit.add_argument(
        "--gpus-per-task", type=int, metavar="G",
        help="GPUs per task (default: runtime.gpus when a number, else 1; none for runtime.device: cpu; 0: no GPU lines)",
    )
    submit.add_argument("--partition", metavar="P", help="SLURM partition")
    submit.add_argument("--time", metavar="T", help="time limit per task, e.g. 4:00:00")
    submit.add_argument("--cpus-per-task", type=int, metavar="C", help="CPUs per task (decode workers)")
    submit.add_argument(
        "--sbatch-option", action="append", default=[], metavar="OPT",
        help="one more sbatch option, e.g. --sbatch-option=--account=proj (repeatable)",
    )
    submit.add_argument(
        "--log-dir", metavar="DIR",
        help="where the sbatch script, the job snapshot and the task logs go, a directory every node sees "
        "(default: OUTPUT/_embedjob/logs; for an object-store output ./embedjob-logs/BUCKET-PREFIX)",
    )
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    submit.add_argument(
        "--overwrite", action="store_true", help="replace an output of another job (all its shards) before submitting"
    )
    submit.set_defaults(func=_cmd_submit)

    status = sub.add_parser("status", help="shards done / running / pending / failed of an output, rows committed")
    status.add_argument("output", help="the job's output.path (a directory or an object-store URL)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--verify", action="store_true", help="also check every part (exit 1 if any is damaged)")
    status.set_defaults(func=_cmd_status)

    verify = sub.add_parser("verify", help="check a whole output: every shard, manifest, part checksum and marker")
    verify.add_argument("output", help="the job's output.path (a directory or an object-store URL)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(func=_cmd_verify)


def _cmd_submit(args: argparse.Namespace) -> int:
    from embedjob.slurm import SubmitOptions, array_spec, submit

    options = SubmitOptions(
        num_shards=args.shards,
        gpus_per_task=args.gpus_per_task,
        partition=args.partition,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        sbatch_options=tuple(args.sbatch_option),
        log_dir=args.log_dir,
    )
    result = submit(args.job, args.set, options, dry_run=args.dry_run, overwrite=args.overwrite)
    if result.done:
        verb = "is" if len(result.done) == 1 else "are"
        print(f"embedjob: {len(result.done)} of {plural(args.shards, 'shard')} {verb} done", file=sys.stderr)
    if result.active:
        tasks = ", ".join(result.active[s] for s in sorted(result.active))
        print(f"embedjob: still queued or running, not submitted again: {tasks}", file=sys.stderr)
    if not result.shards:
        done = "the shard is done" if args.shards == 1 else f"all {args.shards} shards are done"
        why = done if len(result.done) == args.shards else "the rest is queued or running"
        print(f"embedjob: nothing to submit: {why}", file=sys.stderr)
    elif args.dry_run:
        print(result.script, end="")
    else:
        print(
            f"embedjob: submitted {'shard' if len(result.shards) == 1 else 'shards'} {array_spec(result.shards)} "
            f"of {args.shards} as job {result.job_id}; "
            f"logs in {result.logs}",
            file=sys.stderr,
        )
        print(result.job_id)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from embedjob.io.store import output_store
    from embedjob.io.verify import verify_output
    from embedjob.slurm import format_status, output_status

    output = output_store(args.output)
    status = output_status(output)
    checked = verify_output(output) if args.verify else None
    if args.json:
        data = status.to_dict()
        if checked is not None:
            data["problems"] = checked.problems
        print(json.dumps(data, indent=2))
    else:
        print(format_status(status))
        for problem in checked.problems if checked is not None else []:
            print(f"damaged: {problem}")
    # Unfinished shards are what status reports; only damage fails it.
    return 1 if checked is not None and checked.problems else 0


def _report_command(sub: Any) -> None:
    report = sub.add_parser("report", help="write an HTML report of an output: plots, shard table, errors, versions")
    report.add_argument("output", help="the job's output.path (finished or not)")
    report.add_argument(
        "--out", metavar="FILE.html", help="where to write it (default: OUTPUT/_embedjob/report.html); its PNGs go beside it"
    )
    report.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from embedjob.report.html import write_report

    report = write_report(args.output, Path(args.out) if args.out else None)
    print(f"embedjob: wrote the report of {args.output} with {plural(len(report.figures), 'figure')}", file=sys.stderr)
    print(report.path)
    return 0


def _export_command(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="write a finished output's vectors as embeddings/*.npy + metadata/*.parquet, or a faiss index"
    )
    export.add_argument("output", help="the job's output.path (a directory or an object-store URL)")
    export.add_argument("dest", help="a new or empty directory")
    export.add_argument("--format", choices=FORMATS, default="npy", help="npy arrays, or a faiss index (pip install 'embedjob[index]')")
    export.add_argument("--partial", action="store_true", help="export the committed rows of an unfinished output")
    export.add_argument("--rows-per-file", type=int, default=ROWS_PER_FILE, metavar="N", help="rows per exported file (default %(default)s)")
    export.add_argument(
        "--flat-limit", type=int, default=FLAT_LIMIT, metavar="N", help="faiss: an exact index up to N vectors, IVF above (default %(default)s)"
    )
    export.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    result = export_output(args.output, Path(args.dest), args.format, args.partial, args.rows_per_file, args.flat_limit)
    print(f"embedjob: {summary(result, args.output)}", file=sys.stderr)
    print(result.dest)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import json

    from embedjob.io.verify import format_verification, verify_output

    result = verify_output(args.output)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_verification(result))
    return 0 if result.ok else 1


def command() -> None:
    """The `embedjob` command: `main`, then the process ends. A run a signal stopped ends
    at once, without the interpreter's teardown of torch and the model (seconds, many
    more on a busy node), so it is gone well before SLURM's SIGKILL; its parts and
    manifest are already on disk and its last line written."""
    code = main()
    if code in STOPPED_CODES:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    command()
