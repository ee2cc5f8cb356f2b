"""SLURM: an sbatch array script per job, its submission, and the status of an output.

One array task per shard, and the array index IS the shard index, so `squeue`, the
log names (`shard-SSSSS-job-J.log` in the log directory) and the output files
(`part-SSSSS-*`) all use the same number. Each task runs `embedjob run JOB --shard
I/N` with the submitter's Python and the job's `--set` overrides, from the directory
`embedjob submit` ran in, so relative paths mean what they meant there. The task
passes N explicitly: `SLURM_ARRAY_TASK_COUNT` is the number of tasks submitted, which
after a partial resubmission is not the number of shards.

Resubmission submits only shards without `_SUCCESS` that no earlier submission of this
output still has queued or running; with `--requeue`, SLURM itself restarts a task
after a node failure or pre-emption, and the task resumes from its manifest.

The output is a directory every node mounts, or an object-store URL (read and written
only through its store, `io/store.py`). The log directory holds the sbatch script, the
job snapshot the tasks run and the tasks' logs, which sbatch writes to a file path:
`<output>/_embedjob/logs` for a directory output, else `embedjob-logs/<output>` under
the working directory, or `--log-dir` (`log_dir`).

Submission checks the output's job (`checkpoint.claim_output`) before it queues
anything, and records the job there if it is the first, so tasks that start hours later
find the output theirs; `--overwrite` replaces an output of another job at submission
(the tasks themselves never overwrite: a requeued task must resume, not start over).

Every submission is recorded in the output's `_embedjob/slurm-job.json`, with its log
directory, so `embedjob status` can ask SLURM (`scontrol show job`) about the tasks and
name a failed task's log; without SLURM it reports from the files. Status states: done
(`_SUCCESS`), running (SLURM says so, or a process holds the shard's lock: a run by
hand counts too), pending (queued or requeued), failed (SLURM says the task ended, or
no longer knows the job, and there is no `_SUCCESS`), and unfinished (not done, and
nothing says more: not started, or stopped).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from embedjob.config import Job, JobError, cache_root, load_job
from embedjob.io import reader
from embedjob.io.checkpoint import (
    META,
    OutputRecord,
    ShardProgress,
    claim_output,
    count_codes,
    existing_output,
    job_fingerprint,
    lock_name,
    read_output_record,
    refuse_other_job,
    shard_finished,
    shard_progress,
    shards_in,
    write_record,
)
from embedjob.io.files import LocalStore, own_directory, write_bytes
from embedjob.io.store import Store, is_url, output_store, shared_store
from embedjob.report.counts import codes_text, error_share_warning, plural

logger = logging.getLogger(__name__)

RECORD_NAME = f"{META}/slurm-job.json"
LOGS = f"{META}/logs"
LOG_PATTERN = "shard-%5a-job-%A.log"
LOGS_ROOT = "embedjob-logs"
"""The folder of the working directory under which an object-store output's logs go by
default, one folder per output."""
REQUIRE_CUDA = "--require-cuda"
"""What a task given GPUs passes to `embedjob run` when its job runs on CUDA."""
SLURM_TIMEOUT_S = 30

RUNNING_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED", "RESIZING"}
PENDING_STATES = {"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
STATES = ("done", "running", "pending", "failed", "unfinished")

# Characters an #SBATCH value may hold: sbatch splits those lines on whitespace and
# does its own quote handling, so anything else is refused rather than guessed at.
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.,:+=@%/\[\]-]+$")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> "Shard":
        """`I/N` from the CLI, else SLURM's array variables, else the whole input."""
        if text is None:
            text = array_task_shard()
            if text is None:
                return cls()
        try:
            index, count = (int(p) for p in text.split("/"))
        except ValueError:
            raise JobError(f"--shard expects I/N with integers (e.g. 0/8), got {text!r}") from None
        if count < 1 or not 0 <= index < count:
            raise JobError(f"--shard {text}: need 0 <= I < N and N >= 1")
        return cls(index, count)


