#!/usr/bin/env bash
# The GPU checks that issue 18 asks of any session lent a GPU, as stages that each fit one
# call of the device tool (10 minutes a command; read its README, METHOD.md and
# HOPPER.md first). Every stage logs to $OUT (the folder the device tool brings back;
# benchmarks/out/gpu elsewhere) and the run ends with a table of what passed.
#
#   bash benchmarks/gpu_validate.sh build tests       # first call: the CUDA tests
#   bash benchmarks/gpu_validate.sh build sanitize    # compute-sanitizer memcheck, racecheck
#   bash benchmarks/gpu_validate.sh build bench demo  # bench_optim, bench_gemm, bench_quant, bench_amp_path, demo
#   bash benchmarks/gpu_validate.sh build offload     # the offloading optimizer on a 1B GPT
#   bash benchmarks/gpu_validate.sh build offload3b   # ... on a 3B GPT, with and without clipping
#   bash benchmarks/gpu_validate.sh build muon        # Muon on the GPU
#   MEMFIT_WHEEL=... bash benchmarks/gpu_validate.sh build perf   # issue 39: one call, < 8 min
#
# build: installs MEMFIT_WHEEL when set (a wheel built elsewhere for the device's Python
#        and architecture: pip wheel -C cmake.define.MEMFIT_CUDA=ON
#        -C cmake.define.MEMFIT_CUDA_ARCHS=90 .), else builds this checkout there:
#        installs this checkout with CUDA for the GPU in hand only (MEMFIT_CUDA_ARCHS,
#        default its compute capability, e.g. 90 on an H100: a fraction of the default
#        five-architecture build). The build folder (build/) stays while the machine is
#        warm, so a later call's build is incremental; a fresh machine builds again.
# tests: the CPU/CUDA bitwise agreement tests first, then every test marked cuda.
# sanitize: memcheck and racecheck over the optimizer, row-block and quantization CUDA
#        tests (odd sizes, block sizes 64 to 4096, 4-bit states).
# bench: bench_optim (1B parameters against a device-to-device copy, torch fused AdamW
#        and bitsandbytes when importable), bench_gemm, bench_quant and bench_amp_path (a
#        GradScaler step: torch's default path against the in-kernel one) on the GPU.
# demo:  memfit demo on the GPU (memory, step time, loss).
# offload: bench_offload --size 1b: a GPT of about 1B parameters in bf16 with checkpointed
#        blocks; peak device memory, s/step, tokens/s on the device and offloaded,
#        bit-exactness against the device step, torchao's CPUOffloadOptimizer beside it
#        where it imports (issue 32 §5; targets in benchmarks/RESULTS.md); per step
#        (issue 40 §6): forward/backward, bytes, GB/s and exposed time of the copies each
#        way, the host step against backward's end, its ns/param, threads and kernel,
#        the device's idle gap, hooks, pinned and staging allocations; the host step alone
#        at 1, 2, cores/2, cores-1, cores threads against torch's fused AdamW (bf16, fp32;
#        60M of the model's parameters); pinned bandwidth both ways; predicted against
#        measured. About 3 minutes on an H200 (estimate; sized for 6). GPU_OFFLOAD_DRY_RUN=1
#        runs the same stage on the CPU (--size tiny --device cpu: the path and the JSON,
#        not the numbers).
# offload3b: bench_offload --size 3b (issue 40's second target: >= 3B parameters, backward
#        >= 1 s, offload within 1.2x of the device step with offload_gradients=True, with
#        and without clipping): device, offload, device+clip, offload+clip, 3 steps each
#        after 1 untimed (about 3 minutes on an H200, estimate). Check the bwd ms column:
#        under 1000, rerun with OFFLOAD3B_ARGS="--batch 16". GPU_OFFLOAD_DRY_RUN=1 as above.
# muon:  memfit.optim.Muon against torch.optim.Muon on CUDA (3 steps, bit for bit: the
#        momentum pass's fmaf against torch's lerp on the GPU), then bench_muon on the
#        GPU (Muon8bit, Muon, torch.optim.Muon; CUDA events; a 4096-wide block's matrices).
# perf:  benchmarks/gpu_perf.py (issue 39): bitwise checks at 1B parameters on fresh random
#        data, then CUDA-event medians of 15 interleaved repetitions of copy, a 16 B/param
#        floor kernel, memfit's 8-bit/4-bit steps, the model layout, torch fused AdamW,
#        bitsandbytes/torchao where importable, quantize/dequantize; one table last and
#        $OUT/gpu_perf.json; then, with the time left (ncu on PATH), one ncu profile of the
#        AdamW8bit step (gpu_perf_ncu.log). Sized for one call of at most 8 minutes with a
#        carried wheel (the build stage then only installs it). GPU_PERF_ARGS adds arguments
#        (--numel, --reps); GPU_PERF_DRY_RUN=1 runs the same stage on the CPU (--dry-run:
#        tiny, the path and the JSON, not the numbers; no ncu).
#
# Each stage is a function stage_NAME and one name in STAGES: a new stage (offload's own,
# say) is a function and a word there.
#
# Peers the device machine lacks travel as wheels (the device README: download them
# here into .whl/, carry .whl, and start the command with its pip install line); this
# script only uses what is importable.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY=()
FAILED=0

