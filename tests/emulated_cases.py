"""The CUDA kernels (built on mfemu, cuda/emulate) against the C core, bit for bit.

Runs in a subprocess whose ``memfit`` has the emulated ``_C`` (see emulated_util.py):
``python emulated_cases.py GROUP`` runs the cases of GROUP (quant, optim, unscale, cast,
scaler, gemm, host_queue, device, smoke) and prints one line per mismatch; exit status 1 on any
mismatch or error. Each case calls the same ``memfit._C`` function twice on copies of
the same inputs: once with NumPy arrays (the C core) and once with the arrays wrapped
in :class:`Dev`, which presents their host memory as CUDA device 0 through DLPack, so
the binding sends them to the CUDA launcher and the kernels run on mfemu. The public
Python functions allocate their outputs in the input's framework, which a DLPack
wrapper has not, so the cases call the ``_C`` functions those wrap.
"""
from __future__ import annotations

import ctypes
import sys

import ml_dtypes
import numpy as np

from dlpack_ctypes import DLDataType, DLDevice, DLManagedTensor
from memfit import _C
from memfit.optim import _core, functional

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
BLOCK_SIZES = tuple(_C.quant_block_sizes())


# ---- NumPy host memory presented as a CUDA array (DLPack) ---------------------------------
_DL_CODES = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16), BF16: (4, 16),
             np.dtype(np.uint8): (1, 8)}
_DL_CUDA = 2
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Dev:
    """A contiguous NumPy array exported through DLPack as a kDLCUDA array of device 0
    (the memory stays the array's: mfemu's "device" memory is host memory)."""

    def __init__(self, a: np.ndarray):
        assert a.flags.c_contiguous
        self.a = a
        self.shape = a.shape
        self.dtype = a.dtype
        self._keep = []

    def __dlpack_device__(self):
        return (_DL_CUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, **_):
        code, bits = _DL_CODES[self.a.dtype]
        shape = (ctypes.c_int64 * max(self.a.ndim, 1))(*self.a.shape)
        m = DLManagedTensor()
        m.dl_tensor.data = self.a.ctypes.data
        m.dl_tensor.device = DLDevice(_DL_CUDA, 0)
        m.dl_tensor.ndim = self.a.ndim
        m.dl_tensor.dtype = DLDataType(code, bits, 1)
        m.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        m.dl_tensor.strides = None
        self._keep.append((m, shape))  # the capsule has no deleter: the wrapper owns both
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)


class _MfTensor(ctypes.Structure):  # mf_tensor (memfit/common.h)
    _fields_ = [("data", ctypes.c_void_p), ("numel", ctypes.c_int64), ("dtype", ctypes.c_int),
                ("device", ctypes.c_int), ("device_id", ctypes.c_int)]
    _DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 2}

    @classmethod
    def of(cls, a: np.ndarray):
        return cls(a.ctypes.data, a.size, cls._DTYPES[a.dtype], 1, 0)  # MF_CUDA, device 0


def dev(x):
    return None if x is None else Dev(x)


# ---- comparison ------------------------------------------------------------------------
class Report:
    def __init__(self):
        self.cases = 0
        self.failures = []

    def same(self, case: str, name: str, cpu, gpu):
        """Every byte of cpu and gpu (NumPy arrays) equal."""
        cb, gb = np.ascontiguousarray(cpu).view(np.uint8).ravel(), np.ascontiguousarray(gpu).view(np.uint8).ravel()
        if cb.shape == gb.shape and np.array_equal(cb, gb):
            return True
        c, g = np.ascontiguousarray(cpu).ravel(), np.ascontiguousarray(gpu).ravel()
        eq = c.view(np.uint8).reshape(c.size, -1) == g.view(np.uint8).reshape(g.size, -1) if c.size == g.size else None
        if eq is None:
            self.failures.append(f"{case}: {name}: sizes differ ({c.size} vs {g.size})")
            return False
        bad = np.flatnonzero(~eq.all(axis=1))
        i = int(bad[0])
        self.failures.append(f"{case}: {name}: {bad.size} of {c.size} elements differ; first at "
                             f"index {i}: cpu {c[i]!r}, cuda {g[i]!r}")
        return False

    def close(self, case, name, cpu, gpu, rtol):
        cpu, gpu = float(np.asarray(cpu).ravel()[0]), float(np.asarray(gpu).ravel()[0])
        if cpu == gpu or abs(cpu - gpu) <= rtol * abs(cpu):
            return True
        self.failures.append(f"{case}: {name}: cpu {cpu!r}, cuda {gpu!r} (rtol {rtol})")
        return False

    def run(self, case, fn):
        self.cases += 1
        try:
            fn()
        except Exception as e:  # an error on one side only is a finding too
            self.failures.append(f"{case}: {type(e).__name__}: {e}")