def array_task_shard() -> str | None:
    """`I/N` of this SLURM array task, None outside an array.

    The array index is the shard index (module docstring), so only an array of tasks
    0..N-1 says how many shards there are: any other array must pass --shard I/N.
    """
    task, count = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_ARRAY_TASK_COUNT")
    if task is None or count is None:
        return None
    low, high = os.environ.get("SLURM_ARRAY_TASK_MIN", "0"), os.environ.get("SLURM_ARRAY_TASK_MAX")
    if low != "0" or (high is not None and int(high) != int(count) - 1):
        raise JobError(
            f"this SLURM array ({low}-{high}, {count} tasks) is not 0..N-1, so its task count is not the "
            "number of shards; pass --shard I/N (embedjob submit does)"
        )
    return f"{task}/{count}"


@dataclass(frozen=True)
class SubmitOptions:
    """What `embedjob submit` asks of SLURM besides the job itself."""

    num_shards: int
    gpus_per_task: int | None = None
    """None: what the job needs (`task_gpus`)."""
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    sbatch_options: tuple[str, ...] = ()
    log_dir: str | None = None
    """`--log-dir`; None: the output's own (`log_dir`)."""


@dataclass(frozen=True)
class LogDir:
    """Where a submission's script, job snapshot and task logs go (absolute), and what
    names it: what the user changes to move it, for a message refusing it."""

    path: Path
    named_by: str


@dataclass(frozen=True)
class TaskCommand:
    """How each array task runs its shard: which Python, job file, overrides, and where.

    Paths are absolute, so the script means the same thing wherever sbatch runs it.
    """

    job_file: Path
    overrides: tuple[str, ...]
    logs: LogDir
    workdir: Path
    python: str
    python_path: str | None
    job_name: str
    cuda: bool = False
    """The job runs on CUDA (`runtime.device` auto or cuda): a task given GPUs that finds
    none must fail, not run on the node's CPU for hours."""


@dataclass
class Submission:
    """The outcome of `submit`: the shards submitted (none when nothing was left), and
    the log directory their tasks write to."""

    shards: list[int]
    done: list[int]
    active: dict[int, str]
    logs: Path
    script: str | None = None
    script_path: Path | None = None
    job_id: str | None = None


@dataclass
class ShardStatus:
    """One shard of an output: its state, its rows (None: not known yet), SLURM's view,
    and the log of its latest SLURM task (None: no task, or a log nobody recorded)."""

    shard: int
    state: str
    rows: int | None
    committed: int
    errors: int
    slurm_task: str | None = None
    slurm_state: str | None = None
    holder: str | None = None
    error_codes: dict[str, int] = field(default_factory=dict)
    log: str | None = None

    def warning(self) -> str | None:
        """A finished shard with many error rows (`error_share_warning`), else None."""
        if self.state != "done" or self.rows is None:
            return None
        return error_share_warning(self.shard, self.errors, self.rows, self.error_codes)


@dataclass
class OutputStatus:
    """Every shard of an output (`output`: where it is, as `Store.location`);
    `scheduler` says where the SLURM states came from."""

    output: str
    num_shards: int
    shards: list[ShardStatus]
    scheduler: str
    job_ids: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {state: sum(s.state == state for s in self.shards) for state in STATES}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output"] = str(self.output)
        data["counts"] = self.counts()
        data["rows"] = sum(s.rows or 0 for s in self.shards)
        data["committed"] = sum(s.committed for s in self.shards)
        data["error_codes"] = self.error_codes()
        data["warnings"] = self.warnings()
        return data

    def warnings(self) -> list[str]:
        """One line per finished shard whose rows are errors too often."""
        return [w for w in (s.warning() for s in self.shards) if w is not None]

    def error_codes(self) -> dict[str, int]:
        """Error rows per code over every shard's committed parts, most frequent first."""
        return count_codes(s.error_codes for s in self.shards)


# ---------------------------------------------------------------- the script


def array_spec(indices: list[int]) -> str:
    """`--array` value for sorted, distinct indices, runs collapsed: [0,1,2,5,7,8] -> '0-2,5,7-8'."""
    if not indices:
        raise ValueError("an array needs at least one index")
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_array_spec(text: str) -> list[int]:
    """The indices an `ArrayTaskId` names: '2-3', '0,4-6', '0-7%2' (limit), '0-9:3' (step)."""
    indices: list[int] = []
    for item in text.split("%")[0].split(","):
        bounds, _, step = item.partition(":")
        first, _, last = bounds.partition("-")
        indices.extend(range(int(first), int(last or first) + 1, int(step or 1)))
    return indices


