"""`model.attention` on the CPU: the key and its checks, how `auto` and `fa4` resolve
with and without FlashAttention-4 (its absence simulated, its presence stood in for),
which kernel each call site gets, and the stats and fingerprint of a job. FA4 itself,
against varlen_attn and inside captured graphs, is checked in test_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import types
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job, random_image

import embedjob.encoders.attention as attention
from embedjob.cli import main
from embedjob.config import JobError
from embedjob.encoders import load_adapter
from embedjob.encoders.attention import FA4_MIN_LENGTH, cuda_kernel, resolve_backend
from embedjob.encoders.loading import AdapterOptions
from embedjob.engine.encode import build_encoder
from embedjob.io.checkpoint import job_fingerprint

DEMO = str(REPO / "jobs" / "demo.yaml")
CUDA = torch.device("cuda", 0)
SIZES = [(224, 224), (300, 500), (56, 56), (90, 400)]


def without_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import flash_attn.cute` fails as it does where flash-attn-4 is not installed."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def with_fa4(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] = (9, 0)) -> None:
    """A stand-in `flash_attn.cute` that imports, on a GPU of `capability`."""
    package = types.ModuleType("flash_attn")
    package.cute = types.ModuleType("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package.cute)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")


@pytest.mark.parametrize("value", ["auto", "varlen", "fa4"])
def test_the_key_takes_its_three_values(cache_dir: str, value: str) -> None:
    assert make_job(cache_dir, model={"attention": value}).model.attention == value


def test_the_key_defaults_to_auto_and_refuses_other_values(cache_dir: str) -> None:
    assert make_job(cache_dir).model.attention == "auto"
    with pytest.raises(JobError, match=r"key 'model.attention' = 'flash' is not allowed; expected 'auto' \| 'varlen' \| 'fa4'"):
        make_job(cache_dir, model={"attention": "flash"})


@pytest.mark.parametrize("family", ["clip", "siglip", "dinov2"])
@pytest.mark.parametrize("value", ["fa4", "varlen"])
def test_a_fixed_resolution_tower_takes_only_auto(cache_dir: str, family: str, value: str) -> None:
    model = {"family": family, "path": f"builtin:tiny-{family}"}
    assert make_job(cache_dir, model=model).model.attention == "auto"
    with pytest.raises(JobError) as error:
        make_job(cache_dir, model={**model, "attention": value})
    message = str(error.value)
    assert f"model.attention = {value!r} applies to the Qwen-VL families only" in message
    assert "scaled-dot-product attention" in message and "remove model.attention" in message


def test_auto_without_the_package_is_varlen_and_says_why(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    without_fa4(monkeypatch)
    with caplog.at_level(logging.INFO, logger="embedjob.encoders.attention"):
        assert resolve_backend("auto", True, CUDA, torch.bfloat16) == "varlen"
    assert (
        "attention: varlen (segment_attention (Triton) on segments of at most 64 tokens at head dims it takes, "
        "varlen_attn on the others; model.attention auto; FlashAttention-4 not used: "
        "flash-attn-4 is not installed"
    ) in caplog.text
    caplog.clear()
    monkeypatch.setattr(attention, "TRITON", False)
    with caplog.at_level(logging.INFO, logger="embedjob.encoders.attention"):
        assert resolve_backend("auto", True, CUDA, torch.bfloat16) == "varlen"
    assert "attention: varlen (varlen_attn; segment_attention needs Triton; model.attention auto" in caplog.text


def test_auto_with_the_package_on_a_gpu_in_half_precision_is_fa4(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    with_fa4(monkeypatch)
    with caplog.at_level(logging.INFO, logger="embedjob.encoders.attention"):
        assert resolve_backend("auto", True, CUDA, torch.bfloat16) == "fa4"
        assert resolve_backend("auto", True, CUDA, torch.float16) == "fa4"
    assert f"attention: fa4 (FlashAttention-4) where segments may exceed {FA4_MIN_LENGTH} tokens" in caplog.text
    assert resolve_backend("fa4", True, CUDA, torch.bfloat16) == "fa4"
    assert resolve_backend("varlen", True, CUDA, torch.bfloat16) == "varlen"


@pytest.mark.parametrize(
    ("device", "dtype", "capability", "problem"),
    [
        (torch.device("cpu"), torch.float32, (9, 0), "cpu is not a CUDA device"),
        (CUDA, torch.float32, (9, 0), "it takes bfloat16 or float16, not float32"),
        (CUDA, torch.bfloat16, (7, 5), "a test GPU has compute capability 7.5, below 8.0"),
    ],
)
def test_auto_where_fa4_cannot_run_even_with_the_package_is_varlen(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, dtype: torch.dtype, capability: tuple[int, int], problem: str
) -> None:
    with_fa4(monkeypatch, capability)
    assert attention.fa4_problem(device, dtype) == problem
    assert resolve_backend("auto", True, device, dtype) == "varlen"
    with pytest.raises(JobError, match=problem):
        resolve_backend("fa4", True, device, dtype)


def test_fa4_without_the_package_is_a_job_error_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    without_fa4(monkeypatch)
    with pytest.raises(JobError) as error:
        resolve_backend("fa4", True, CUDA, torch.bfloat16)
    message = str(error.value)
    assert message.startswith("model.attention: fa4 cannot run here: flash-attn-4 is not installed")
    assert "pip install 'embedjob[fast]' (flash-attn-4>=4.0.0b36)" in message and "set model.attention: varlen" in message


def test_a_fixed_resolution_tower_runs_sdpa_whatever_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    with_fa4(monkeypatch)
    assert resolve_backend("auto", False, CUDA, torch.bfloat16) == "sdpa"


def test_an_fa4_job_without_the_package_stops_before_any_model_is_made(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line, exit 2, no part and no builtin model made: the job stopped before any work."""
    without_fa4(monkeypatch)
    cache = tmp_path / "cache"
    argv = ["run", DEMO, "--set", f"output.path={tmp_path / 'out'}", "--set", f"runtime.cache_dir={cache}"]
    assert main([*argv, "--set", "model.attention=fa4"]) == 2
    err = capsys.readouterr().err
    assert "model.attention: fa4 cannot run here: cpu is not a CUDA device" in err
    assert "pip install 'embedjob[fast]'" in err and "set model.attention: varlen" in err
    assert "model.path" not in err, "the error is the attention's, not the checkpoint's"
    assert not (cache / "builtin").exists() and not list((tmp_path / "out").glob("part-*.parquet"))


