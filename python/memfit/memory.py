"""Training-memory estimator: will a model fit, and with which settings?

The estimate splits training memory into weights, gradients, optimizer states,
activations (saved for backward) and temporary buffers, for a baseline and for each
memfit technique. All formulas count bytes exactly for the transformer layout
described by :class:`ModelSpec`; they do not model allocator fragmentation.

Parameters (per layer, h = d_model, f = d_ff, kv = n_kv_head / n_head):
  attention 2h^2 + 2h^2*kv (+ 3h + 2h*kv... biases when present), MLP 2hf (GELU) or
  3hf (SwiGLU) (+ biases), two norms; plus token/position embeddings, a final norm and
  an output head unless tied.

Activations (saved tensors, per layer, per token; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1, generalised):
  res_bytes * 2h                    the two norm inputs (the residual stream: float32
                                     under autocast, where norms run in float32)
  + act_bytes * (4h + 2h*kv + m*f)  norm outputs, Q, K, V, attention output; m = 2 for
                                     GELU (fc output, GELU output), 4 for SwiGLU (gate,
                                     SiLU(gate), up, product)
  + 2h*mask_bytes                   dropout masks, if the model uses dropout (1 byte
                                     on CUDA; the CPU keeps float masks)
  + a*s*(act_bytes [+ mask_bytes + act_bytes with dropout])
                                     softmax probabilities (and dropout) when attention
                                     is computed eagerly (or fused attention with
                                     dropout on the CPU, which falls back to that);
                                     fused attention keeps only a log-sum-exp per head
For GPT-2 with dropout, eager attention and 16-bit activations on a GPU this is the
paper's s*b*h*(34 + 5*a*s/h) per layer. Outside the layers: embedding output (and
its dropout mask), final norm input and output, and the loss's float32 log-softmax
of the logits, s*b*V*4 (the 16-bit logits themselves are not kept). Under autocast, the 16-bit copy of
each matmul weight is kept for backward too: 2 bytes per matmul parameter.

Recomputation: checkpointing every layer keeps one layer input (s*b*h*act_bytes) per
layer plus one layer's full activations while it is recomputed; sqrt(n) segments keep
one input per segment plus one segment's activations.

Optimizer states per parameter: AdamW 8 B; 8-bit AdamW 2 B + 2 float32 absmax per 256
(2.03 B); 4-bit AdamW 1 B + 2 absmax per 128 (1.06 B); SGD momentum 4 B; Lion 4 B,
8-bit Lion 1.02 B; Adagrad, SGD (momentum), RMSprop (no momentum) and LARS 4 B, 8-bit 1.02 B;
LAMB as AdamW; AdEMAMix 12 B, 8-bit 3.05 B; ``adamw-bf16`` (torch's fused CUDA AdamW with bfloat16 moments beside
float32 parameters, a peer's option for comparison: every tensor, 1-D too) 4 B. memfit's 8-/4-bit optimizers keep float32 states for 1-D parameters
(biases, norms: ``vector_params``), so those count at the 32-bit optimizer's bytes.
Muon (``muon8bit``: memfit's Muon8bit, ``muon``: torch.optim.Muon or memfit's Muon with
float32 momentum) keeps one momentum per hidden matrix (the layers' attention and MLP
weights: ``ModelSpec.hidden_matrix_params``), 1 B + a float32 absmax per 256 (1.016 B) or
4 B; everything else (embeddings, the output head, biases, norms, ``extra_params``: RoBERTa's
pooler is a matrix but counts here, an upper bound) is AdamW's, as memfit.optim.muon_param_groups splits a model: at ``adamw8bit``'s bytes
(1-D at 8 B) or ``adamw``'s. A model given by its parameter count has no known split:
all of it counts at the AdamW bytes (an upper bound). The step's scratch (one matrix's
update and Newton-Schulz's bfloat16 copies, alive during the step only) is not counted.
Pure bf16 with a Kahan compensation buffer (``kahan=True``, memfit's optimizers'
option): + 2 B (the buffer is bf16, like the weights; fp32 weights need none).

Temporary buffers: the gradient of the logits (s*b*V*4 bytes), or eager attention
scores if larger, plus on a GPU the CUDA context and library workspaces (0.5 GB, a
typical figure for torch + cuBLAS; not measured by this module).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GB = 1024**3

OPTIMIZER_BYTES = {  # bytes of state per parameter
    "adamw": 8.0, "adam": 8.0,
    "adamw8bit": 2.0 + 2 * 4 / 256, "adam8bit": 2.0 + 2 * 4 / 256,
    "adamw4bit": 1.0 + 2 * 4 / 128,
    "sgd": 4.0, "lion": 4.0, "lion8bit": 1.0 + 4 / 256,
    "adamw-bf16": 2.0 + 2.0,  # torch's fused CUDA AdamW, bfloat16 exp_avg and exp_avg_sq
    # one state (sum; momentum; square_avg without momentum), 8-bit: 1 B + an absmax per 256
    "adagrad": 4.0, "adagrad8bit": 1.0 + 4 / 256, "sgd8bit": 1.0 + 4 / 256,
    "rmsprop": 4.0, "rmsprop8bit": 1.0 + 4 / 256,
    # LAMB keeps Adam's two states, LARS SGD's momentum (the trust ratio's float64 scratch
    # lives during the step only)
    "lamb": 8.0, "lamb8bit": 2.0 + 2 * 4 / 256, "lars": 4.0, "lars8bit": 1.0 + 4 / 256,
    # AdEMAMix: exp_avg, exp_avg_sq and exp_avg_slow
    "ademamix": 12.0, "ademamix8bit": 3.0 + 3 * 4 / 256,
}
# Muon: bytes per parameter of a hidden matrix (its momentum); the rest of the model is
# stepped by the AdamW of MUON_REST
OPTIMIZER_BYTES.update({"muon8bit": 1.0 + 4 / 256, "muon": 4.0})
MUON_REST = {"muon8bit": "adamw8bit", "muon": "adamw"}
# the quantized optimizers' bytes per parameter for 1-D tensors: those of their 32-bit form
VECTOR_OPTIMIZER_BYTES = {q: OPTIMIZER_BYTES[full] for q, full in
                          {"adamw8bit": "adamw", "adam8bit": "adam", "adamw4bit": "adamw",
                           "lion8bit": "lion", "adagrad8bit": "adagrad", "sgd8bit": "sgd",
                           "rmsprop8bit": "rmsprop", "lamb8bit": "lamb", "lars8bit": "lars",
                           "ademamix8bit": "ademamix"}.items()}

GPUS = {  # name: (memory in GiB, native bf16)
    "t4": (15.0, False), "l4": (22.5, True), "a10": (22.5, True), "v100": (16.0, False),
    "a100-40": (40.0, True), "a100-80": (80.0, True), "h100": (80.0, True), "h200": (141.0, True),
}

CUDA_CONTEXT_BYTES = int(0.5 * GB)


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shape. ``params_override`` counts parameters directly (a
    module on the meta device) when the layout is not a standard transformer."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    d_ff: int = 0
    n_kv_head: int = 0
    max_pos: int = 0  # learned position embeddings; 0 for rotary
    mlp: str = "gelu"  # "gelu" (two matrices) or "swiglu" (three)
    norm: str = "layernorm"  # "layernorm" (weight + bias) or "rmsnorm" (weight)
    bias: bool = True
    tied_embeddings: bool = True
    dropout: bool = True
    extra_params: int = 0  # e.g. token-type embeddings and a pooler
    params_override: int | None = None

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def params_per_layer(self) -> int:
        h, f = self.d_model, self.ff
        kv = h * self.kv_heads // self.n_head
        attn = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if self.bias else 0)
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f + ((f + h) if self.bias else 0)
        norms = 2 * (2 * h if self.norm == "layernorm" else h)
        return attn + mlp + norms

    def hidden_matrix_params(self) -> int:
        """The layers' 2-D weights (attention and MLP): what Muon steps."""
        h, f = self.d_model, self.ff
        kv = h * self.kv_heads // self.n_head
        per_layer = 2 * h * h + 2 * h * kv + (3 if self.mlp == "swiglu" else 2) * h * f
        return self.n_layer * per_layer

    def matmul_params(self) -> int:
        """Weights that go through matrix products (layers and the output head)."""
        return self.hidden_matrix_params() + self.vocab * self.d_model

    def vector_params(self) -> int:
        """Parameters in 1-D tensors: biases and norm weights (0 for a model given by
        its parameter count)."""
        if self.params_override is not None:
            return 0
        h, f = self.d_model, self.ff
        kv = h * self.kv_heads // self.n_head
        norm = 2 * h if self.norm == "layernorm" else h
        per_layer = 2 * norm + ((2 * h + 2 * kv) + (f + h) if self.bias else 0)
        return self.n_layer * per_layer + norm

    def tensor_numels(self) -> dict | None:
        """Elements of the largest parameter tensor of each kind: token embedding, position
        embedding, untied output head, one layer's attention input projection (Q, K and V
        counted as one fused tensor, as GPT-2's c_attn is: an upper bound for separate
        ones) and one MLP matrix. None for a model given by its parameter count."""
        if self.params_override is not None:
            return None
        h = self.d_model
        kv = h * self.kv_heads // self.n_head
        return {"embedding": self.vocab * h, "positions": self.max_pos * h,
                "head": 0 if self.tied_embeddings else self.vocab * h,
                "qkv": h * (h + 2 * kv), "mlp": h * self.ff}

    def n_params(self) -> int:
        if self.params_override is not None:
            return self.params_override
        h = self.d_model
        emb = self.vocab * h + self.max_pos * h
        head = 0 if self.tied_embeddings else self.vocab * h
        final_norm = 2 * h if self.norm == "layernorm" else h
        return emb + self.n_layer * self.params_per_layer() + final_norm + head + self.extra_params