# step NAME LOG CMD...: runs CMD with its output appended to $OUT/LOG, and notes the result
step() {
  local name=$1 log=$2 t0=$SECONDS rc
  shift 2
  echo "== $name: $*" | tee -a "$OUT/$log"
  "$@" 2>&1 | tee -a "$OUT/$log"
  rc=${PIPESTATUS[0]}
  SUMMARY+=("| $name | $([ "$rc" = 0 ] && echo ok || echo "FAILED ($rc)") | $((SECONDS - t0)) s | $log |")
  [ "$rc" = 0 ] || FAILED=1
  return "$rc"
}

stage_build() {
  local arch=${MEMFIT_CUDA_ARCHS:-}
  if [ -z "$arch" ]; then
    arch=$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')") || {
      echo "no CUDA device visible to torch: set MEMFIT_CUDA_ARCHS to build anyway"
      SUMMARY+=("| build | FAILED (no GPU) | | |")
      FAILED=1
      return 1
    }
  fi
  if [ -n "${MEMFIT_WHEEL:-}" ]; then
    # a wheel built beforehand for this GPU's architecture saves the lease the build time
    step "install $MEMFIT_WHEEL" build.log $PY -m pip install --no-deps --force-reinstall \
      "$MEMFIT_WHEEL"
  else
    step "build (MEMFIT_CUDA_ARCHS=$arch)" build.log $PY -m pip install --no-build-isolation \
      --no-deps --config-settings=cmake.define.MEMFIT_CUDA=ON \
      --config-settings=cmake.define.MEMFIT_CUDA_ARCHS="$arch" .
  fi &&
    step "memfit sees the GPU" build.log $PY -c "
import memfit
info = memfit.build_info()
print(info, 'devices:', memfit.cuda_device_count())
assert info['cuda'] and memfit.cuda_device_count() > 0, 'memfit was built without CUDA or sees no GPU'"
}

stage_tests() {
  # -x on the first: the other CUDA tests rest on the two devices computing the same bits
  step "pytest: CPU/CUDA bitwise" tests.log $PY -m pytest -m cuda -q -x -k "agree or bitwise" tests
  step "pytest -m cuda" tests.log $PY -m pytest -m cuda -q tests
}

stage_sanitize() {
  if ! command -v compute-sanitizer >/dev/null; then
    SUMMARY+=("| sanitize | FAILED (no compute-sanitizer on PATH) | | |")
    FAILED=1
    return 1
  fi
  local tool
  for tool in memcheck racecheck; do
    step "compute-sanitizer --tool $tool" sanitize.log compute-sanitizer --tool "$tool" \
      --error-exitcode 99 --target-processes all $PY -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_optim.py tests/test_optim_rows.py tests/test_quant.py
  done
}

stage_bench() {
  step bench_optim bench.log $PY benchmarks/bench_optim.py --regimes warm --reps 11 &&
    cp benchmarks/out/bench_optim.json "$OUT/"
  step "bench_gemm --device cuda" bench.log $PY benchmarks/bench_gemm.py --device cuda
  step "bench_quant --device cuda" bench.log $PY benchmarks/bench_quant.py --device cuda
  step "bench_amp_path --device cuda" bench.log $PY benchmarks/bench_amp_path.py --device cuda &&
    cp benchmarks/out/bench_amp_path.json "$OUT/"
}

