"""What a rank's setup costs before its first batch, step by step, in a fresh process.

Usage (from the repository root, one GPU; run the job once before, so the compile
cache is warm; model.path a checkpoint directory):

    PYTHONPATH=. python3 benchmarks/setup_costs.py JOB.yaml [--rounds 3] [--profile 40]

A run overlaps some of these steps (the compiler's import beside the model load, the
decode workers beside capture) and a spawned rank imports before its first line runs;
here each step runs alone, one after the other, in the order a rank meets them, so
each number is that step's own cost:

- import torch / transformers / embedjob: the modules every rank imports;
- import the family's modeling code: the adapter module and the transformers classes
  it builds the tower from (transformers imports them on first use);
- import the compiler: torch._dynamo and inductor's cache (batching.compile);
- cuda init: the first CUDA call;
- load: `load_encoder_adapter`, the checkpoint to the device (no imports left);
- plan: `compile_if_asked` and `build_encoder`, as `RankPipeline.prepare`;
- capture: compile (from the warm cache) and capture of every budget's graph.

Each round is a new process, so the page cache is warm but nothing in the interpreter
is; the table at the end gives the median per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ROUND = r"""
import importlib, json, sys, time
steps = {}
t = time.perf_counter()
def step(name):
    global t
    now = time.perf_counter()
    steps[name] = now - t
    t = now
import torch
step("import torch")
import transformers
step("import transformers")
import embedjob.pipeline as pipeline
from embedjob.config import load_job
from embedjob.encoders.registry import FAMILIES
step("import embedjob")
job = load_job(sys.argv[1], [])
importlib.import_module(FAMILIES[job.model.family].adapter)
arch = json.loads((__import__("pathlib").Path(job.model.path) / "config.json").read_text())["architectures"][0]
family = job.model.family
getattr(transformers, arch, None) or getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), arch)
step("import the family's modeling code")
import torch._dynamo, torch._inductor.codecache
step("import the compiler")
device = torch.device(sys.argv[2])
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
torch.zeros(1, device=device)
sync()
step("cuda init")
profile = None
if len(sys.argv) > 3:
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
adapter = pipeline.load_encoder_adapter(job, device)
sync()
step("load")
pipeline.compile_if_asked(job, adapter)
encoder = pipeline.build_encoder(job, adapter, device)
step("plan")
encoder.capture()
sync()
step("capture")
if profile is not None:
    profile.disable()
    profile.dump_stats(sys.argv[3])
print(json.dumps(steps))
"""


def run_round(job: str, device: str, profile: str | None = None) -> dict[str, float] | str:
    extra = [profile] if profile else []
    done = subprocess.run([sys.executable, "-c", ROUND, job, device, *extra], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu to try the script here (capture then replays eagerly)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="one more round under cProfile (load to capture) and print its N costliest functions")
    args = parser.parse_args()
    rounds = [run_round(args.job, args.device) for _ in range(args.rounds)]
    failed = [r for r in rounds if isinstance(r, str)]
    good = [r for r in rounds if isinstance(r, dict)]
    if not good:
        print(f"every round failed: {failed[0]}")
        return 1
    print("| step | median s | per round |")
    print("| --- | ---: | --- |")
    for name in good[0]:
        values = [r[name] for r in good]
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    totals = [sum(r.values()) for r in good]
    print(f"| total | {statistics.median(totals):.2f} | {', '.join(f'{v:.2f}' for v in totals)} |")
    if failed:
        print(f"\n{len(failed)} round(s) failed: {failed[0]}")
    if args.profile:
        print_profile(args.job, args.device, args.profile)
    return 0


def print_profile(job: str, device: str, top: int) -> None:
    """A round from load to capture under cProfile: its costliest functions by their
    cumulative and by their own seconds (cProfile slows Python-heavy steps, so the shares
    say where the time goes, not a plain round's length)."""
    import pstats
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "setup.prof")
        result = run_round(job, device, path)
        if isinstance(result, str):
            print(f"\nthe profiled round failed: {result}")
            return
        print(f"\nprofiled round (load to capture): {sum(result[k] for k in ('load', 'plan', 'capture')):.2f} s")
        for key in ("cumulative", "tottime"):
            stats = pstats.Stats(path)
            stats.sort_stats(key).print_stats(top)


if __name__ == "__main__":
    raise SystemExit(main())