PRESETS = {
    "gpt2": ModelSpec("gpt2", 12, 768, 12, 50257, max_pos=1024),
    "gpt2-medium": ModelSpec("gpt2-medium", 24, 1024, 16, 50257, max_pos=1024),
    "gpt2-large": ModelSpec("gpt2-large", 36, 1280, 20, 50257, max_pos=1024),
    "gpt2-xl": ModelSpec("gpt2-xl", 48, 1600, 25, 50257, max_pos=1024),
    # RobertaModel (post-norm: its embedding LayerNorm takes the place of the final
    # norm): + token-type embedding (h) and pooler (h^2 + h)
    "roberta-base": ModelSpec("roberta-base", 12, 768, 12, 50265, max_pos=514,
                              extra_params=768 + 768 * 768 + 768),
    "roberta-large": ModelSpec("roberta-large", 24, 1024, 16, 50265, max_pos=514,
                               extra_params=1024 + 1024 * 1024 + 1024),
    "llama-1b": ModelSpec("llama-1b", 16, 2048, 32, 128256, d_ff=8192, n_kv_head=8, mlp="swiglu",
                          norm="rmsnorm", bias=False, tied_embeddings=True, dropout=False),
    "llama-7b": ModelSpec("llama-7b", 32, 4096, 32, 32000, d_ff=11008, mlp="swiglu", norm="rmsnorm",
                          bias=False, tied_embeddings=False, dropout=False),
}