def render_script(task: TaskCommand, shards: list[int], options: SubmitOptions) -> str:
    """The sbatch script: one array task per shard in `shards`.

    GPU lines appear only when `options.gpus_per_task` > 0 (a GPU request on a node
    without GPUs is refused at submission); the task then runs with `--require-cuda`
    when its job runs on CUDA. Raises JobError for values sbatch could not take safely
    from an `#SBATCH` line.
    """
    directives = [
        f"--job-name={task.job_name}",
        f"--array={array_spec(shards)}",
        "--ntasks=1",
        "--requeue",
        # A requeued task appends to its log instead of wiping the first attempt's.
        "--open-mode=append",
        f"--output={_sbatch_value(str(task.logs.path / LOG_PATTERN), task.logs.named_by)}",
        f"--chdir={_sbatch_value(str(task.workdir), 'the working directory')}",
    ]
    if options.partition:
        directives.append(f"--partition={_sbatch_value(options.partition, '--partition')}")
    if options.time:
        directives.append(f"--time={_sbatch_value(options.time, '--time')}")
    if options.cpus_per_task is not None:
        directives.append(f"--cpus-per-task={options.cpus_per_task}")
    gpus = options.gpus_per_task or 0
    if gpus > 0:
        directives.append(f"--gpus-per-task={gpus}")
    for extra in options.sbatch_options:
        if not extra.startswith("-") or any(c in extra for c in "\n\r\0"):
            raise JobError(f"--sbatch-option {extra!r} must be one sbatch option, e.g. --sbatch-option=--account=proj")
        directives.append(extra)
    run = shlex.join([task.python, "-m", "embedjob.cli", "run", str(task.job_file)])
    require = f" {REQUIRE_CUDA}" if gpus > 0 and task.cuda else ""
    # The only word bash may expand: the task id.
    shard = f'--shard "${{SLURM_ARRAY_TASK_ID}}/{options.num_shards}"'
    overrides = "".join(f" --set {shlex.quote(o)}" for o in task.overrides)
    lines = [
        "#!/bin/bash",
        f"# embedjob: {plural(options.num_shards, 'shard')} of {_comment_text(str(task.job_file))}; written by `embedjob submit`.",
        "# Array index = shard index. Resubmit with `embedjob submit` to run what is unfinished.",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
    ]
    if task.python_path:
        lines.append(f"export PYTHONPATH={shlex.quote(task.python_path)}${{PYTHONPATH:+:$PYTHONPATH}}")
    lines.append('echo "embedjob: shard ${SLURM_ARRAY_TASK_ID} on $(hostname), attempt $((${SLURM_RESTART_COUNT:-0} + 1))" >&2')
    lines.append(f"exec {run} {shard}{require}{overrides}")
    return "\n".join(lines) + "\n"


def _comment_text(text: str) -> str:
    """`text` for a comment line: a newline in it would end the comment and make the
    rest a command, so control characters (and backslashes, non-ASCII) are escaped."""
    return text.encode("unicode_escape").decode("ascii")


def _sbatch_value(value: str, what: str) -> str:
    if not _SBATCH_SAFE.match(value):
        raise JobError(
            f"{what} {value!r} cannot go into an #SBATCH line (spaces, quotes and shell characters are not allowed there)"
        )
    return value


def task_command(job_file: str | Path, overrides: list[str], job: Job, logs: LogDir) -> TaskCommand:
    """The task command for `job`, run by this Python from the current directory."""
    workdir = Path.cwd()
    package_root = str(Path(__file__).resolve().parent.parent)
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(job_file).stem) or "job"
    return TaskCommand(
        job_file=(workdir / job_file).resolve(),
        overrides=tuple(overrides),
        logs=logs,
        workdir=workdir,
        python=sys.executable,
        # Run from a source tree (or an editable install), the tasks must import the
        # same embedjob as the submitter, whatever their working directory.
        python_path=None if package_root in installed else package_root,
        job_name=f"embedjob-{name}",
        cuda=job.runtime.device != "cpu",
    )