def _special(x: np.ndarray, rng) -> np.ndarray:
    """x with NaN, +-Inf and a run of zeros planted (when it is long enough)."""
    if x.size >= 8:
        idx = rng.choice(x.size, size=3, replace=False)
        x.flat[idx[0]] = np.nan
        x.flat[idx[1]] = np.inf
        x.flat[idx[2]] = -np.inf
    if x.size >= 300:
        x.flat[64:192] = 0
    return x


def _data(rng, n, dtype, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32).astype(dtype)


# ---- quant.cu ---------------------------------------------------------------------------
def group_quant(r: Report, rng):
    code = np.empty(256, np.float32)
    _C.dynamic_map(code, True, 8, 7)
    for dtype in DTYPES:
        for bs in BLOCK_SIZES:
            for n in (1, 63, 64, 1000, bs, 3 * bs + 5, 4 * bs + 4096 + 17):
                for stochastic in (False, True):
                    if stochastic and n not in (1000, 3 * bs + 5):
                        continue
                    x = _data(rng, n, dtype, scale=float(rng.choice([1e-3, 1.0, 300.0])))
                    if n >= 300:
                        _special(x, rng)
                    case = f"quant {dtype.name} bs={bs} n={n} stochastic={stochastic}"

                    def one(x=x, bs=bs, n=n, stochastic=stochastic, case=case, dtype=dtype):
                        nb = -(-n // bs)
                        out = {}
                        for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                            codes = np.full(n, 7, np.uint8)
                            absmax = np.full(nb, 5.0, np.float32)
                            _C.quantize_blockwise(w(x), w(code), w(codes), w(absmax), bs, stochastic, 1234 + n, 0)
                            deq = np.full(n, 3, dtype)
                            _C.dequantize_blockwise(w(codes), w(absmax), w(code), w(deq), bs, 0)
                            out[side] = (codes, absmax, deq)
                        for k, name in enumerate(("codes", "absmax", "dequantized")):
                            r.same(case, name, out["cpu"][k], out["cuda"][k])

                    r.run(case, one)


# ---- optim.cu ---------------------------------------------------------------------------
# (kind, bits, momentum, extra hyperparameters)
OPTIM_SETUPS = [
    ("adamw", 8, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ("adam", 8, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, maximize=True)),
    ("adamw", 4, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ("adamw", 32, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ("lion", 8, 0.0, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)),
    # AdEMAMix with both schedulers on (mid-schedule: mf_exp_f64 on both sides)
    ("ademamix", 8, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0,
                              t_alpha=3, t_beta3=4, eps=1e-8, weight_decay=0.01)),
    ("ademamix", 4, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, beta3=0.999, alpha=2.0,
                              t_beta3=5, eps=1e-8, maximize=True)),
    ("ademamix", 32, 0.0, dict(lr=1e-2, beta1=0.8, beta2=0.99, beta3=0.9999, alpha=8.0,
                               t_alpha=2, t_beta3=3, eps=1e-8, weight_decay=0.1)),
    ("lion", 4, 0.0, dict(lr=1e-3, beta1=0.9, beta2=0.99)),
    ("sgd", 8, 0.9, dict(lr=1e-2, momentum=0.9, dampening=0.1, nesterov=False)),
    ("sgd", 8, 0.9, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", 32, 0.0, dict(lr=1e-2)),
    ("rmsprop", 8, 0.0, dict(lr=1e-3, alpha=0.99, eps=1e-8)),
    ("rmsprop", 8, 0.9, dict(lr=1e-3, alpha=0.99, eps=1e-8, momentum=0.9)),
    ("rmsprop", 4, 0.9, dict(lr=1e-3, alpha=0.99, eps=1e-8, momentum=0.9)),
    ("adam", 32, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)),
    ("adagrad", 8, 0.0, dict(lr=1e-2, lr_decay=0.1, eps=1e-10, weight_decay=0.01)),
    ("adagrad", 4, 0.0, dict(lr=1e-2, eps=1e-10)),
    ("adagrad", 32, 0.0, dict(lr=1e-2, lr_decay=0.5, eps=1e-10, maximize=True)),
    # Muon's momentum pass: `params` is its output (the update), never read
    ("muon", 8, 0.95, dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)),
    ("muon", 4, 0.95, dict(lr=0.02, momentum=0.95, nesterov=False)),
    ("muon", 32, 0.3, dict(lr=0.02, momentum=0.3, nesterov=True)),
]
MUON_SETUPS = OPTIM_SETUPS[-3:]
# the trust ratio (LAMB, LARS: optim.h's norm pass, then the scaled update); the
# scratch's float64 sums are compared bit for bit too. Data of scale 1 and Adam's
# near-unit first directions: max_unorm 0.5 clips, 1e3 does not.
TRUST_SETUPS = [
    ("adamw", 8, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           max_unorm=0.5)),
    ("adamw", 4, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, max_unorm=1e3)),
    ("adam", 32, 0.0, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           max_unorm=0.5, bias_correction=False)),
    ("sgd", 8, 0.9, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, max_unorm=0.02)),
    ("sgd", 32, 0.9, dict(lr=1e-2, momentum=0.9, dampening=0.1, max_unorm=0.02, maximize=True)),
    ("sgd", 8, 0.0, dict(lr=1e-2, weight_decay=0.01, max_unorm=0.02)),  # no momentum: no state
]
# functional.init has no "muon" (its step writes no parameter): Muon's states are laid
# out as SGD's with momentum (one signed state), which init makes; Adagrad's one unsigned
# state as RMSprop's without momentum
_INIT_KIND = {"muon": "sgd", "adagrad": "rmsprop"}
_KINDS = dict(functional._KINDS, muon=_core.MUON, adagrad=_core.ADAGRAD)
ADAGRAD8 = next(s for s in OPTIM_SETUPS if s[:2] == ("adagrad", 8))

