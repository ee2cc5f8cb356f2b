#!/usr/bin/env bash
# The checks a change to the device path owes before its issue is resolved: the GPU
# tests, the GPU decoder against the CPU's on 4 cores, and the four mixes end to end.
# Together they take longer than one 10-minute device command, so each call names the
# stages it runs, and every stage prints its table again at the end of the call.
#
# Here, once (downloads the decord, PyNvVideoCodec and open_clip wheels into .whl, copies real
# photos from ../shared/data into bench-data; both kept out of git):
#     bash benchmarks/device_checks.sh prep
# On the device, carry [".whl", "bench-data"], one call each (a warm machine keeps /tmp,
# so `report` can print the mixes of earlier calls):
#     bash benchmarks/device_checks.sh tests decode
#     bash benchmarks/device_checks.sh mixes qwen-224 siglip
#     bash benchmarks/device_checks.sh mixes clip qwen-mixed report
# On 4 or 8 GPUs every mix runs at each GPU count and grows with them (scaling.py), so
# give each call one mix: `mixes siglip`, ..., the last with `report`.
# For the encoder's kernels (#19), one call per mix or two:
#     bash benchmarks/device_checks.sh kernels qwen-mixed siglip
# FP8 with the attention output projection kept in bf16 (model.fp8_keep, #57) against all-FP8, speed and cosine:
#     PRECISIONS="fp8 fp8-keep-out" bash benchmarks/device_checks.sh kernels qwen-224 siglip
# and FP8 weights calibrated on each mix's first 64 items (model.fp8_calibrate), cosines over the rest:
#     PRECISIONS="fp8 fp8-calibrated" bash benchmarks/device_checks.sh kernels siglip qwen-224
# For video (#56): 1,152 clips take the 16 cores about 15 minutes at CLIP_SECONDS=5.25, so the
# maker runs in the background through calls made back to back (an idle machine goes back in
# 30 s), the first carrying [".ffmpeg", "bench-data", ".whl-light"], the others [".whl", "bench-data"]:
#     CLIPS=1152 CLIP_SECONDS=5.25 bash benchmarks/device_checks.sh clips-bg kernels siglip quantize
#     bash benchmarks/device_checks.sh tests nvdec-scaling    (on the clips made so far)
#     NVDEC_SESSIONS="4 7" bash benchmarks/device_checks.sh clips video siglip
# What takes the GPU's decoder from 55 clips a second alone to 30 in an nvdec job (RESULTS.md section 11): each copy
# and kernel of the decode waits for the encoder's kernel in flight. First, whether a green context frees them
# (`copies`: the copy beside products, plain, cuBLAS's carveout, a green context; no clips needed, carry .whl):
#     bash benchmarks/device_checks.sh copies
# then, on clips-bg's 128 clips (CLIPS=128, calls back to back), NVDEC beside products in a green context and with
# the driver's copies, and the nvdec job with the encoder in one (one run says little: VIDEO_REPEATS=2 or 3):
#     NVDEC_SCALING_FLAGS="--sessions 7 --modes threads --variants cut cut-engine --loads none gpu --load-green 16"
#       bash benchmarks/device_checks.sh clips nvdec-scaling
#     VIDEO_DECODERS=nvdec VIDEO_REPEATS=2 VIDEO_VARIANTS="nvdec:embedjob.pipeline.GPU_DECODE_FREE_SMS=16
#       nvdec:embedjob.decode.nvdec.COPY_ENGINE=True" bash benchmarks/device_checks.sh video siglip
# and where it wins, `auto` so on 1,152 clips (VIDEO_DECODERS="decord auto", VIDEO_VARIANTS="auto:...FREE_SMS=16")
# and CLIP (its fc1 the persistent Triton GEMM). VIDEO_FLAGS=--tiny-tower embeds with the tower's tiny version,
# VIDEO_PROFILE=nvdec names the rank's hot calls; NVDEC_SCALING_FLAGS "--loads python" and "--switch-interval
# 0.0005" time the decoder beside Python holding the GIL. Chained in one call, give each its own OUT=$OUT/NAME and
# DEADLINE.
# video.decoder auto leaves its GPU none of the clips the workers start while the rank sets up (decode_split.SETUP_SHARE);
# against the even split from the first row it replaced, on 1,152 clips (whole run and past the head start):
#     VIDEO_DECODERS="decord auto" VIDEO_VARIANTS="auto:embedjob.decode_split.SETUP_SHARE=0.5" ... clips video siglip
# `clips` tops the clips up to CLIPS (1,152 unless given): pass the CLIPS the maker was started
# with, or leave `clips` out to run on the clips made so far. NVDEC_SCALING_FLAGS="--variants
# shared-stream fed cut" compares the rank's packet feed with the pictures cut in the workers.
# Stages: prep, tests (tests/test_gpu.py), decode (benchmarks/gpu_decode.py, qwen-224,
# 24,576 rows, `gpu` and `cpu`, 4 workers, 2 runs each), mixes NAME... (benchmarks/
# scaling.py, every GPU count up to those visible, qwen-mixed with one repeat as it takes
# longest), report (the saved mixes), kernels NAME... (benchmarks/precision.py --kernels:
# bf16 and fp8 encoder-only on small mixes, each with its largest batch's kernel table;
# PRECISIONS="bf16-varlen-attn fp8" picks other variants than fp8), attention
# (benchmarks/attention.py: every attention kernel on the towers' segment layouts),
# naflex (benchmarks/naflex.py --eager: SigLIP 2 NaFlex, packed graphs against
# transformers' padded batches, compiled and eager),
# captions NAME... (benchmarks/captions.py: images alone against images + captions, clip and/or siglip),
# bench (`embedjob bench --mixes`: the fixed towers, OpenCLIP, NaFlex and Qwen3.5 rows with MFU; BENCH_TOWERS="siglip
# dinov3" picks fixed towers, BENCH_FLAGS="--no-naflex --no-qwen3-5" drops the others; beside clips-bg carry
# [".ffmpeg", "bench-data", ".whl-light"] for open_clip), clips (CLIPS=1152
# distinct clips made on the device by the FFmpeg prep puts in .ffmpeg, 1080p ones CLIP_SECONDS (7) long, 720p ones
# three quarters of it; carry [".ffmpeg", "bench-data"]; topped
# up by each call; clips-bg leaves a maker running in the background, through later calls on the warm machine,
# while the GPU stages run; `clips` waits for it, `clips-stop` stops it where it is), then at once video NAME... (benchmarks/video_decode.py on them:
# decord, nvdec and auto, tower qwen, siglip or clip; VIDEO_DECODERS picks settings, NVDEC_SESSIONS="4 7 14" the
# GPU decoder's session counts, an nvdec run each and auto at the fastest's, 7 by default; VIDEO_VARIANTS=
# "auto:embedjob.decode.video.PACKETS_IN_WORKERS=False" adds runs on a copy of the tree with those constants
# (or with job settings: "auto:runtime.workers=12"); VIDEO_PROFILE="auto" runs
# those jobs under cProfile, its table in video-NAME.log; VIDEO_REPEATS=3 runs each job three times, the median run's row
# shown; VIDEO_FLAGS="--tiny-tower" embeds with the tower's tiny version), nvdec-scaling (benchmarks/
# nvdec_scaling.py on them: NVDEC alone, sessions as threads and as processes; NVDEC_SCALING_FLAGS="--sessions 1 7"
# picks counts, "--loads none cpu gpu both" adds runs beside 16 decord processes and/or bf16 products on the GPU), fp8-layers NAME...
# (benchmarks/fp8_layers.py: each linear layer's FP8 error and the cosine kept bf16 layers buy, issue #57),
# copies (benchmarks/copy_wait.py: a frame's copy beside bf16 products, on the SMs or the copy engines, #56),
# quantize (benchmarks/quantize_rows.py: the FP8 row quantisation alone at the towers' shapes, by blocks and warps, #57;
# QUANTIZE_FLAGS="--blocks 3 2 1 --warps default 4" picks them),
# families (benchmarks/family_checks.py: DINOv3's bf16 paths against float32, Qwen3.5's batches and kernels;
# FAMILY_FLAGS="--no-compile" or "--checks qwen3_5" shortens it).
# MIX_REPEATS (2) sets the mixes' repeats (qwen-mixed always 1). TESTS="expr" runs only the GPU tests pytest's -k selects; TESTS_SECONDS (420) bounds them. SMOKE=1 passes --smoke to the
# benchmarks, so the script can be checked on a machine without a GPU. Logs go to $OUT
# (or /tmp/device-checks).
# Every stage stops by DEADLINE seconds (570) after the script started, so a call that
# runs long still prints what it measured before the device's 600-s limit kills it.
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/device-checks}"
work="${DEVICE_CHECKS_WORK:-/tmp/device-checks-work}"
mkdir -p "$out" "$work"
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)
summary=()