@pytest.mark.slow
def test_a_demo_job_with_auto_runs_varlen_and_its_stats_say_so(tmp_path: Path, cache_dir: str) -> None:
    argv = ["run", DEMO, "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}", "--set", "runtime.workers=0"]
    assert main(argv) == 0
    stats = json.loads((tmp_path / "_embedjob" / "stats-00000.json").read_text())
    assert stats["attention"] == "varlen"


FA4_CACHE_VARIABLES = ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")


@pytest.mark.parametrize(("family", "setting", "kept"), [("qwen2_5_vl", "auto", True), ("qwen2_5_vl", "varlen", False), ("siglip", "auto", False)])
def test_a_tower_that_may_run_fa4_keeps_its_kernels_under_the_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, setting: str, kept: bool
) -> None:
    """FlashAttention-4 compiles its kernels in every new process unless its disk cache is
    on: a Qwen job that may run it turns the cache on under runtime.cache_dir before the
    package is imported; a varlen job and the fixed towers leave the environment alone."""
    for name in FA4_CACHE_VARIABLES:  # set first, so the test's own settings are undone after it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    without_fa4(monkeypatch)
    model = {"family": family, "path": f"builtin:tiny-{family}"} | ({} if setting == "auto" else {"attention": setting})
    load_adapter(make_job(str(tmp_path), model=model), torch.device("cpu"))
    found = {name: os.environ.get(name) for name in FA4_CACHE_VARIABLES}
    assert found == ({FA4_CACHE_VARIABLES[0]: "1", FA4_CACHE_VARIABLES[1]: str(tmp_path / "fa4")} if kept else dict.fromkeys(FA4_CACHE_VARIABLES))