STATE_KEYS = ("state1", "absmax1", "state2", "absmax2", "step", "kahan_comp", "trust", "state3",
              "absmax3")


def _optim_call(kind, bits, bs, hp, params, grads, states, w, grad_scale=None, found_inf=None):
    k = _KINDS[kind]
    code1, code2 = _core.codes_for(k, bits, hp, np.zeros(1, np.float32))
    comps = [s["kahan_comp"] for s in states]
    _C.optim_step(k, bits, bs, hp, [w(p) for p in params], [w(g) for g in grads],
                  [dev_or(w, s["state1"]) for s in states], [dev_or(w, s["absmax1"]) for s in states],
                  [dev_or(w, s["state2"]) for s in states], [dev_or(w, s["absmax2"]) for s in states],
                  [w(s["step"]) for s in states], code1=dev_or(w, code1), code2=dev_or(w, code2),
                  grad_scale=dev_or(w, grad_scale), found_inf=dev_or(w, found_inf), stream=0,
                  comps=None if all(c is None for c in comps) else [dev_or(w, c) for c in comps],
                  rows=[s["rows"] for s in states], index_base=None,
                  trust=[w(s["trust"]) for s in states] if hp["max_unorm"] > 0 else None,
                  state3=[dev_or(w, s.get("state3")) for s in states],
                  absmax3=[dev_or(w, s.get("absmax3")) for s in states])


def dev_or(w, x):
    return None if x is None else w(x)