# The largest size (batch, sequence, width, vocabulary, layer count...) any check here
# takes: 2**48 is far beyond any real model, and keeps every product the estimator
# forms (a few sizes multiplied, some as floats) finite, where a 400-digit number
# would overflow float64 and end in a traceback.
MAX_SIZE = 2**48


def shown(v, limit: int = 60) -> str:
    """v for an error message: its repr, but a count of digits for a huge int (whose
    repr may even be refused past 4300 digits) and a string longer than ``limit``
    shortened."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**30:
        digits = int(math.log10(abs(v))) + 1
        digits -= 10 ** (digits - 1) > abs(v)  # log10 rounds 10**400 - 1 up to 400.0
        return f"a {'negative ' if v < 0 else ''}number with {digits} digits"
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 20] + f"... ({len(text)} characters)"


def _integral(v) -> bool:
    """An int, or a float with an integral value (JSON writers differ), not a bool."""
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def size_problem(v, minimum: int = 1, maximum: int = MAX_SIZE) -> str | None:
    """What is wrong with v as a size (an integer in [minimum, maximum]; a float with
    an integral value passes, a bool does not), or None. The one check behind every
    size option and field: the CLI's options, config.json fields, Setup, profile."""
    if not _integral(v):
        return f"expected an integer, got {shown(v)}"
    if v < minimum:
        return f"need at least {minimum}, got {shown(v)}"
    if v > maximum:
        return f"must be at most {maximum}, got {shown(v)}"
    return None