last_table() {
  # The lines of file $2 from the last line matching $1 on: a script that prints its table again after every
  # run leaves its final one last.
  awk -v head="$1" '$0 ~ head { table = "" } $0 ~ head, 0 { table = table $0 "\n" } END { printf "%s", table }' "$2"
}

budget() {
  # Seconds a stage may run: at most $1, and never past the call's deadline.
  local left=$(( ${DEADLINE:-570} - ($(date +%s) - started) ))
  [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"
}

prep() {
  for path in /.whl/ /.whl-light/ /bench-data/ /.ffmpeg/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >>.git/info/exclude
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl decord==0.6.0 "PyNvVideoCodec>=2.2" "open_clip_torch>=3.0" ftfy wcwidth || return
  # open_clip alone (2 MB), for calls that carry .ffmpeg: .whl and .ffmpeg together pass 64 MiB.
  mkdir -p .whl-light && cp .whl/open_clip_torch-*.whl .whl/ftfy-*.whl .whl/wcwidth-*.whl .whl-light/
  mkdir -p bench-data
  cp ../shared/data/parquet/hfhub_huggan-few-shot-cat_train-00000-of-00001.parquet ../shared/data/images/*.jpg bench-data/
  ffmpeg_for_clips
  du -sh .whl .whl-light bench-data .ffmpeg
}

ffmpeg_for_clips() {
  # The device has no video encoder (no NVENC, no FFmpeg): the `clips` stage carries imageio-ffmpeg's
  # Python files and its static FFmpeg (libx264, libx265), xz-compressed to fit a call's 64 MiB, in .ffmpeg.
  [ -f .ffmpeg/ffmpeg.xz ] && return
  local wheel
  mkdir -p .ffmpeg/wheel
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 -d .ffmpeg/wheel imageio-ffmpeg || return
  wheel=$(ls .ffmpeg/wheel/imageio_ffmpeg-*.whl)
  (cd .ffmpeg && unzip -q -o "wheel/${wheel##*/}" 'imageio_ffmpeg/*' -x 'imageio_ffmpeg/binaries/ffmpeg-*')
  unzip -p "$wheel" 'imageio_ffmpeg/binaries/ffmpeg-*' | xz -9 -T0 >.ffmpeg/ffmpeg.xz
  rm -r .ffmpeg/wheel
}