stage_offload() {
  # the device recipe twice: whether the GPU repeats its own run bit for bit (its backward
  # does not, without --deterministic), before reading the offload rows' bit-exact column
  local size=(--size 1b --steps 3)
  [ "${GPU_OFFLOAD_DRY_RUN:-0}" = 1 ] && size=(--size tiny --device cpu --steps 1 --warmup 1)
  step "bench_offload ${size[*]}" offload.log $PY benchmarks/bench_offload.py "${size[@]}" \
    --recipes device,device,offload,offload+sib,torchao --out "$OUT/bench_offload.json"
}

stage_offload3b() {
  local size=(--size 3b --steps 3 --warmup 1)
  [ "${GPU_OFFLOAD_DRY_RUN:-0}" = 1 ] && size=(--size tiny --device cpu --steps 1 --warmup 1)
  # shellcheck disable=SC2086  # OFFLOAD3B_ARGS: words on purpose
  step "bench_offload ${size[*]} (3b stage)" offload.log \
    $PY benchmarks/bench_offload.py "${size[@]}" \
    --recipes device,offload,device+clip,offload+clip --alone-params 0 \
    --out "$OUT/bench_offload_3b.json" ${OFFLOAD3B_ARGS:-}
}

stage_muon() {
  step "Muon vs torch.optim.Muon on cuda" muon.log $PY -c '
import torch, memfit.optim as mo
torch.manual_seed(0)
a = [torch.randn(1024, 4096, device="cuda", requires_grad=True)]
b = [a[0].detach().clone().requires_grad_()]
ta, mb = torch.optim.Muon(a, lr=0.02), mo.Muon(b, lr=0.02)
for _ in range(3):
    g = torch.randn(1024, 4096, device="cuda")
    a[0].grad, b[0].grad = g.clone(), g.clone()
    ta.step(); mb.step()
d = (a[0] - b[0]).abs().max().item()
print("max |torch - memfit| after 3 steps:", d)
assert d == 0.0, d
' &&
  step "bench_muon --device cuda" muon.log $PY benchmarks/bench_muon.py --device cuda --reps 11 \
    --shapes 4096x12288,4096x4096,4096x16384,16384x4096 &&
    cp benchmarks/out/bench_muon.json "$OUT/"
}

stage_perf() {
  local dry=()
  [ "${GPU_PERF_DRY_RUN:-0}" = 1 ] && dry=(--dry-run)
  # shellcheck disable=SC2086  # GPU_PERF_ARGS: words on purpose
  step "gpu_perf ${dry[*]}" perf.log $PY benchmarks/gpu_perf.py "${dry[@]}" --out "$OUT/gpu_perf.json" \
    ${GPU_PERF_ARGS:-} || return 1
  if [ ${#dry[@]} -eq 0 ] && command -v ncu >/dev/null; then
    # one AdamW8bit step at 256M parameters, the kernel's counters (clocks left alone)
    step "ncu: the 8-bit step" perf.log timeout 150 ncu --clock-control none --kernel-name regex:optim_warp_kernel \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats -o "$OUT/gpu_perf_ncu" -f $PY -c '
import torch
from memfit.optim import _core
n = 1 << 28
p, g = torch.randn(n, device="cuda") * 0.1, torch.randn(n, device="cuda") * 0.01
s1, s2 = (torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for _ in range(2))
a1, a2 = (torch.rand(n // 256, device="cuda") + 0.01 for _ in range(2))
st = torch.full((1,), 3.0, device="cuda")
hp = _core.hparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
for _ in range(4):
    _core.step(_core.ADAMW, 8, 256, hp, [p], [g], [s1], [a1], [s2], [a2], [st])
torch.cuda.synchronize()'
  fi
}

stage_demo() {
  step "memfit demo --device cuda" demo.log $PY -m memfit demo --device cuda --out "$OUT/demo"
}

if [ $# -eq 0 ]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the header above
  exit 2
fi
STAGES="build tests sanitize bench demo offload offload3b muon perf"
for stage in "$@"; do
  case " $STAGES " in
    *" $stage "*) ;;
    *) echo "unknown stage: $stage (${STAGES// /, })" >&2; exit 2 ;;
  esac
done
for stage in "$@"; do
  # the later stages would test whatever memfit was installed before a failed build
  if ! "stage_$stage" && [ "$stage" = build ]; then break; fi
done
echo
echo "| step | result | time | log (in $OUT) |"
echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
