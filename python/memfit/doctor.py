"""`memfit doctor`: what was built, and what this machine offers at run time."""

from __future__ import annotations

import importlib.util
import json
import os
import platform

from memfit import _C

NO_KERNEL_IMAGE = 209  # cudaErrorNoKernelImageForDevice (memfit/cuda_hint.h)


def report() -> dict:
    """Build information plus run-time facts: the CPU (model, vector ISA, whether
    bfloat16 is native, the precision memfit advises for it and why, the optimizer
    kernel chosen), GPUs (name, compute capability, whether bfloat16 is native), CPU
    threads memfit uses, and the frameworks it can see."""
    info = {"build": dict(_C.build_info())}
    archs = info["build"]["cuda_archs"]
    gpus = []
    for i in range(_C.cuda_device_count()):
        d = dict(_C.cuda_device_info(i))
        major, minor = d["capability"]
        d["capability"] = f"{major}.{minor}"
        # whether the build has code this GPU runs; if not, what to rebuild with (the
        # words the first CUDA call's cudaErrorNoKernelImageForDevice would bring)
        d["kernels"] = _C.cuda_archs_run_on(archs, major, minor)
        d["fix"] = None if d["kernels"] else _C.cuda_hint(
            NO_KERNEL_IMAGE, d["driver_version"], d["runtime_version"], archs, major, minor)
        d["bf16_native"] = major >= 8
        d["total_memory_gb"] = round(d.pop("total_memory") / 2**30, 2)
        gpus.append(d)
    from memfit.hardware import cpu_info, cpu_precision
    from memfit.nn.gemm import gemm_backend

    cpu = dict(cpu_info())
    cpu["precision"], cpu["precision_reason"] = cpu_precision()

    info["runtime"] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": _C.get_num_threads(),
        "cpu": cpu,
        "cpu_kernels": _C.cpu_kernels(),  # vector form of the CPU kernels: memfit.cpu_kernels()
        "optim_kernel": _C.optim_kernel(),  # the 8/4-bit optimizer's: memfit.optim_kernel()
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpus": gpus,
        "cuda_usable": bool(gpus) and info["build"]["cuda"],
        "cuda_unavailable": _C.cuda_unavailable(),  # why not, e.g. a driver too old
        # what runs CUDA matrix products (loads cuBLASLt to say so; runs nothing)
        "gemm": gemm_backend("cuda:0") if info["build"]["cuda"] else gemm_backend("cpu"),
    }
    frameworks = {}
    for name in ("torch", "numpy", "ml_dtypes", "cupy", "jax", "bitsandbytes"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            mod = importlib.import_module(name)
            frameworks[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # a broken install should not break the doctor
            frameworks[name] = f"import failed: {e}"
    info["frameworks"] = frameworks
    return info


def format_report(info: dict) -> str:
    b, r = info["build"], info["runtime"]
    c = r["cpu"]
    lines = [
        f"memfit {b['version']}",
        f"  built with   : {b['compiler']}, OpenMP {'yes' if b['openmp'] else 'no'}, "
        f"CUDA {'yes (archs ' + b['cuda_archs'] + ')' if b['cuda'] else 'no'}",
        f"  python       : {r['python']} on {r['platform']}",
        f"  CPU threads  : {r['threads']} of {r['cpu_count']} cores"
        + (f" (OMP_NUM_THREADS={r['omp_num_threads']})" if r["omp_num_threads"] else ""),
        f"  CPU          : {c['model_name']} ({', '.join(filter(None, (c['vendor'], c['arch'])))}), "
        f"vector ISA {c['vector_isa']}, bf16 "
        + (f"native ({', '.join(c['bf16_features'])})" if c["bf16_native"] else "not native (emulated)"),
        f"  CPU precision: {c['precision']}: {c['precision_reason']}",
        f"  CPU kernels  : {r['cpu_kernels']}; 8/4-bit optimizer kernel {r['optim_kernel']}",
    ]
    if r["gpus"]:
        for i, g in enumerate(r["gpus"]):
            lines.append(
                f"  GPU {i}        : {g['name']}, compute {g['capability']}, "
                f"{g['total_memory_gb']} GB, bf16 {'native' if g['bf16_native'] else 'not native (use fp16 + GradScaler)'}"
                + ("" if g["kernels"] else f"; NO KERNELS for it: {g['fix']}")
            )
    elif b["cuda"]:
        lines.append("  GPU          : none usable (CUDA kernels built; CPU kernels in use): "
                     + (r["cuda_unavailable"] or "none visible"))
    else:
        lines.append("  GPU          : not used (CPU-only build)")
    g = r["gemm"]
    if b["cuda"]:
        lt = g["cublaslt"]
        found = f"cuBLASLt {lt['version']} loaded from {lt['path']}" if lt["loaded"] else "cuBLASLt not loaded"
        if g["backend"] == "cublaslt":
            lines.append(f"  CUDA GEMM    : {found}")
        else:
            why = g["reason"] if g["reason"] != lt["reason"] else ""
            lines.append(f"  CUDA GEMM    : {g['backend'] or 'none'} kernel ({found}"
                         + (f": {lt['reason']}" if lt["reason"] else "") + (f"; {why}" if why else "") + ")")
    fw = ", ".join(f"{k} {v}" for k, v in info["frameworks"].items()) or "none"
    lines.append(f"  frameworks   : {fw}")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    info = report()
    print(json.dumps(info, indent=2) if as_json else format_report(info))
    return 0