def check_size(v, name: str, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    """v as an int, or ValueError naming ``name`` (see size_problem)."""
    problem = size_problem(v, minimum, maximum)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return int(v)


def _read_json(path):
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"config: cannot read {str(path)!r} ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config: {str(path)!r} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"config: {str(path)!r} is nested too deeply to be a config.json") from None
    return cfg


def from_hf_config(path_or_dict) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (GPT-2, BERT/RoBERTa, Llama,
    Mistral and other models using the common key names). Every field read is
    checked (sizes: integers in range; flags: true/false; names: strings; dropout: a
    number >= 0) and a bad one raises ValueError naming it."""
    cfg = path_or_dict if isinstance(path_or_dict, dict) else _read_json(path_or_dict)
    if not isinstance(cfg, dict):
        raise ValueError(f"config: expected a JSON object of model settings, got {type(cfg).__name__}")

    def get(*keys, default=None):
        """(key, value) of the first of ``keys`` set (not null), else (keys[0], default)."""
        return next(((k, cfg[k]) for k in keys if cfg.get(k) is not None), (keys[0], default))

    def size(*keys, minimum=1, default=None) -> int:
        key, v = get(*keys, default=default)
        if v is None:
            raise ValueError("config: needs num_hidden_layers/n_layer, hidden_size/n_embd, "
                             "num_attention_heads/n_head and vocab_size")
        return check_size(v, f"config: {key}", minimum)

    def typed(kind, what, *keys, default):
        key, v = get(*keys, default=default)
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise ValueError(f"config: {key}: must be {what}, got {shown(v)}")
        return v

    n_layer = size("num_hidden_layers", "n_layer")
    d = size("hidden_size", "n_embd", "d_model")
    heads = size("num_attention_heads", "n_head")
    vocab = size("vocab_size")
    kv = size("num_key_value_heads", minimum=0, default=0)
    if kv and heads % kv:
        raise ValueError(f"config: num_key_value_heads: must divide "
                         f"num_attention_heads ({heads}), got {kv!r}")
    mtype = typed(str, "a string", "model_type", default="")
    act = typed(str, "a string", "hidden_act", "activation_function", default="gelu")
    swiglu = act in ("silu", "swish") or mtype in ("llama", "mistral", "qwen2", "gemma")
    rotary = "rope_theta" in cfg or mtype in ("llama", "mistral", "qwen2", "gemma")
    extra = 0
    if mtype in ("bert", "roberta"):
        extra = size("type_vocab_size", minimum=0, default=2) * d + d * d + d
    key, dropout = get("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", default=0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(f"config: {key}: must be a probability from 0 to 1, got {shown(dropout)}")
    return ModelSpec(
        name=str(get("_name_or_path", "model_type", default="hf-config")[1]),
        n_layer=n_layer, d_model=d, n_head=heads, vocab=vocab,
        d_ff=size("intermediate_size", "n_inner", minimum=0, default=0),
        n_kv_head=kv,
        max_pos=0 if rotary else size("max_position_embeddings", "n_positions", minimum=0, default=0),
        mlp="swiglu" if swiglu else "gelu",
        norm="rmsnorm" if "rms_norm_eps" in cfg else "layernorm",
        bias=typed(bool, "true or false", "attention_bias", "bias", default=not swiglu),
        tied_embeddings=typed(bool, "true or false", "tie_word_embeddings", default=True),
        dropout=dropout > 0,
        extra_params=extra,
    )


def from_module(module, like: ModelSpec | None = None) -> ModelSpec:
    """Parameter count of a torch module (build it on the meta device: no memory is
    used); activations follow ``like`` when given, else the parameters alone count."""
    n = sum(p.numel() for p in module.parameters())
    base = like or ModelSpec(type(module).__name__, 0, 1, 1, 0)
    return replace(base, name=type(module).__name__, params_override=n)


@dataclass(frozen=True)
class Setup:
    """How the model is trained."""

    batch: int = 8
    seq: int = 1024
    precision: str = "fp32"  # "fp32", "fp16" / "bf16" (autocast, fp32 master), "bf16-pure"
    optimizer: str = "adamw"
    kahan: bool = False  # bf16-pure: a bf16 Kahan compensation buffer per parameter (+2 B)
    checkpoint: str = "none"  # "none", "every", "sqrt"
    micro_batch: int | None = None  # default: batch (no accumulation)
    attention: str = "sdpa"  # "sdpa" or "eager"
    gpu: bool = True

    @property
    def micro(self) -> int:
        return self.micro_batch or self.batch


@dataclass
class Estimate:
    model: str
    n_params: int
    setup: Setup
    weights: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    breakdown: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.temporary

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def param_bytes(precision: str) -> int:
    """Bytes of each weight (and each gradient) element: 2 for pure 16-bit training
    ("bf16-pure"; fp16 weights count the same), else 4 (float32 weights, autocast or not)."""
    return 2 if precision == "bf16-pure" else 4


def validate(setup: Setup):
    """Raises ValueError naming the first bad field of a Setup."""
    if setup.precision not in ("fp32", "fp16", "bf16", "bf16-pure"):
        raise ValueError(f"precision: expected fp32, fp16, bf16 or bf16-pure, got {setup.precision!r}")
    if setup.optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZER_BYTES)}, got {setup.optimizer!r}")
    if setup.checkpoint not in ("none", "every", "sqrt"):
        raise ValueError(f"checkpoint: expected none, every or sqrt, got {setup.checkpoint!r}")
    if setup.attention not in ("sdpa", "eager"):
        raise ValueError(f"attention: expected sdpa or eager, got {setup.attention!r}")
    for name in ("batch", "seq"):
        check_size(getattr(setup, name), name)
    if setup.micro_batch is not None:
        check_size(setup.micro_batch, "micro_batch")
    if setup.micro > setup.batch:
        raise ValueError("micro_batch: must be between 1 and batch")


def activation_bytes(spec: ModelSpec, setup: Setup) -> dict:
    """Saved-for-backward bytes of one micro-batch, split into layers and the rest."""
    b, s = setup.micro, setup.seq
    ab = 4 if setup.precision == "fp32" else 2
    mask = 1 if setup.gpu else ab  # CUDA keeps dropout masks as bool, the CPU as floats
    h, f, a = spec.d_model, spec.ff, spec.n_head
    kv = spec.kv_heads / spec.n_head
    m = 4 if spec.mlp == "swiglu" else 2
    # Fused attention with dropout has no fused kernel on the CPU: torch falls back to
    # the math path, which keeps the probabilities like eager attention.
    # (That path computes in float32 even under autocast.)
    fallback = setup.attention == "sdpa" and spec.dropout and not setup.gpu
    eager = setup.attention == "eager" or fallback
    pb = 4 if fallback else ab  # bytes of each kept probability
    # Under autocast the residual stream and the norms stay float32: the two norm
    # inputs per layer are kept in float32; everything fed to a matmul is 16-bit.
    rb = 4 if setup.precision in ("fp32", "fp16", "bf16") else 2
    per_token = rb * 2 * h + ab * (4 * h + 2 * h * kv + m * f)
    if spec.dropout:
        per_token += 2 * h * mask
    if eager:
        per_token += a * s * (pb + (((4 if fallback else mask) + pb) if spec.dropout else 0))
    else:
        per_token += 4 * a  # log-sum-exp per head
    per_token += 2 * 2 * 4  # two norms' mean and 1/std in float32
    layer = int(per_token * b * s)
    outside = b * s * h * (rb + ab)  # final norm input (residual) and output
    outside += (b * s * h * (mask + ab)) if spec.dropout else 0  # embedding dropout
    logits = b * s * spec.vocab * 4  # the loss's float32 log-softmax
    n = spec.n_layer
    if setup.checkpoint == "none" or n == 0:
        layers = n * layer
    elif setup.checkpoint == "every":
        layers = n * b * s * h * ab + layer
    else:
        seg = max(1, round(math.sqrt(n)))
        per_seg = math.ceil(n / seg)
        layers = seg * b * s * h * ab + per_seg * layer
    # autocast keeps the 16-bit copy of every matmul weight for the backward pass;
    # under checkpointing only the layers being recomputed hold theirs
    copies = 0
    if setup.precision in ("fp16", "bf16"):
        layer_w = spec.hidden_matrix_params() // max(n, 1)
        held = n if setup.checkpoint == "none" else (1 if setup.checkpoint == "every" else
                                                        math.ceil(n / max(1, round(math.sqrt(n)))))
        copies = 2 * (held * layer_w + spec.vocab * h)
    return {"per_layer": layer, "layers": int(layers), "outside_layers": int(outside), "logits": int(logits),
            "weight_copies": int(copies)}


def optimizer_state_bytes(spec: ModelSpec, optimizer: str) -> int:
    """Bytes of ``optimizer``'s states for ``spec`` (see the module docstring): matrices at
    OPTIMIZER_BYTES, 1-D tensors at VECTOR_OPTIMIZER_BYTES; under Muon the hidden
    matrices at Muon's bytes and the rest at its AdamW's (MUON_REST)."""
    p, v = spec.n_params(), spec.vector_params()
    muon = 0
    if optimizer in MUON_REST:
        muon = 0 if spec.params_override is not None else spec.hidden_matrix_params()
        rest = MUON_REST[optimizer]
    else:
        rest = optimizer
    return int(muon * OPTIMIZER_BYTES[optimizer] + (p - v - muon) * OPTIMIZER_BYTES[rest]
               + v * VECTOR_OPTIMIZER_BYTES.get(rest, OPTIMIZER_BYTES[rest]))


def estimate(spec: ModelSpec, setup: Setup) -> Estimate:
    """Bytes of each component of training memory (see the module docstring)."""
    validate(setup)
    p = spec.n_params()
    pure = setup.precision == "bf16-pure"
    weights = grads = p * param_bytes(setup.precision)
    opt = optimizer_state_bytes(spec, setup.optimizer) + (2 * p if pure and setup.kahan else 0)
    acts = activation_bytes(spec, setup)
    activations = acts["layers"] + acts["outside_layers"] + acts["logits"] + acts["weight_copies"]
    temp = setup.micro * setup.seq * spec.vocab * 4  # gradient of the logits
    if setup.attention == "eager":
        temp = max(temp, setup.micro * spec.n_head * setup.seq * setup.seq * 4)
    if setup.gpu:
        temp += CUDA_CONTEXT_BYTES
    return Estimate(spec.name, p, setup, weights, grads, opt, activations, temp, breakdown=acts)


# ---- recommendations ---------------------------------------------------------------

SLOWDOWN = {  # rough step-time cost of each technique, relative to the same precision
    "checkpoint": {"none": 0.0, "sqrt": 0.30, "every": 0.33},  # one extra forward ~ 1/3 step
    "optimizer": {"adamw": 0.0, "adamw8bit": 0.0, "adamw4bit": 0.02},
    "halving_micro_batch": 0.05,
}


def parse_gb(text: str, name: str, presets: dict, example: str) -> int:
    """A memory size: a name in ``presets`` (name -> GiB) or a size like '24GB' (GB means
    GiB here, as in every table memfit prints) -> bytes; else ValueError naming ``name``.
    The one parser of --gpu and --host-memory."""
    g = text.lower().strip()
    if g in presets:
        return int(presets[g] * GB)
    if g.endswith("gb"):
        try:
            size = float(g[:-2])
        except ValueError:
            size = None
        if size is not None:
            if not (math.isfinite(size) and size * GB >= 1 and math.isfinite(size * GB)):
                raise ValueError(f"{name}: the memory size must be a finite number of GB > 0, got {shown(text)}")
            return int(size * GB)
    raise ValueError(f"{name}: expected one of {', '.join(presets)} or a size like {example}, got {shown(text)}")


def parse_gpu(gpu: str) -> tuple:
    """'t4' / 'a100-80' / '24GB' -> (bytes, native bf16; a size is taken to have it)."""
    capacity = parse_gb(gpu, "gpu", {name: mem for name, (mem, _) in GPUS.items()}, "24GB")
    return capacity, GPUS.get(gpu.lower().strip(), (0, True))[1]


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None


def candidate_setups(base: Setup, bf16_native: bool):
    precisions = ["bf16", "bf16-pure"] if bf16_native else ["fp16"]
    micro = base.micro
    micros = []
    while micro >= 1:
        micros.append(micro)
        micro //= 2
    for prec in precisions:
        for opt in ("adamw", "adamw8bit", "adamw4bit"):
            for ck in ("none", "sqrt", "every"):
                for mb in micros:
                    yield replace(base, precision=prec, optimizer=opt, checkpoint=ck, micro_batch=mb)


def slowdown(setup: Setup, base_micro: int) -> float:
    halvings = int(round(math.log2(base_micro / setup.micro))) if setup.micro < base_micro else 0
    return (SLOWDOWN["checkpoint"][setup.checkpoint] + SLOWDOWN["optimizer"].get(setup.optimizer, 0.0)
            + SLOWDOWN["halving_micro_batch"] * halvings)


def recommend(spec: ModelSpec, base: Setup, gpu: str):
    """The setting with the least expected slowdown that fits the GPU (ties: least
    memory), or None when nothing fits."""
    capacity, bf16 = parse_gpu(gpu)
    best = None
    for cand in candidate_setups(base, bf16):
        est = estimate(spec, cand)
        if est.total > capacity:
            continue
        key = (slowdown(cand, base.micro), est.total)
        if best is None or key < best[0]:
            best = (key, cand, est)
    return None if best is None else (best[1], best[2], best[0][0])


def comparison(spec: ModelSpec, base: Setup, bf16_native: bool = True, half: str | None = None) -> list:
    """Baseline, each technique alone, and all of them together. ``half``: the autocast
    precision of the device ("bf16", "fp16", or "fp32" where neither is faster, as on a
    CPU without native bfloat16: then no autocast row); default from ``bf16_native``."""
    half = half or ("bf16" if bf16_native else "fp16")
    if half not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"half: expected bf16, fp16 or fp32, got {half!r}")
    rows = [("baseline (fp32, AdamW)", replace(base, precision="fp32", optimizer="adamw", checkpoint="none")),
            (f"+ {half} autocast", replace(base, precision=half, optimizer="adamw", checkpoint="none")),
            ("+ AdamW8bit", replace(base, precision="fp32", optimizer="adamw8bit", checkpoint="none")),
            ("+ checkpoint every layer", replace(base, precision="fp32", optimizer="adamw", checkpoint="every"))]
    if half == "fp32":
        del rows[1]
    combo_prec = "bf16-pure" if half == "bf16" else half
    combo = (f"memfit ({combo_prec}+Kahan + AdamW8bit + ckpt)" if base.kahan and combo_prec == "bf16-pure"
             else f"memfit ({combo_prec} + AdamW8bit + checkpoint)")
    rows.append((combo, replace(base, precision=combo_prec, optimizer="adamw8bit", checkpoint="every")))
    return [(label, estimate(spec, s)) for label, s in rows]


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name or a path to a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.exists()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte
        found = False
    if found:
        return from_hf_config(path)
    raise ValueError(f"model: expected a preset ({', '.join(PRESETS)}) or a config.json path, "
                     f"got {shown(name_or_path)}")


def fmt_gb(n: int) -> str:
    return f"{n / GB:.2f}"