def optim_case(r: Report, rng, case, kind, bits, bs, momentum, hp_kw, shapes, dtype, steps=2,
               kahan=False, sr=False, scaled=False, nan_grad=False):
    def one():
        hp = _core.hparams(**hp_kw, sr_seed=977 if sr else 0)
        params = [_data(rng, int(np.prod(s)), dtype).reshape(s) for s in shapes]
        states = [functional.init(_INIT_KIND.get(kind, kind), p, bits=bits, block_size=bs, momentum=momentum, kahan=kahan)
                  for p in params]
        for p, s in zip(params, states):  # the trust ratio's scratch (float64 as float32 words)
            s["trust"] = (np.zeros(_core.trust_numel(p.size) // 2).view(np.float32)
                          if hp["max_unorm"] > 0 else None)
        side = {name: ([p.copy() for p in params], [{k: (v.copy() if isinstance(v, np.ndarray) else v)
                                                     for k, v in s.items()} for s in states])
                for name in ("cpu", "cuda")}
        for t in range(steps):
            grads = [_data(rng, p.size, dtype, scale=0.1).reshape(p.shape) for p in params]
            if nan_grad and t == 1:
                for g in grads:
                    if g.size > 3:
                        g.flat[g.size // 2] = np.nan
            gs = fi = None
            if scaled:
                gs = np.array([1024.0], np.float32)
                fi = np.array([1.0 if t == 1 else 0.0], np.float32)  # step 1 is skipped
                grads = [(g.astype(np.float32) * 1024).astype(dtype) for g in grads]
            for name, w in (("cpu", lambda a: a), ("cuda", Dev)):
                ps, ss = side[name]
                _optim_call(kind, bits, bs, hp, ps, grads, ss, w, gs, fi)
        for i in range(len(params)):
            r.same(case, f"param[{i}]", side["cpu"][0][i], side["cuda"][0][i])
            for k in STATE_KEYS:
                if side["cpu"][1][i].get(k) is not None:
                    r.same(case, f"{k}[{i}]", side["cpu"][1][i][k], side["cuda"][1][i][k])
    r.run(case, one)


def group_optim(r: Report, rng, full=True):
    f32 = np.dtype(np.float32)
    # every set-up x every block size: tensors that straddle the 4096-element items of the
    # packer, an odd row count and 1-element rows, an empty tensor
    shapes = [(4096 + 300,), (3, 1000), (0,), (5, 1), (1,), (2, 4096 + 65)]
    for kind, bits, momentum, hp in OPTIM_SETUPS:
        for bs in (BLOCK_SIZES if bits != 32 else (256,)):
            optim_case(r, rng, f"optim {kind}{bits} bs={bs} m={momentum}", kind, bits, bs, momentum, hp,
                       shapes, f32)
    for kind, bits, momentum, hp in TRUST_SETUPS:  # 4 and 5 chunks of the norm pass, odd sizes
        bs = 256 if bits != 4 else 128
        optim_case(r, rng, f"trust {kind}{bits} {hp['max_unorm']}", kind, bits, bs, momentum, hp,
                   shapes + [(3, 5001), (4 * 4096 + 1,)], f32, steps=3)
    if not full:
        return
    for kind, bits, momentum, hp in TRUST_SETUPS:
        bs = 256 if bits != 4 else 128
        optim_case(r, rng, f"trust {kind}{bits} bf16 kahan", kind, bits, bs, momentum, hp, shapes,
                   BF16, kahan=True)
        optim_case(r, rng, f"trust {kind}{bits} grad_scale/found_inf", kind, bits, bs, momentum, hp,
                   shapes, f32, steps=3, scaled=True)
        optim_case(r, rng, f"trust {kind}{bits} NaN gradient", kind, bits, bs, momentum, hp, shapes,
                   f32, steps=3, nan_grad=True)
    # more chunks than lanes (256): the chunk sums' own lanes and tree
    kind, bits, momentum, hp = TRUST_SETUPS[0]
    optim_case(r, rng, "trust adamw8 258 chunks", kind, bits, 256, momentum, hp,
               [(258 * 4096 - 3,)], f32, steps=2)
    many = [(int(n),) for n in rng.integers(1, 3000, size=40)]  # > kMaxTensors (28): two launches
    for kind, bits, momentum, hp in (OPTIM_SETUPS[0], OPTIM_SETUPS[2], OPTIM_SETUPS[3]):
        optim_case(r, rng, f"optim {kind}{bits} 40 tensors", kind, bits, 256 if bits == 8 else 128,
                   momentum, hp, many, f32)
    for dtype in (np.dtype(np.float16), BF16):
        for kind, bits, momentum, hp in MUON_SETUPS:  # an update in the gradient's dtype
            optim_case(r, rng, f"optim {kind}{bits} {dtype.name}", kind, bits,
                       256 if bits == 8 else 128, momentum, hp, shapes, dtype)
        for kind, bits, momentum, hp in (OPTIM_SETUPS[0], OPTIM_SETUPS[2], OPTIM_SETUPS[3], OPTIM_SETUPS[6],
                                         ADAGRAD8):
            base = f"optim {kind}{bits} {dtype.name}"
            bs = 256 if bits == 8 else 128
            optim_case(r, rng, base, kind, bits, bs, momentum, hp, shapes, dtype)
            optim_case(r, rng, base + " kahan", kind, bits, bs, momentum, hp, shapes, dtype, kahan=True)
            optim_case(r, rng, base + " stochastic rounding", kind, bits, bs, momentum, hp, shapes, dtype,
                       sr=True)
    for kind, bits, momentum, hp in (OPTIM_SETUPS[0], OPTIM_SETUPS[2], OPTIM_SETUPS[3], ADAGRAD8,
                                     *MUON_SETUPS):
        bs = 256 if bits == 8 else 128
        optim_case(r, rng, f"optim {kind}{bits} grad_scale/found_inf", kind, bits, bs, momentum, hp,
                   shapes, f32, steps=3, scaled=True)
        optim_case(r, rng, f"optim {kind}{bits} NaN gradient", kind, bits, bs, momentum, hp, shapes, f32,
                   steps=3, nan_grad=True)
        optim_case(r, rng, f"optim {kind}{bits} 5 steps", kind, bits, bs, momentum, hp,
                   [(7, 333), (64,)], f32, steps=5)


# ---- unscale.cu -------------------------------------------------------------------------
def _grads(rng, sizes, dtypes):
    return [_data(rng, int(n), dtypes[i % len(dtypes)], scale=10.0) for i, n in enumerate(sizes)]


def group_unscale(r: Report, rng):
    sizes = list(rng.integers(0, 5000, size=130)) + [70000, 1, 0]  # > 96: two launches and more
    for label, poison, scale in (("finite", False, 65536.0), ("inf", True, 1024.0), ("scale 1", False, 1.0),
                                 ("no scale", False, None)):
        case = f"unscale {label}"

        def one(poison=poison, scale=scale, case=case):
            grads = _grads(rng, sizes, DTYPES)
            if poison:
                grads[77][3] = np.inf
            out = {}
            for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                gs = [g.copy() for g in grads]
                fi = np.zeros(1, np.float32)
                s = None if scale is None else np.array([scale], np.float32)
                _C.unscale_grads([w(g) for g in gs], dev_or(w, s), w(fi), 0)
                out[side] = (gs, fi)
            for i in range(len(grads)):
                r.same(case, f"grads[{i}]", out["cpu"][0][i], out["cuda"][0][i])
            r.same(case, "found_inf", out["cpu"][1], out["cuda"][1])
        r.run(case, one)

    for norm_type in (2.0, 1.0, float("inf"), 3.0):
        for label, poison in (("finite", False), ("nan", True)):
            case = f"grad_norm p={norm_type} {label}"

            def one(norm_type=norm_type, poison=poison, case=case):
                grads = _grads(rng, sizes, DTYPES)
                if poison:
                    grads[5][1] = np.nan
                nchunks = max(1, _C.mt_num_chunks([g.size for g in grads]))
                res = {}
                for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                    ws = np.zeros(nchunks, np.float32)
                    out = np.zeros(1, np.float32)
                    _C.grad_norm([w(g) for g in grads], norm_type, w(ws), w(out), 0)
                    res[side] = out
                    # clip with the norm this side computed
                    gs = [g.copy() for g in grads]
                    _C.clip_grads([w(g) for g in gs], w(out.copy()), 1.0, 0)
                    res[side + "_clipped"] = gs
                if np.isinf(norm_type) or poison:
                    r.same(case, "norm", res["cpu"], res["cuda"])  # max: exact; NaN: NaN
                else:
                    # sums: the kernel adds per-thread partials, then per chunk, then in a
                    # float64 tree; the CPU in its own order: float rounding differs
                    r.close(case, "norm", res["cpu"], res["cuda"], 1e-6)
                if res["cpu"].tobytes() == res["cuda"].tobytes():
                    for i in range(len(grads)):
                        r.same(case, f"clipped[{i}]", res["cpu_clipped"][i], res["cuda_clipped"][i])
            r.run(case, one)

    case = "clip_grads with a given norm"

    def clip():
        grads = _grads(rng, sizes, DTYPES)
        for norm in (0.5, 3.0, 1e30, np.inf):
            out = {}
            for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                gs = [g.copy() for g in grads]
                _C.clip_grads([w(g) for g in gs], w(np.array([norm], np.float32)), 2.0, 0)
                out[side] = gs
            for i in range(len(grads)):
                r.same(f"{case} {norm}", f"grads[{i}]", out["cpu"][i], out["cuda"][i])
    r.run(case, clip)


# ---- cast.cu ----------------------------------------------------------------------------
def group_cast(r: Report, rng):
    for src in DTYPES:
        for dst in DTYPES:
            for stochastic in (False, True):
                for n in (1, 1000, 70001):
                    case = f"cast {src.name}->{dst.name} stochastic={stochastic} n={n}"

                    def one(src=src, dst=dst, stochastic=stochastic, n=n, case=case):
                        x = _special(_data(rng, n, np.float32, scale=float(rng.choice([1e-6, 1.0, 7e4]))), rng)
                        x = x.astype(src)
                        out = {}
                        for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                            o = np.full(n, 9, dst)
                            _C.cast(w(x), w(o), stochastic, 4321 + n, 0)
                            out[side] = o
                        r.same(case, "out", out["cpu"], out["cuda"])
                    r.run(case, one)


# ---- scaler.cu --------------------------------------------------------------------------
def group_scaler(r: Report, rng):
    words = _C.scaler_layout()["words"]

    def one():
        st = {}
        for side in ("cpu", "cuda"):
            s = np.zeros(words, np.float32)  # 32-bit words, as memfit.amp keeps them
            _C.scaler_state_init(s, 65536.0, 0)
            st[side] = s
        cfg = (2.0, 0.5, 3, 2, 1.0, 2.0**24, True)  # growth every 3, hysteresis 2
        for t in range(50):
            flags = [np.array([float(rng.random() < 0.3)], np.float32) for _ in range(3)]
            loss = np.array([float(rng.random() < 0.1)], np.float32)
            with_loss = t % 2 == 0
            for side, w in (("cpu", lambda a: a), ("cuda", Dev)):
                _C.scaler_update(w(st[side]), [w(f) for f in flags], w(loss) if with_loss else None, cfg, 0)
            if not r.same(f"scaler update {t}", "state", st["cpu"], st["cuda"]):
                break
    r.run("scaler 50 updates", one)


# ---- gemm.cu ----------------------------------------------------------------------------
def group_gemm(r: Report, rng):
    from memfit.nn import gemm as _gemm
    acts = sorted(set(_gemm.ACTIVATIONS.values()))
    sizes = [(1, 1, 1), (5, 7, 3), (64, 64, 16), (65, 63, 17), (130, 70, 40), (3, 200, 0)]
    for m, n, k in sizes:
        for ta in (False, True):
            for tb in (False, True):
                for dtype in DTYPES:
                    act = int(rng.integers(0, max(acts) + 1))
                    with_bias, with_pre = bool(rng.random() < 0.6), bool(rng.random() < 0.5)
                    case = f"gemm m={m} n={n} k={k} ta={ta} tb={tb} {dtype.name} act={act} bias={with_bias} pre={with_pre}"

                    def one(m=m, n=n, k=k, ta=ta, tb=tb, dtype=dtype, act=act, with_bias=with_bias,
                            with_pre=with_pre, case=case):
                        a = _data(rng, m * k, dtype).reshape((k, m) if ta else (m, k))
                        b = _data(rng, k * n, dtype).reshape((n, k) if tb else (k, n))
                        bias = _data(rng, n, dtype) if with_bias else None
                        # The products are not bit-comparable with the C core (it sums in
                        # KC slices and uses FMA where the CPU has it), so: (1) the
                        # kernel's float32 accumulator equals the sum in its own order,
                        # p = 0 .. k-1, each product and sum rounded to float32; (2) its
                        # epilogue equals the C core's, given that accumulator
                        # (acc @ identity is exact in any summation order). Same for act_forward.
                        af = (a.T if ta else a).astype(np.float32)
                        bf = (b.T if tb else b).astype(np.float32)
                        acc = np.zeros((m, n), np.float32)
                        for p in range(k):
                            acc += af[:, p:p + 1] * bf[p:p + 1, :]
                        acc_gpu = np.full((m, n), 5, np.float32)
                        _C.gemm(Dev(a), ta, Dev(b), tb, Dev(acc_gpu), m, n, k, None, 0, None, 0)
                        last = _C.gemm_last_backend()  # cuBLASLt declined: it did not load
                        if k and m and n and (last[0] != "portable" or "MEMFIT_CUBLASLT" not in last[1]):
                            r.failures.append(f"{case}: expected the portable kernel after cuBLASLt declined, got {last}")
                        r.same(case, "accumulator", acc, acc_gpu)
                        out = {}
                        for side, w in (("cpu", lambda x: x), ("cuda", Dev)):
                            c = np.full((m, n), 5, dtype)
                            pre = np.full((m, n), 6, np.float32) if with_pre else None
                            if side == "cpu":
                                _C.gemm(acc, False, np.eye(n, dtype=np.float32), False, c, m, n, n, bias, act, pre, 0)
                            else:
                                _C.gemm(w(a), ta, w(b), tb, w(c), m, n, k, dev_or(w, bias), act, dev_or(w, pre), 0)
                            out[side] = (c, pre)
                        r.same(case, "c", out["cpu"][0], out["cuda"][0])
                        if with_pre:
                            r.same(case, "pre", out["cpu"][1], out["cuda"][1])
                    r.run(case, one)
    for act in acts:
        for dtype in DTYPES:
            case = f"act_backward act={act} {dtype.name}"

            def back(act=act, dtype=dtype, case=case):
                n = 5000
                dy, pre = _data(rng, n, dtype), _special(_data(rng, n, np.float32, scale=3.0), rng)
                out = {}
                for side, w in (("cpu", lambda x: x), ("cuda", Dev)):
                    d = np.full(n, 1, dtype)
                    _C.act_backward(w(dy), w(pre), w(d), act, 0)
                    out[side] = d
                r.same(case, "dpre", out["cpu"], out["cuda"])
            r.run(case, back)
    # act_forward_kernel: no binding calls mf_cuda_act_forward, so ctypes does; the C
    # core's forward activation is its GEMM epilogue, given x through an identity product
    lib = ctypes.CDLL(_C.__file__)
    for act in acts:
        for dtype in DTYPES:
            case = f"act_forward act={act} {dtype.name}"

            def fwd(act=act, dtype=dtype, case=case):
                n = 3000
                x = _special(_data(rng, n, np.float32, scale=3.0), rng).astype(dtype)
                y = np.full(n, 2, dtype)
                st = lib.mf_cuda_act_forward(ctypes.byref(_MfTensor.of(x)), ctypes.byref(_MfTensor.of(y)),
                                             act, None)
                if st:
                    raise RuntimeError(f"mf_cuda_act_forward: status {st}")
                ref = np.full((1, n), 2, dtype)
                _C.gemm(np.ones((1, 1), np.float32), False, x.astype(np.float32).reshape(1, n), False,
                        ref, 1, n, 1, None, act, None, 0)  # [1] . x (1 x n): c = act(x)
                r.same(case, "y", ref.ravel(), y)
            r.run(case, fwd)


# ---- host_queue.cu --------------------------------------------------------------------
def group_host_queue(r: Report, rng):
    """The host queue's copies with a CUDA side (host_queue.cu: cudaMemcpyAsync, then the
    event record) against its host-to-host memcpy, every direction, and an event wait."""
    q = _C.HostQueue(1)
    for dtype in (np.dtype(np.uint8), np.dtype(np.float32), BF16):
        for n in (1, 4097, 1 << 18):
            for way in ("h2d", "d2h", "d2d"):
                case = f"host queue copy {way} {dtype.name} n={n}"

                def one(dtype=dtype, n=n, way=way, case=case):
                    src = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
                    out = {}
                    for side in ("cpu", "cuda"):
                        dst = np.zeros(n, dtype)
                        d, s = dst, src
                        if side == "cuda":
                            d = Dev(dst) if way in ("h2d", "d2d") else dst
                            s = Dev(src) if way in ("d2h", "d2d") else src
                        q.submit_copy(d, s)
                        q.wait()
                        out[side] = dst
                    r.same(case, "dst", out["cpu"], out["cuda"])
                    r.same(case, "src", src, out["cuda"])
                r.run(case, one)

    def event_wait():
        q.submit_event_wait(1)  # mfemu's events are ordered no-ops: any handle
        q.wait()
    r.run("host queue event wait", event_wait)
    q.stop()


GROUPS = {"quant": group_quant, "optim": group_optim, "unscale": group_unscale, "cast": group_cast,
          "scaler": group_scaler, "gemm": group_gemm, "host_queue": group_host_queue}


def main(argv):
    r = Report()
    for name in argv[1:]:
        if name == "optim-small":
            group_optim(r, np.random.default_rng(11), full=False)
        else:
            GROUPS[name](r, np.random.default_rng(sum(map(ord, name))))
    for f in r.failures[:50]:
        print("MISMATCH", f)
    print(f"{r.cases} cases, {len(r.failures)} mismatches")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