def test_a_users_own_fa4_cache_settings_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/scratch/fa4")
    attention.prepare_fa4(tmp_path / "fa4")
    assert [os.environ[name] for name in FA4_CACHE_VARIABLES] == ["0", "/scratch/fa4"]


def test_fa4s_per_run_warnings_are_silenced_and_other_warnings_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two messages FlashAttention-4's packages print on every run (texts as they
    print them) no longer reach a user's log; any other warning still does."""
    for name in FA4_CACHE_VARIABLES:
        monkeypatch.setenv(name, "")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        attention.prepare_fa4(tmp_path / "fa4")
        warnings.warn(
            "Argument aux_data (position 12) cannot be converted to a JitArgument for function '__call__'. "
            "Its type `<class 'flash_attn.cute.flash_fwd.AuxData'>` is not supported.", UserWarning,
        )
        warnings.warn(
            "cutlass.utils.smem_allocator.SmemAllocator is deprecated; use cutlass.memory.SmemAllocator instead.",
            DeprecationWarning,
        )
        warnings.warn("Argument scale (position 3) cannot be converted to a JitArgument", UserWarning)
    assert [str(w.message) for w in seen] == ["Argument scale (position 3) cannot be converted to a JitArgument"]


@pytest.mark.parametrize(("family", "expected"), [("qwen2_5_vl", "varlen"), ("siglip", "sdpa")])
def test_the_stats_name_the_attention_the_adapter_runs(cache_dir: str, family: str, expected: str) -> None:
    job = make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"})
    adapter = load_adapter(job, torch.device("cpu"))
    assert adapter.attention == expected
    assert build_encoder(job, adapter, torch.device("cpu")).plan_stats()["attention"] == expected


@pytest.mark.parametrize("length", [1, 16, 64])
def test_windows_run_the_segment_kernel_with_either_backend(length: int) -> None:
    assert cuda_kernel("fa4", length, 80) is attention._segment_attention
    assert cuda_kernel("varlen", length, 80) is attention._segment_attention
    assert cuda_kernel("varlen", length, 64) is attention._segment_attention


@pytest.mark.parametrize("length", [65, 100, FA4_MIN_LENGTH])
def test_segments_past_a_window_up_to_the_fa4_threshold_run_varlen_attn(length: int) -> None:
    assert cuda_kernel("fa4", length, 80) is attention._cuda_varlen
    assert cuda_kernel("varlen", length, 80) is attention._cuda_varlen


@pytest.mark.parametrize("length", [FA4_MIN_LENGTH + 1, 256, 1024, 16384])
def test_longer_segments_run_fa4_only_where_the_job_chose_it(length: int) -> None:
    assert cuda_kernel("fa4", length, 80) is attention._fa4_varlen
    assert cuda_kernel("varlen", length, 80) is attention._cuda_varlen


@pytest.mark.parametrize("length", [1, 16, 64])
def test_windows_run_varlen_attn_where_the_segment_kernel_cannot(length: int, monkeypatch) -> None:
    """varlen_attn is the fallback: at head dims the segment kernel does not take
    (Qwen3-VL's 72), where Triton is not installed (torch's CUDA builds for Linux bring
    it, others may not), and where benchmarks set SEGMENT_MAX_LENGTH to 0."""
    assert cuda_kernel("varlen", length, 72) is attention._cuda_varlen
    with monkeypatch.context() as patch:
        patch.setattr(attention, "TRITON", False)
        assert cuda_kernel("varlen", length, 80) is attention._cuda_varlen
    monkeypatch.setattr(attention, "SEGMENT_MAX_LENGTH", 0)
    assert cuda_kernel("varlen", length, 80) is attention._cuda_varlen