install_wheels() {
  # The device's python (3.12) has torch but not decord, PyNvVideoCodec or open_clip; a smoke
  # run uses the python it finds, with what that has. A call carries .whl, or .whl-light beside .ffmpeg.
  local wheels=.whl
  [ -d "$wheels" ] || wheels=.whl-light
  [ -d "$wheels" ] && [ ${#smoke[@]} -eq 0 ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
}

tests() {
  # Cut off by SIGINT, pytest still names the tests that failed so far (SIGTERM would leave only its dots).
  timeout -s INT -k 20 "$(budget "${TESTS_SECONDS:-420}")" python3 -m pytest -q -rfE tests/test_gpu.py ${TESTS:+-k "$TESTS"} 2>&1 | tee "$out/tests.log"
  local status=${PIPESTATUS[0]} cut=""
  [ "$status" -eq 124 ] && cut=" (cut off at its time bound: the tests after these did not run)"
  summary+=("tests/test_gpu.py: $(tail -n 1 "$out/tests.log")$cut")
  local failed
  failed=$(grep '^FAILED\|^ERROR' "$out/tests.log")
  [ -z "$failed" ] || summary+=("$failed")
}

decode() {
  local images=24576
  [ ${#smoke[@]} -gt 0 ] && images=0
  timeout "$(budget 560)" python3 benchmarks/gpu_decode.py "${smoke[@]}" --photos bench-data --mixes qwen-224 --images "$images" \
    --workers 4 --decoders gpu cpu --repeats 2 --workdir "$work/decode" 2>&1 | tee "$out/decode.log"
  summary+=("gpu_decode.py:" "$(cat "$work/decode/gpu_decode.md" 2>/dev/null || echo 'no table: see decode.log')")
}

mixes() {
  local mix repeats
  for mix in "$@"; do
    repeats=${MIX_REPEATS:-2}
    [ "$mix" = qwen-mixed ] && repeats=1
    timeout "$(budget 560)" python3 benchmarks/scaling.py "${smoke[@]}" --photos bench-data --workdir "$work/scaling" \
      --repeats "$repeats" --mixes "$mix" 2>&1 | tee "$out/scaling-$mix.log"
  done
  summary+=("scaling.py, $*:" "$(python3 benchmarks/scaling.py "${smoke[@]}" --workdir "$work/scaling" --report --mixes "$@" 2>&1)")
}

fp8_layers() {
  # Each linear layer's FP8 error on the mixes' photos and the cosine to bf16 that keeping the worst in bf16 buys.
  timeout "$(budget 560)" python3 benchmarks/fp8_layers.py "${smoke[@]}" --photos bench-data --mixes "$@" \
    --workdir "$work/fp8-layers" 2>&1 | tee "$out/fp8-layers.log"
  summary+=("fp8_layers.py, $*:" "$(cat "$work/fp8-layers/fp8_layers.md" 2>/dev/null || echo 'no table: see fp8-layers.log')")
}

attention() {
  timeout "$(budget 300)" python3 benchmarks/attention.py "${smoke[@]}" 2>&1 | tee "$out/attention.log"
  summary+=("attention.py:" "$(sed -n '/^attention backends on/,$p' "$out/attention.log")")
}

kernels() {
  # Small mixes: the kernel tables and the MFU of the encoder alone, not the pipeline.
  local counts=(qwen-mixed=96 qwen-224=1024 siglip=512 clip=512) log="$out/kernels-${1}.log"
  # shellcheck disable=SC2086  # PRECISIONS is a list of variant names
  timeout "$(budget 560)" python3 benchmarks/precision.py "${smoke[@]}" --photos bench-data --mixes "$@" --images "${counts[@]}" \
    --repeats 3 --reference 4 --precisions ${PRECISIONS:-fp8} --kernels --workdir "$work/precision" 2>&1 | tee "$log"
  summary+=("precision.py --kernels, $* (the kernel tables are in ${log##*/}):"
    "$(last_table '^# model.precision' "$log")")
}

naflex() {
  timeout "$(budget 560)" python3 benchmarks/naflex.py "${smoke[@]}" --eager 2>&1 | tee "$out/naflex.log"
  summary+=("naflex.py:" "$(sed -n '/^# SigLIP 2 NaFlex/,$p' "$out/naflex.log")")
}

bench() {
  # The new families' `embedjob bench` rows (fixed towers, OpenCLIP, NaFlex, Qwen3.5), compiled, without the
  # Qwen2.5 tower's mixes; rows are logged and saved as they come, so a call cut short keeps what it timed.
  if [ ${#smoke[@]} -gt 0 ]; then summary+=("embedjob bench: skipped with SMOKE=1 (it needs a CUDA GPU)"); return; fi
  # shellcheck disable=SC2086  # BENCH_TOWERS is a list of tower names
  timeout "$(budget 560)" python3 -m embedjob.cli bench --mixes --compile-modes dynamic --no-profile --no-fp8 --e2e-images 0 \
    --repeats 5 ${BENCH_TOWERS:+--fixed-towers $BENCH_TOWERS} ${BENCH_FLAGS:-} --workdir "$work/bench" 2>&1 | tee "$out/bench.log"
  summary+=("embedjob bench (families):" "$(cat "$work/bench/bench.md" 2>/dev/null || echo 'no table: see bench.log')")
}

families() {
  # shellcheck disable=SC2086  # FAMILY_FLAGS is a list of flags
  timeout "$(budget 400)" python3 benchmarks/family_checks.py "${smoke[@]}" ${FAMILY_FLAGS:-} --workdir "$work/families" 2>&1 | tee "$out/families.log"
  summary+=("family_checks.py:" "$(sed -n '/^device: /,$p' "$out/families.log")")
}

captions() {
  timeout "$(budget 560)" python3 benchmarks/captions.py "${smoke[@]}" --photos bench-data --workdir "$work/captions" \
    --models "$@" 2>&1 | tee "$out/captions-${1}.log"
  summary+=("captions.py, $*:" "$(sed -n '/^device: /,$p' "$out/captions-${1}.log")")
}

clips() {
  # Distinct clips for `video`, made here from the photos (H.264 and HEVC, 1080p and 720p, keyframes every
  # 1-8 s); carry [".ffmpeg", "bench-data"] (not .whl: both would pass 64 MiB) in the first call on a machine.
  # Waits first for the maker a `clips-bg` left running (by the call's deadline), then tops the clips up to
  # CLIPS; a call cut short keeps the clips it made, which the next call on that machine tops up.
  clips_wait
  unpack_ffmpeg || return
  IMAGEIO_FFMPEG_EXE=/tmp/ffmpeg PYTHONPATH="/tmp/imageio-ffmpeg:$PYTHONPATH" timeout "$(budget 560)" "${clips_maker[@]}" 2>&1 |
    tail -n 3 >"$out/clips.log"
  clips_said
}

clips_bg() {
  # The clip maker on the CPUs at the lowest priority, in a process session of its own: it runs on after the
  # call returns, while the machine is held (so the next call must come at once: an idle machine goes back
  # within a minute), and this call's and later calls' GPU stages (kernels, bench, video with VIDEO_DECODERS=nvdec)
  # run meanwhile. `clips` in a later call waits for it; its log is $work/clips.log. FFmpeg, unpacked once, stays
  # on the warm machine, so later calls carry .whl instead of .ffmpeg.
  unpack_ffmpeg || return
  clips_running && return
  IMAGEIO_FFMPEG_EXE=/tmp/ffmpeg PYTHONPATH="/tmp/imageio-ffmpeg:$PYTHONPATH" setsid nice -n 19 timeout 3600 \
    "${clips_maker[@]}" </dev/null >"$work/clips.log" 2>&1 &
  echo $! >"$work/clips.pid"
  summary+=("clips-bg: a maker runs on in the background (pid $!, log $work/clips.log)")
}

clips_stop() {
  # Stops a maker that clips-bg left running, and its FFmpegs, so the stages after it measure on the clips made so far
  # (the maker renames a clip when it is whole, so none is left half written). The patterns are bracketed so that
  # they do not match this script's own command line.
  if clips_running; then
    pkill -f "video_decode.py [-]-make-clips"
    pkill -f "[/]tmp/ffmpeg "
    for _ in 1 2 3 4 5 6 7 8 9 10; do clips_running && sleep 1; done
  fi
  clips_said
}

clips_maker=(python3 benchmarks/video_decode.py --make-clips "$work/clips" --photos bench-data --count "${CLIPS:-1152}" --kinds mixed
  --seconds "${CLIP_SECONDS:-7}")

clips_running() {
  [ -f "$work/clips.pid" ] && kill -0 "$(cat "$work/clips.pid")" 2>/dev/null
}

clips_wait() {
  while clips_running && [ "$(budget 600)" -gt 5 ]; do
    sleep 5
  done
}

unpack_ffmpeg() {
  if [ -f .ffmpeg/ffmpeg.xz ] && [ ! -x /tmp/ffmpeg ]; then
    xz -dc .ffmpeg/ffmpeg.xz >/tmp/ffmpeg.part && chmod +x /tmp/ffmpeg.part && mv /tmp/ffmpeg.part /tmp/ffmpeg || return
    rm -rf /tmp/imageio-ffmpeg && cp -r .ffmpeg /tmp/imageio-ffmpeg
  fi
  [ -x /tmp/ffmpeg ] || { echo "clips: carry .ffmpeg (this machine has no FFmpeg from an earlier call)" | tee "$out/clips.log"; return 1; }
}

clips_said() {
  local running="" size
  clips_running && running=", a maker still running"
  size=$(du -sh "$work/clips" 2>/dev/null | cut -f1)
  summary+=("clips: $(find "$work/clips" -name '*.mp4' 2>/dev/null | wc -l) in $work/clips, ${size:-0}$running")
}

video() {
  # `video.decoder` decord, nvdec and auto on the clips `clips` made, one tower per name (qwen, siglip, clip).
  local tower
  # shellcheck disable=SC2086  # VIDEO_DECODERS, NVDEC_SESSIONS, VIDEO_VARIANTS, VIDEO_PROFILE and VIDEO_FLAGS are lists
  for tower in "$@"; do
    timeout "$(budget 560)" python3 benchmarks/video_decode.py "${smoke[@]}" --clips "$work/clips" --tower "$tower" \
      --decoders ${VIDEO_DECODERS:-decord nvdec auto} --nvdec-sessions ${NVDEC_SESSIONS:-7} ${VIDEO_VARIANTS:+--variants $VIDEO_VARIANTS} \
      ${VIDEO_PROFILE:+--profile $VIDEO_PROFILE} ${VIDEO_REPEATS:+--repeats $VIDEO_REPEATS} ${VIDEO_FLAGS:-} \
      --workdir "$work/video-$tower" 2>&1 |
      tee "$out/video-$tower.log"
    # The jobs' own logs (auto's shares, the decoders' refusals) come back beside the table; the profiles stay
    # (their summaries are in the log, and a call brings back 8 files).
    cp -r "$work/video-$tower/logs" "$out/video-$tower-logs" 2>/dev/null && rm -f "$out/video-$tower-logs"/*.prof
    summary+=("video_decode.py, $tower:" "$(cat "$work/video-$tower/video_decode.md" 2>/dev/null || echo "no table: see video-$tower.log")")
  done
}

nvdec_scaling() {
  # NVDEC alone on the clips `clips` made: sessions as threads of one process and as processes (#56).
  # shellcheck disable=SC2086  # NVDEC_SCALING_FLAGS is a list of flags
  timeout "$(budget 400)" python3 benchmarks/nvdec_scaling.py "${smoke[@]}" --clips "$work/clips" ${NVDEC_SCALING_FLAGS:-} 2>&1 |
    tee "$out/nvdec-scaling.log"
  summary+=("nvdec_scaling.py:" "$(last_table '^# NVDEC alone' "$out/nvdec-scaling.log")")
}

copies() {
  # A 1080p NV12 frame's copy alone and beside bf16 products: on the SMs or the copy engines (#56).
  timeout "$(budget 120)" python3 benchmarks/copy_wait.py "${smoke[@]}" 2>&1 | tee "$out/copies.log"
  summary+=("copy_wait.py:" "$(sed -n '/^# A 1080p NV12/,$p' "$out/copies.log")")
}

quantize() {
  # The FP8 row quantisation alone at the towers' shapes, by blocks and warps per row (#57).
  timeout "$(budget 300)" python3 benchmarks/quantize_rows.py "${smoke[@]}" ${QUANTIZE_FLAGS:-} 2>&1 | tee "$out/quantize.log"
  summary+=("quantize_rows.py:" "$(sed -n '/^# FP8 row quantisation/,$p' "$out/quantize.log")")
}

report() {
  local mix saved=()
  for mix in qwen-mixed qwen-224 siglip clip; do
    [ -f "$work/scaling/$mix/result.json" ] && saved+=("$mix")
  done
  [ ${#saved[@]} -gt 0 ] || { summary+=("scaling.py: no mix saved under $work/scaling"); return; }
  summary+=("scaling.py, every mix saved (${saved[*]}):"
    "$(python3 benchmarks/scaling.py "${smoke[@]}" --workdir "$work/scaling" --report --mixes "${saved[@]}" 2>&1)")
}

[ $# -gt 0 ] || { sed -n "2,/^set -uo/{/^set -uo/!p}" "$0"; exit 2; }
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
[ "$1" = prep ] || install_wheels
while [ $# -gt 0 ]; do
  stage="$1"
  shift
  case "$stage" in
    prep | tests | decode | attention | naflex | bench | families | clips | copies | quantize | report) "$stage" ;;
    nvdec-scaling) nvdec_scaling ;;
    clips-bg) clips_bg ;;
    clips-stop) clips_stop ;;
    mixes | kernels | captions | video | fp8-layers)
      names=()
      while [ $# -gt 0 ] && [[ " prep tests decode attention naflex bench families clips copies clips-bg clips-stop nvdec-scaling quantize report mixes kernels captions video fp8-layers " != *" $1 "* ]]; do
        names+=("$1")
        shift
      done
      [ ${#names[@]} -gt 0 ] || { echo "device_checks.sh: '$stage' needs mix names (qwen-mixed qwen-224 siglip clip)" >&2; exit 2; }
      "${stage//-/_}" "${names[@]}"
      ;;
    *) echo "device_checks.sh: unknown stage '$stage' (prep, tests, decode, attention, naflex, bench, families, clips, copies, clips-bg, clips-stop, nvdec-scaling, quantize, mixes NAME..., kernels NAME..., captions NAME..., video NAME..., fp8-layers NAME..., report)" >&2; exit 2 ;;
  esac
done
clips_running && clips_said
[ ${#summary[@]} -eq 0 ] || { echo; echo "=== device_checks.sh summary ==="; printf '%s\n' "${summary[@]}"; }
