"""Will it fit, with offload: where each byte of a training recipe lives (the GPU or
the host), and the largest model of a family that fits each GPU per recipe.

Five recipes (``RECIPES``). Bytes per parameter, for p parameters; 16-bit means bf16
where the GPU has it and fp16 with a GradScaler on a T4 (the same bytes either way):

=============================  ==============================  ================================
recipe                         device                          host
=============================  ==============================  ================================
torch AdamW                    4 weights (float32, 16-bit      -
                               autocast) + 4 gradients + 8
                               states = 16
memfit 8-bit                   2 weights + 2 gradients +       -
                               2.03 states = 6.03
8-bit + step in backward       2 + 2.03 = 4.03, and the        -
                               gradients alive (below)
8-bit + offload                2, and a gradient staging       2.03 states + 2 master weights
(step in backward)             (below)                         (the parameter's dtype, updated
                                                               with stochastic rounding) = 4.03,
                                                               and staging
8-bit + offload, gradients     as above                        2.03 + 2 masters + 2 gradients
kept for the step                                              = 6.03, and staging
=============================  ==============================  ================================

- 8-bit states: 2 B (two 8-bit moments) + 2 float32 absmax per 256 values (0.03 B);
  1-D tensors (biases, norms) keep float32 states, 8 B (memfit.memory.OPTIMIZER_BYTES
  and estimate(): the one definition). ``kahan=True`` adds its 2 B buffer to the
  states of 16-bit weights, on the device or on the host.
- Step in backward (torchtune's recipe): each tensor steps as soon as its gradient is
  accumulated, and the gradient is freed, so at most the largest gradient is alive; with
  tied embeddings the shared matrix's gradient waits from the output head (start of
  backward) to the embedding (its end), so the largest other gradient comes on top.
  With gradient accumulation (micro-batch < batch) nothing can step before the last
  micro-batch: every gradient is kept, as in "memfit 8-bit".
- Offload (memfit.optim.CPUOffloadOptimizer with ``offload_gradients=True``): the
  device keeps the 16-bit parameters and nothing of the optimizer; each gradient leaves
  the device as soon as it is accumulated. With ``step_in_backward=True`` each tensor
  steps on the host as its gradient lands, so staging is bounded: ``STAGING_SLOTS``
  gradients of the largest tensor's size in flight on the device, and as many on the
  host. A GradScaler or global clipping needs every gradient before any step: the host
  then keeps the gradients until the step, in their dtype (2 B/param), as p.grad would
  on the device ("gradients kept for the step"); so does gradient accumulation, which
  sums them across micro-batches.
- Activations and temporary buffers (the logits' gradient, the CUDA context): on the
  device, as memfit.memory.estimate counts them for the recipe's precision ("bf16"
  autocast for torch AdamW, "bf16-pure" for the 16-bit recipes). On the host every
  recipe also needs the process itself: ``HOST_RUNTIME_BYTES``.

Issue 32's host target of 4 B/param without fp32 masters is the step-in-backward
offload's count but for the absmax (0.03 B/param) and the float32 states of 1-D tensors
(under 0.1 % of a transformer's parameters). The offloader keeps master weights in the
parameter's dtype (float32 masters only for float32 parameters), so there is no
16-bit recipe with float32 masters.

The largest model of a family keeps the model's shape (width, heads, vocabulary) and
searches its number of layers: the most layers whose device bytes fit the GPU and whose
host bytes fit the host. Every component grows with the layer count, so the search
bisects; ``limit`` says whether the GPU or the host memory stopped it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memfit import memory

# Bounded staging of the offloader: gradients of the largest tensor's size, on each
# side. Two (double buffering): one copied while the next is produced.
STAGING_SLOTS = 2

# The host memory of the training process itself (Python, torch, the CUDA libraries):
# a typical figure, not measured here (import torch alone is 0.5 GiB on a CPU machine).
HOST_RUNTIME_BYTES = 2 * memory.GB

# Host memory of common machines, GiB (as the machine reports it: a free Colab says
# "System RAM 12.7 GB", 12.7 GiB of MemTotal).
HOSTS = {"colab": 12.7}


@dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    short: str  # a column heading of at most 20 characters
    precision: str  # memory.Setup precision: "bf16" (autocast, float32 weights) or "bf16-pure" (16-bit)
    optimizer: str  # memory.OPTIMIZER_BYTES key
    # "all" (kept until the step), "backward" (freed as made), "offload" (leave as made and
    # step as they land), "offload-keep" (leave as made, kept on the host until the step)
    gradients: str
    master_bytes: int = 0  # host master weights per parameter; 0: states stay on the device


RECIPES = (
    Recipe("torch-adamw", "torch AdamW", "torch AdamW", "bf16", "adamw", "all"),
    Recipe("8bit", "memfit 8-bit", "memfit 8-bit", "bf16-pure", "adamw8bit", "all"),
    Recipe("8bit-backward", "8-bit + step in backward", "step in backward", "bf16-pure", "adamw8bit", "backward"),
    Recipe("8bit-offload", "8-bit + offload", "offload", "bf16-pure", "adamw8bit", "offload", master_bytes=2),
    Recipe("8bit-offload-keep", "8-bit + offload, gradients kept", "offload, grads kept", "bf16-pure", "adamw8bit",
           "offload-keep", master_bytes=2),
)

PARTS = ("parameters", "gradients", "states", "activations", "temporary")


@dataclass
class Placement:
    """The bytes of one recipe: ``device`` and ``host`` map each of PARTS to bytes
    (parameters: weights on the device, master weights on the host; gradients: kept,
    alive or staged; temporary: the logits' gradient and the CUDA context on the
    device, the process itself on the host). ``bounded``: bytes of the gradients alive
    or staged, per side, which grow with the largest tensor, not with the parameter
    count."""

    recipe: Recipe
    n_params: int
    device: dict
    host: dict
    bounded: dict

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def per_param(self, side: str) -> float:
        """Bytes per parameter on ``side`` ("device" or "host"): parameters, gradients and
        states, without the bounded staging, activations and buffers (the module
        docstring's table)."""
        part = getattr(self, side)
        scaled = part["parameters"] + part["gradients"] + part["states"] - self.bounded[side]
        return scaled / max(self.n_params, 1)

    def as_dict(self) -> dict:
        return {"recipe": self.recipe.key, "label": self.recipe.label, "params": self.n_params,
                "device": dict(self.device, total=self.device_total),
                "host": dict(self.host, total=self.host_total), "bounded": dict(self.bounded),
                "device_bytes_per_param": self.per_param("device"),
                "host_bytes_per_param": self.per_param("host")}


def gradients_alive(spec: memory.ModelSpec) -> int:
    """Elements of the gradients alive at once when each steps as soon as it is made (see
    the module docstring); every parameter for a model without a known layout."""
    sizes = spec.tensor_numels()
    if sizes is None:
        return spec.n_params()
    alive = max(sizes.values())
    if spec.tied_embeddings:
        alive += max(v for k, v in sizes.items() if k != "embedding")
    return min(alive, spec.n_params())


def place(spec: memory.ModelSpec, setup: memory.Setup, recipe: Recipe) -> Placement:
    """Device and host bytes of training ``spec`` with ``recipe``; batch, sequence,
    micro-batch, checkpointing, attention, kahan and gpu come from ``setup``."""
    s = replace(setup, precision=recipe.precision, optimizer=recipe.optimizer)
    est = memory.estimate(spec, s)
    p, elem = est.n_params, memory.param_bytes(recipe.precision)
    accumulating = s.micro < s.batch
    sizes = spec.tensor_numels()
    device = dict.fromkeys(PARTS, 0)
    host = dict.fromkeys(PARTS, 0)
    bounded = {"device": 0, "host": 0}
    device.update(parameters=est.weights, activations=est.activations, temporary=est.temporary)
    host["temporary"] = HOST_RUNTIME_BYTES
    if recipe.gradients == "all" or (recipe.gradients == "backward" and accumulating):
        device["gradients"] = est.gradients
    elif recipe.gradients == "backward":
        device["gradients"] = bounded["device"] = gradients_alive(spec) * elem
    else:  # offload: whole gradients in flight on the device, as many slots on the host
        staging = STAGING_SLOTS * (max(sizes.values()) if sizes else p) * elem
        device["gradients"] = bounded["device"] = staging
        if recipe.gradients == "offload-keep" or accumulating:
            host["gradients"] = p * elem  # every gradient, until the step
        else:
            host["gradients"] = bounded["host"] = staging
    if recipe.master_bytes:
        host["parameters"] = p * recipe.master_bytes
        host["states"] = est.optimizer
    else:
        device["states"] = est.optimizer
    return Placement(recipe, p, device, host, bounded)


def placements(spec: memory.ModelSpec, setup: memory.Setup) -> list:
    return [place(spec, setup, r) for r in RECIPES]


def fits(pl: Placement, gpu_bytes: int, host_bytes: int | None) -> tuple:
    """(fits the GPU, fits the host); the host always fits when its size is unknown."""
    return pl.device_total <= gpu_bytes, host_bytes is None or pl.host_total <= host_bytes


@dataclass
class Fit:
    """The largest model of a family that fits: its layer count and parameters (0 where
    the host takes not one layer), what stopped it ("gpu" or "host"), and with "host"
    the layer count the GPU alone takes."""

    n_layer: int
    n_params: int
    limit: str
    gpu_only_layers: int | None = None

    def as_dict(self) -> dict:
        return {"n_layer": self.n_layer, "params": self.n_params, "limit": self.limit,
                "gpu_only_layers": self.gpu_only_layers}


def _most_layers(spec, setup, recipe, gpu_bytes, host_bytes) -> int:
    """The most layers (up to memory.MAX_SIZE) with which ``spec`` fits; 0 if not one."""
    def ok(n):
        return all(fits(place(replace(spec, n_layer=n), setup, recipe), gpu_bytes, host_bytes))

    if not ok(1):
        return 0
    lo, hi = 1, 2  # ok(lo); then find hi with not ok(hi), and bisect
    while hi <= memory.MAX_SIZE and ok(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, memory.MAX_SIZE + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def largest_fit(spec: memory.ModelSpec, setup: memory.Setup, recipe: Recipe, gpu_bytes: int,
                host_bytes: int | None) -> Fit | None:
    """The largest model of ``spec``'s family (its shape, any number of layers) whose
    ``recipe`` fits ``gpu_bytes`` on the device and ``host_bytes`` on the host (None:
    the host is not checked); None when the GPU takes not one layer."""
    if spec.params_override is not None:
        raise ValueError("model: a model given by its parameter count has no layers to vary; "
                         "give its shape (a preset or a config.json)")
    gpu_only = _most_layers(spec, setup, recipe, gpu_bytes, None)
    both = gpu_only if host_bytes is None else _most_layers(spec, setup, recipe, gpu_bytes, host_bytes)
    if gpu_only == 0:
        return None
    host_limited = both < gpu_only
    return Fit(both, replace(spec, n_layer=both).n_params() if both else 0, "host" if host_limited else "gpu",
               gpu_only if host_limited else None)


def parse_host_memory(text: str) -> int:
    """'colab' or a size like '12.7GB' -> bytes (--host-memory)."""
    return memory.parse_gb(text, "host_memory", HOSTS, "12.7GB")


def target_name(gpu: str) -> str:
    """The name of ``gpu`` in gpu_targets: a preset's own ('T4 ' -> 't4'), else as given."""
    return gpu.lower().strip() if gpu.lower().strip() in memory.GPUS else gpu


def gpu_targets(gpu: str | None) -> dict:
    """Every GPU preset, and ``gpu`` when it is a size of its own: name -> bytes."""
    targets = {name: memory.parse_gpu(name)[0] for name in memory.GPUS}
    if gpu is not None:
        targets[target_name(gpu)] = memory.parse_gpu(gpu)[0]
    return targets


def largest_table(spec, setup, targets: dict, host_bytes: int | None) -> dict:
    """GPU name -> recipe key -> Fit or None."""
    return {name: {r.key: largest_fit(spec, setup, r, cap, host_bytes) for r in RECIPES}
            for name, cap in targets.items()}


# ---- text and chart -------------------------------------------------------------------

def _gib(n: int) -> str:
    return memory.fmt_gb(n)


def format_recipes(pls: list, gpu: str | None, gpu_bytes: int | None, host_bytes: int | None) -> str:
    """The recipes' table: device and host GiB, bytes per parameter, and (with a GPU)
    whether each fits the GPU and the host."""
    host = f"host {_gib(host_bytes)} GiB" if host_bytes is not None else "host memory unknown"
    head = (f"{'recipe (16-bit: bf16, or fp16 on a T4)':<40}| device GiB | host GiB | device B/param | "
            f"host B/param" + (f" | fits {gpu} ({_gib(gpu_bytes)} GiB), {host}" if gpu_bytes else ""))
    lines = [head]
    for pl in pls:
        line = (f"{pl.recipe.label:<40}| {_gib(pl.device_total):>10} | {_gib(pl.host_total):>8} | "
                f"{pl.per_param('device'):>14.2f} | {pl.per_param('host'):>12.2f}")
        if gpu_bytes:
            on_gpu, on_host = fits(pl, gpu_bytes, host_bytes)
            short = [w for w, ok in (("GPU", on_gpu), ("host", on_host)) if not ok]
            line += " | " + ("yes" if not short else "no: " + " and ".join(short) + " too small")
        lines.append(line)
    lines.append(f"host GiB: every recipe counts {_gib(HOST_RUNTIME_BYTES)} GiB for the process itself "
                 "(Python, torch, CUDA libraries); B/param: parameters, gradients and states only")
    return "\n".join(lines)


def _params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def format_largest(spec, table: dict, host_bytes: int | None, gpu: str | None = None) -> str:
    """The largest model of the family per GPU and recipe; '(host)' marks a cell where the
    host memory, not the GPU, is the limit, and for ``gpu`` a line says how far the GPU
    alone would go."""
    host = f"{_gib(host_bytes)} GiB host" if host_bytes is not None else "host not checked"
    lines = [f"Largest {spec.name}-shaped model that fits (d_model {spec.d_model}, as many layers as fit; {host}):"]
    width = 20
    lines.append((f"{'GPU (GiB)':<15} | " + " | ".join(f"{r.short:<{width}}" for r in RECIPES)).rstrip())
    host_limited = False
    for name, row in table.items():
        cells = []
        for r in RECIPES:
            fit = row[r.key]
            if fit is None:
                cell = "-"
            else:
                cell = f"{_params_text(fit.n_params)} ({fit.n_layer} L)" if fit.n_layer else "-"
                if fit.limit == "host":
                    cell += " (host)"
                    host_limited = True
            cells.append(f"{cell:<{width}}")
        cap = memory.parse_gpu(name)[0]
        lines.append((f"{name[:8]:<8} {_gib(cap):>6} | " + " | ".join(cells)).rstrip())
    lines.append("L: layers; -: not even one layer fits"
                 + ("; (host): the host memory is the limit, the GPU alone would take more "
                    "(--host-memory)" if host_limited else ""))
    name = target_name(gpu) if gpu is not None else None
    for r in RECIPES if name in table else ():
        fit = table[name][r.key]
        if fit is not None and fit.limit == "host":
            alone = replace(spec, n_layer=fit.gpu_only_layers).n_params()
            stop = f"stop it at {_params_text(fit.n_params)} ({fit.n_layer} layers)" if fit.n_layer else \
                "take not one layer"
            lines.append(f"{r.label} on {name}: the host's {_gib(host_bytes)} GiB {stop}; the GPU alone would "
                         f"take {_params_text(alone)} ({fit.gpu_only_layers} layers)")
    return "\n".join(lines)


def chart(pls: list, path, *, title: str, gpu: tuple | None = None, host_bytes: int | None = None):
    """Stacked bars of each recipe's bytes, device and host side by side (GiB), with the
    GPU's (``gpu``: (name, bytes)) and the host's memory as dashed lines; writes a PNG
    (or any format matplotlib knows by the suffix) and returns the Figure."""
    from memfit._plot import paired_stacked_bars

    labels = {"parameters": "parameters\n(host: master weights)", "gradients": "gradients\n(host: staging)",
              "states": "optimizer states", "activations": "activations\n(saved for backward)",
              "temporary": "temporary buffers\n(host: the process)"}
    groups = {pl.recipe.label: ({k: v / memory.GB for k, v in pl.device.items()},
                                {k: v / memory.GB for k, v in pl.host.items()}) for pl in pls}
    limits = {}
    if gpu is not None:
        limits[f"GPU memory ({gpu[0]}, {_gib(gpu[1])} GiB)"] = gpu[1] / memory.GB
    if host_bytes is not None:
        limits[f"host memory ({_gib(host_bytes)} GiB)"] = host_bytes / memory.GB
    return paired_stacked_bars(groups, labels, path, title=title, xlabel="recipe (left bar: GPU, "
                               "hatched right bar: host)", ylabel="memory (GiB, estimated)",
                               pair=("GPU", "host"), limits=limits)