def task_gpus(job: Job, asked: int | None) -> int:
    """GPUs per task: `asked` (`--gpus-per-task`), else none for a job on the CPU
    (`runtime.device: cpu`), else `runtime.gpus` when it is a number, else one."""
    if asked is not None:
        return asked
    if job.runtime.device == "cpu":
        return 0
    return job.runtime.gpus if isinstance(job.runtime.gpus, int) else 1


def log_dir(output: Store, asked: str | None, workdir: Path) -> LogDir:
    """Where a submission keeps its sbatch script, job snapshot and task logs.

    sbatch writes a task's log to a file path every node sees, so an object-store
    output cannot hold it: its logs go to `embedjob-logs/<bucket>-<prefix>` under the
    working directory, which the tasks share (they run there). A directory output
    keeps them in its `_embedjob/logs`, as it always has. `asked` (`--log-dir`, taken
    relative to `workdir`) overrides both; a URL or a file there is refused before any
    work (JobError).
    """
    if asked is not None:
        path = (workdir / asked).resolve()
        if is_url(asked) or (path.exists() and not path.is_dir()):
            raise JobError(
                f"--log-dir {asked!r} is not a directory: SLURM writes each task's log to a file path, "
                "so name a local or mounted directory every node sees (it is created if missing)"
            )
        return LogDir(path, "--log-dir")
    if isinstance(output, LocalStore):
        return LogDir(Path(output.where(LOGS)), "output.path")
    return LogDir(workdir / LOGS_ROOT / _folder_name(output.location), "the working directory (or --log-dir)")