def test_a_compiled_block_chooses_its_kernel_without_looking_for_packages(monkeypatch) -> None:
    """`cuda_kernel` runs inside every compiled Qwen-VL block. torch 2.11's compiler does
    not trace importlib's lookups and cut each window block there into six compiled
    regions (the attention alone in one, its v of unknown alignment), so whether Triton
    is installed is found once, at import: compiled with fullgraph=True (any graph break
    fails), the choice looks nothing up. Nor does it warn: torch 2.14's compiler warned
    in every job's log that it traced through a cached helper."""

    find_spec = importlib.util.find_spec

    def no_triton_lookup(name: str, package: str | None = None):
        assert name != "triton", "importlib.util.find_spec('triton') on the compiled path"
        return find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", no_triton_lookup)

    def choose(x: torch.Tensor, bound: int) -> torch.Tensor:
        kernel = cuda_kernel("varlen", bound, x.shape[-1])
        return x * 2 if kernel is attention._segment_attention else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(choose, fullgraph=True, dynamic=True, backend="eager")
    window = 2.0 if attention.TRITON else 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(compiled(torch.ones(4, 80), 64), torch.full((4, 80), window))
        assert torch.equal(compiled(torch.ones(6, 80), 1024), torch.zeros(6, 80))


@pytest.mark.parametrize("budget", [64, 128, 256, 512, 1024, 16384])
def test_qwen2_5_vl_budgets_put_fa4_on_full_attention_and_the_segment_kernel_on_windows(qwen_adapter, budget: int) -> None:
    """The length bounds a budget's graph is captured with: its full-attention layers get
    FA4, its 64-patch windows our segment kernel, for every budget."""
    constants = qwen_adapter.static_inputs(budget, 16, 16).constants
    assert cuda_kernel("fa4", constants["max_seqlen"], 80) is attention._fa4_varlen
    assert constants["max_window_seqlen"] == 64
    assert cuda_kernel("fa4", constants["max_window_seqlen"], 80) is attention._segment_attention


def test_the_fa4_function_is_registered_under_a_flash_name_and_runs_the_tower_on_the_cpu(cache_dir: str) -> None:
    """Built with fa4 (which a job only gets on a GPU), the tower still takes the packed
    path ("flash" in the name) and, on the CPU, gives the varlen tower's rows exactly."""
    from embedjob.encoders.qwen import build_adapter

    options = AdapterOptions(cache_dir=Path(cache_dir), attention="fa4")
    fa4 = build_adapter("qwen2_5_vl", "builtin:tiny-qwen2_5_vl", torch.float32, torch.device("cpu"), options)
    assert fa4.model.config._attn_implementation == "flash_embedjob_fa4" and fa4.attention == "fa4"
    varlen = build_adapter("qwen2_5_vl", "builtin:tiny-qwen2_5_vl", torch.float32, torch.device("cpu"),
                           AdapterOptions(cache_dir=Path(cache_dir)))
    assert varlen.model.config._attn_implementation == "flash_embedjob_varlen"
    items = [fa4.preprocessor()(random_image(h, w, seed)) for seed, (h, w) in enumerate(SIZES)]
    with torch.no_grad():
        assert torch.equal(fa4.forward(fa4.eager_inputs(items)), varlen.forward(varlen.eager_inputs(items)))


def test_the_setting_leaves_the_fingerprint_of_earlier_output_unchanged(tmp_path: Path, cache_dir: str) -> None:
    """A kernel choice, as batching.compile: output written before the key existed, or
    with another setting, resumes."""
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": [b"x"]}), table)
    prints = [job_fingerprint(make_job(cache_dir, input={"path": str(table)}, model={"attention": value}))
              for value in ("auto", "varlen", "fa4")]
    assert "attention" not in prints[0]["model"] and prints[0] == prints[1] == prints[2]


def test_the_unmasked_sdpa_of_siglip_text_towers_refuses_a_mask_rather_than_drop_it() -> None:
    """`register_unmasked`'s attention is transformers' SDPA with no mask; a mask would mean
    positions to hide, which it must not ignore silently."""
    from transformers import AttentionInterface

    from embedjob.encoders.attention import UNMASKED, register_unmasked

    assert register_unmasked() == UNMASKED and "flash" not in UNMASKED
    function = AttentionInterface()[UNMASKED]
    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    out, _ = function(module, q, k, v, None, scaling=8**-0.5, dropout=0.0)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=8**-0.5).transpose(1, 2)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="attend to every position"):
        function(module, q, k, v, torch.ones(2, 1, 5, 5, dtype=torch.bool), scaling=8**-0.5)