def _folder_name(url: str) -> str:
    """One folder name for an output URL: `s3://bucket/a/b` -> `bucket-a-b`. Runs of
    characters other than letters, digits, `_`, `.` and `-` become one `-` (so the
    name fits an #SBATCH line and makes no subfolders), and no leading dot can make it
    hidden, `.` or `..`."""
    rest = url.split("://", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", rest).strip("-.") or "output"


# ---------------------------------------------------------------- submission


def submit(
    job_file: str | Path, overrides: list[str], options: SubmitOptions, dry_run: bool = False, overwrite: bool = False
) -> Submission:
    """Submit the shards of a job that are neither done nor still queued or running.

    The job and its input are checked first (bad spec, unreadable input, output of a
    different job: JobError), so a mistake costs no queue time. The output's record
    names this job from then on; with `overwrite`, an output of another job is
    replaced (every shard's files removed) before anything is queued. The tasks run a
    copy of the job file kept in the log directory. With `dry_run` the script is
    rendered (naming the job file itself) and nothing is written or submitted, neither
    to the output nor to the log directory.

    Everything read from or written to the output goes through its store, so the
    output may be a directory or an object-store URL; the script, the snapshot and the
    logs go to the log directory (`log_dir`).
    """
    _check_options(options)
    job = load_job(job_file, overrides)
    options = replace(options, gpus_per_task=task_gpus(job, options.gpus_per_task))
    output = shared_store(job.output)
    task = task_command(job_file, overrides, job, log_dir(output, options.log_dir, Path.cwd()))
    listing = reader.scan_input(job.input, job.output.columns, cache_root(job.runtime.cache_dir))
    ranges = shard_ranges(listing.fragments, options.num_shards)
    record = OutputRecord(job_fingerprint(job, listing), options.num_shards, job.output.rows_per_part)
    replacing = refuse_other_job(output, record, overwrite)
    active = _active_shards(output, options.num_shards)
    if replacing and active:
        tasks = ", ".join(active[s] for s in sorted(active))
        raise JobError(
            f"output {output} belongs to another job whose tasks are still queued or running ({tasks}); "
            "cancel them (scancel) before replacing it"
        )
    done = [] if replacing else [s for s in range(options.num_shards) if shard_finished(output, s)]
    todo = [s for s in range(options.num_shards) if s not in done and s not in active]
    result = Submission(todo, done, active, task.logs.path)
    if not todo:
        return result
    if dry_run:
        result.script = render_script(task, todo, options)
        return result
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch is not on PATH: run `embedjob submit` where SLURM is installed, or use --dry-run")
    _check_array_size(todo[-1])
    claim_output(output, record, overwrite)
    snapshot = _queue(task, options, result)
    _record(output, task, options, result, ranges, snapshot)
    logger.info("submitted job %s: shards %s of %d", result.job_id, array_spec(todo), options.num_shards)
    return result


def _check_options(options: SubmitOptions) -> None:
    """A JobError for a count on the command line that SLURM could not take."""
    if options.num_shards < 1:
        raise JobError(f"--shards must be >= 1, got {options.num_shards}")
    if options.gpus_per_task is not None and options.gpus_per_task < 0:
        raise JobError(f"--gpus-per-task must be >= 0, got {options.gpus_per_task}")
    if options.cpus_per_task is not None and options.cpus_per_task < 1:
        raise JobError(f"--cpus-per-task must be >= 1, got {options.cpus_per_task}")


def _queue(task: TaskCommand, options: SubmitOptions, result: Submission) -> Path:
    """Write the job file's snapshot and the script into the log directory and sbatch
    the script for `result.shards` (setting the result's script, its path and the job
    id); the snapshot's path.

    Tasks may start hours later: they read a copy of the job file as it is now, so an
    edit in the meantime cannot make one output out of two different jobs."""
    logs = task.logs.path
    logs.parent.mkdir(parents=True, exist_ok=True)
    own_directory(logs)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    snapshot = logs / f"job-{stamp}.yaml"
    write_bytes(snapshot, task.job_file.read_bytes())
    result.script = render_script(replace(task, job_file=snapshot), result.shards, options)
    result.script_path = logs / f"submit-{stamp}.sbatch"
    write_bytes(result.script_path, result.script.encode())
    result.job_id = _sbatch(result.script_path, task.workdir)
    return snapshot


def shard_ranges(fragments: list[reader.Fragment], num_shards: int) -> list[tuple[int, int]]:
    """Global row range [first, end) of each shard, as `embedjob run --shard` computes it."""
    shards = reader.assign_shards(fragments, num_shards)
    if num_shards > len(fragments):
        logger.warning(
            "%s but the input has %s: %s will have no rows (a shard is made of whole row groups)",
            plural(num_shards, "shard"), plural(len(fragments), "row group"), plural(num_shards - len(fragments), "shard"),
        )
    return [(s[0].first_row, s[-1].first_row + s[-1].num_rows) if s else (0, 0) for s in shards]


def _active_shards(output: Store, num_shards: int) -> dict[int, str]:
    """Shards an earlier submission still has queued or running, with their task ids."""
    status = output_status(output) if output.exists(RECORD_NAME) else None
    if status is None:
        return {}
    active = {s.shard: s.slurm_task or "" for s in status.shards if s.state in ("running", "pending")}
    if active and status.num_shards != num_shards:
        raise JobError(
            f"job {', '.join(status.job_ids)} still runs {plural(status.num_shards, 'shard')} on {output}; "
            f"cancel it (scancel) before submitting {plural(num_shards, 'shard')}"
        )
    return active


def _check_array_size(largest: int) -> None:
    """Array indices must stay below the cluster's MaxArraySize (1001 by default); sbatch
    itself only answers "Invalid job array specification"."""
    try:
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", config.stdout, re.MULTILINE)
    if match and largest >= int(match.group(1)):
        raise JobError(
            f"shard index {largest} is beyond this cluster's MaxArraySize ({match.group(1)}): array indices are shard "
            f"indices, so use --shards {match.group(1)} or fewer (larger shards), or ask for a larger MaxArraySize"
        )


def _sbatch(script: Path, workdir: Path) -> str:
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            cwd=workdir, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"sbatch did not answer within {SLURM_TIMEOUT_S} s; is slurmctld up (scontrol ping)?") from None
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch answered {done.stdout.strip()!r}, not a job id")
    return job_id


def _record(
    output: Store,
    task: TaskCommand,
    options: SubmitOptions,
    result: Submission,
    ranges: list[tuple[int, int]],
    snapshot: Path,
) -> None:
    """Add this submission to the output's record, with its log directory (which
    `status` cannot work out for an object-store output or a `--log-dir`)."""
    record = read_record(output)
    record.setdefault("submissions", []).append(
        {
            "job_id": result.job_id,
            "num_shards": options.num_shards,
            "shards": result.shards,
            "array": array_spec(result.shards),
            "script": str(result.script_path),
            "logs": str(result.logs),
            "job_file": str(task.job_file),
            "job_snapshot": str(snapshot),
            "overrides": list(task.overrides),
            "submitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    )
    record["num_shards"] = options.num_shards
    record["shard_rows"] = [end - first for first, end in ranges]
    write_record(output, RECORD_NAME, record)


def read_record(output: Store | Path) -> dict[str, Any]:
    """`<output>/_embedjob/slurm-job.json` (`RECORD_NAME`), or an empty record when there is none."""
    out = output_store(output)
    path = out.where(RECORD_NAME)
    try:
        record = json.loads(out.read(RECORD_NAME))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read {path} ({exc}); remove it to forget earlier submissions") from None
    if not isinstance(record, dict):
        raise JobError(f"{path} is not an embedjob submission record; remove it to forget earlier submissions")
    return record


# ---------------------------------------------------------------- status


def output_status(output: Store | Path) -> OutputStatus:
    """The state of every shard of `output`, from its files and (if it can) from SLURM."""
    output = existing_output(output, "read the status of")
    record = read_record(output)
    progress = {s: shard_progress(output, s) for s in shards_in(output)}
    num_shards = _num_shards(output, record, progress)
    owner = _latest_task(record, num_shards)
    slurm = _ask_slurm(sorted({str(s["job_id"]) for s in owner.values()}))
    known_rows = record.get("shard_rows") if record.get("num_shards") == num_shards else None
    shards = []
    for shard in range(num_shards):
        p = progress.get(shard) or ShardProgress(shard, None, None, 0, 0, 0, False)
        rows = p.rows if p.rows is not None else (known_rows[shard] if known_rows else None)
        submission = owner.get(shard)
        job_id = str(submission["job_id"]) if submission else None
        slurm_state = slurm.state(job_id, shard) if job_id else None
        task = f"{job_id}_{shard}" if job_id else None
        logs = _submission_logs(output, submission) if submission else None
        log = str(log_path(logs, task)) if logs and task else None
        holder = None if p.done else output.lock_holder(lock_name(shard))
        state = _classify(p.done, slurm_state, holder is not None)
        shards.append(
            ShardStatus(shard, state, rows, p.committed, p.errors, task, slurm_state, holder, p.error_codes, log)
        )
    job_ids = [str(s["job_id"]) for s in record.get("submissions", [])]
    return OutputStatus(output.location, num_shards, shards, slurm.source, job_ids)


def _num_shards(output: Store, record: dict[str, Any], progress: dict[int, Any]) -> int:
    """The output's job says; an output from before job records: the submission
    record, else the manifests."""
    job = read_output_record(output)
    if job is not None:
        return job.num_shards
    if record.get("num_shards"):
        return int(record["num_shards"])
    counts = {p.num_shards for p in progress.values() if p.num_shards is not None}
    if len(counts) > 1:
        raise JobError(f"the manifests in {output} disagree on the number of shards ({sorted(counts)})")
    if not counts:
        raise JobError(f"{output} holds no embedjob shards (no manifest-*.json and no {RECORD_NAME})")
    return counts.pop()


def _latest_task(record: dict[str, Any], num_shards: int) -> dict[int, dict[str, Any]]:
    """For each shard, the latest submission of this shard count that ran it."""
    owner: dict[int, dict[str, Any]] = {}
    for submission in record.get("submissions", []):
        if submission.get("num_shards") == num_shards:
            for shard in submission.get("shards", []):
                owner[shard] = submission
    return owner


def _submission_logs(output: Store, submission: dict[str, Any]) -> Path | None:
    """The log directory of a submission: recorded with it; a submission recorded
    before the record named it logged under its directory output, as all did then."""
    if "logs" in submission:
        return Path(submission["logs"])
    return Path(output.where(LOGS)) if isinstance(output, LocalStore) else None


def _classify(done: bool, slurm_state: str | None, locked: bool) -> str:
    """A shard's state; a held lock means a process writes it now, whatever SLURM says
    about an earlier task (the shard may be run by hand)."""
    if done:
        return "done"
    if locked or slurm_state in RUNNING_STATES:
        return "running"
    if slurm_state in PENDING_STATES:
        return "pending"
    if slurm_state is None:
        return "unfinished"
    return "failed"


@dataclass
class SlurmView:
    """What SLURM says about the recorded jobs: the state of each array task by
    (job id, index), the jobs it no longer knows, and where the information came from."""

    states: dict[tuple[str, int], str] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    source: str = "files"

    def state(self, job_id: str, index: int) -> str | None:
        """A task's state; "GONE" once SLURM forgot the job (controllers forget only
        finished jobs); None when SLURM was not asked or did not answer."""
        if job_id in self.gone:
            return "GONE"
        return self.states.get((job_id, index))


def _ask_slurm(job_ids: list[str]) -> SlurmView:
    if not job_ids:
        return SlurmView()
    if shutil.which("scontrol") is None:
        return SlurmView(source="files (scontrol not found)")
    view = SlurmView(source="scontrol")
    for job_id in job_ids:
        try:
            done = subprocess.run(
                ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return SlurmView(source="files (scontrol timed out)")
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                view.gone.add(job_id)
                continue
            last = done.stderr.strip().splitlines()[-1:] or ["failed"]
            return SlurmView(source=f"files ({last[0]})")
        for line in done.stdout.splitlines():
            view.states.update(_task_states(line))
    return view


def _task_states(line: str) -> dict[tuple[str, int], str]:
    """States named by one `scontrol show job -o` record (pending tasks share one record)."""
    fields = dict(re.findall(r"(\w+)=(\S*)", line))
    if "ArrayJobId" not in fields or "ArrayTaskId" not in fields or "JobState" not in fields:
        return {}
    return {(fields["ArrayJobId"], index): fields["JobState"] for index in parse_array_spec(fields["ArrayTaskId"])}


def format_status(status: OutputStatus) -> str:
    """A summary line, then one line per shard (shard, state, rows committed/total,
    errors, SLURM task or lock holder), then the most frequent error codes."""
    counts = status.counts()
    total = sum(s.rows or 0 for s in status.shards)
    committed = sum(s.committed for s in status.shards)
    unknown = sum(s.rows is None for s in status.shards)
    # Shards not started yet (and never submitted) have no known row count.
    rows = f"at least {plural(total, 'row')} ({plural(unknown, 'shard')} not started)" if unknown else plural(total, "row")
    lines = [
        f"{status.output}: {plural(status.num_shards, 'shard')}: "
        + ", ".join(f"{counts[state]} {state}" for state in STATES)
        + f"; {committed} of {rows} committed (from {status.scheduler})",
        f"{'shard':>5}  {'state':<10} {'rows':>17}  {'errors':>6}  slurm",
    ]
    for s in status.shards:
        rows = f"{s.committed}/{'?' if s.rows is None else s.rows}"
        slurm = f"{s.slurm_task} {s.slurm_state}" if s.slurm_task else "-"
        held = f" (lock held by {s.holder})" if s.holder else ""
        lines.append(f"{s.shard:>5}  {s.state:<10} {rows:>17}  {s.errors:>6}  {slurm}{held}")
    codes = status.error_codes()
    if codes:
        lines.append(f"errors by code: {codes_text(codes)}")
    lines += [f"warning: {w}" for w in status.warnings()]
    for s in status.shards:
        if s.state == "failed" and s.log:
            lines.append(f"shard {s.shard} failed; its log: {s.log}")
    return "\n".join(lines)


def log_path(logs: Path, slurm_task: str) -> Path:
    """The log file of array task `JOB_INDEX` in the log directory `logs`, as the
    script's --output names it."""
    job_id, _, index = slurm_task.partition("_")
    return logs / LOG_PATTERN.replace("%5a", f"{int(index):05d}").replace("%A", job_id)
