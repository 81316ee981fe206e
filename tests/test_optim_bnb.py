"""memfit.optim.bnb: a bitsandbytes user's optimizer lines run after an import swap.

Signatures are checked against bitsandbytes' own (recorded below from the 0.49.2 and
0.50.2 wheels' bitsandbytes/optim/{adamw,adam,lion,rmsprop,sgd,adagrad,lamb,lars,ademamix}.py;
0.49.0's and 0.49.1's are 0.49.2's), every argument is
passed in both spellings, what memfit cannot do raises ValueError, and a step is
bit-identical to memfit's own class built with the translated arguments."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import memfit.optim as mo  # noqa: E402
import memfit.optim.bnb as bnb  # noqa: E402
from test_optim_convert import assert_refused  # noqa: E402

_ADAMW = "lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, amsgrad=False, optim_bits=32, args=None, min_8bit_size=4096"
_ADAM = _ADAMW.replace("weight_decay=0.01", "weight_decay=0")
_LION = "lr=0.0001, betas=(0.9, 0.99), weight_decay=0"
_RMS = "lr=0.01, alpha=0.99, eps=1e-08, weight_decay=0, momentum=0, centered=False"
_SGD = "lr, momentum=0, dampening=0, weight_decay=0, nesterov=False"
_049 = "percentile_clipping=100, block_wise=True"
_ADAGRAD = "lr=0.01, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10"
_LAMB = "lr=0.001, bias_correction=True, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, amsgrad=False, adam_w_mode=True"
# AdEMAMix never had percentile_clipping or block_wise: both versions' signatures are 0.50's
_ADEMAMIX = ("lr=0.001, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-08, "
             "weight_decay=0.01")
# class -> (0.49 signature, 0.50 signature), without `params`
SIGNATURES = {
    "AdamW": (f"{_ADAMW}, {_049}, is_paged=False", f"{_ADAMW}, is_paged=False"),
    "AdamW8bit": (f"{_ADAMW}, {_049}, is_paged=False", f"{_ADAMW}, is_paged=False"),
    "AdamW32bit": (f"{_ADAMW}, {_049}, is_paged=False", f"{_ADAMW}, is_paged=False"),
    "PagedAdamW": (f"{_ADAMW}, {_049}", _ADAMW),
    "PagedAdamW8bit": (f"{_ADAMW}, {_049}", _ADAMW),
    "PagedAdamW32bit": (f"{_ADAMW}, {_049}", _ADAMW),
    "Adam": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "Adam8bit": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "Adam32bit": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "PagedAdam": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "PagedAdam8bit": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "PagedAdam32bit": (f"{_ADAM}, {_049}, is_paged=False", f"{_ADAM}, is_paged=False"),
    "Lion": (f"{_LION}, optim_bits=32, args=None, min_8bit_size=4096, {_049}, is_paged=False",
             f"{_LION}, optim_bits=32, args=None, min_8bit_size=4096, is_paged=False"),
    "Lion8bit": (f"{_LION}, args=None, min_8bit_size=4096, {_049}, is_paged=False",
                 f"{_LION}, args=None, min_8bit_size=4096, is_paged=False"),
    "Lion32bit": (f"{_LION}, args=None, min_8bit_size=4096, {_049}, is_paged=False",
                  f"{_LION}, args=None, min_8bit_size=4096, is_paged=False"),
    "PagedLion": (f"{_LION}, optim_bits=32, args=None, min_8bit_size=4096, {_049}",
                  f"{_LION}, optim_bits=32, args=None, min_8bit_size=4096"),
    "PagedLion8bit": (f"{_LION}, args=None, min_8bit_size=4096, {_049}", f"{_LION}, args=None, min_8bit_size=4096"),
    "PagedLion32bit": (f"{_LION}, args=None, min_8bit_size=4096, {_049}", f"{_LION}, args=None, min_8bit_size=4096"),
    "RMSprop": (f"{_RMS}, optim_bits=32, args=None, min_8bit_size=4096, {_049}",
                f"{_RMS}, optim_bits=32, args=None, min_8bit_size=4096"),
    "RMSprop8bit": (f"{_RMS}, args=None, min_8bit_size=4096, {_049}", f"{_RMS}, args=None, min_8bit_size=4096"),
    "RMSprop32bit": (f"{_RMS}, args=None, min_8bit_size=4096, {_049}", f"{_RMS}, args=None, min_8bit_size=4096"),
    "SGD": (f"{_SGD}, optim_bits=32, args=None, min_8bit_size=4096, {_049}",
            f"{_SGD}, optim_bits=32, args=None, min_8bit_size=4096"),
    "SGD8bit": (f"{_SGD}, args=None, min_8bit_size=4096, {_049}", f"{_SGD}, args=None, min_8bit_size=4096"),
    "SGD32bit": (f"{_SGD}, args=None, min_8bit_size=4096, {_049}", f"{_SGD}, args=None, min_8bit_size=4096"),
    "Adagrad": (f"{_ADAGRAD}, optim_bits=32, args=None, min_8bit_size=4096, {_049}",
                f"{_ADAGRAD}, optim_bits=32, args=None, min_8bit_size=4096"),
    "Adagrad8bit": (f"{_ADAGRAD}, optim_bits=8, args=None, min_8bit_size=4096, {_049}",
                    f"{_ADAGRAD}, optim_bits=8, args=None, min_8bit_size=4096"),
    "Adagrad32bit": (f"{_ADAGRAD}, optim_bits=32, args=None, min_8bit_size=4096, {_049}",
                     f"{_ADAGRAD}, optim_bits=32, args=None, min_8bit_size=4096"),
    # LAMB and LARS: 0.49 had percentile_clipping (LAMB block_wise=False too) before max_unorm
    "LAMB": (f"{_LAMB}, optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, "
             "block_wise=False, max_unorm=1.0", f"{_LAMB}, optim_bits=32, args=None, min_8bit_size=4096, max_unorm=1.0"),
    "LAMB8bit": (f"{_LAMB}, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=False, max_unorm=1.0",
                 f"{_LAMB}, args=None, min_8bit_size=4096, max_unorm=1.0"),
    "LAMB32bit": (f"{_LAMB}, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=False, max_unorm=1.0",
                  f"{_LAMB}, args=None, min_8bit_size=4096, max_unorm=1.0"),
    "LARS": (f"{_SGD}, optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, max_unorm=0.02",
             f"{_SGD}, optim_bits=32, args=None, min_8bit_size=4096, max_unorm=0.02"),
    "LARS8bit": (f"{_SGD}, args=None, min_8bit_size=4096, percentile_clipping=100, max_unorm=0.02",
                 f"{_SGD}, args=None, min_8bit_size=4096, max_unorm=0.02"),
    "LARS32bit": (f"{_SGD}, args=None, min_8bit_size=4096, percentile_clipping=100, max_unorm=0.02",
                  f"{_SGD}, args=None, min_8bit_size=4096, max_unorm=0.02"),
    "PytorchLARS": ("lr=0.01, momentum=0, dampening=0, weight_decay=0, nesterov=False, max_unorm=0.02",) * 2,
    "AdEMAMix": (f"{_ADEMAMIX}, optim_bits=32, min_8bit_size=4096, is_paged=False",) * 2,
    "AdEMAMix8bit": (f"{_ADEMAMIX}, min_8bit_size=4096, is_paged=False",) * 2,
    "AdEMAMix32bit": (f"{_ADEMAMIX}, min_8bit_size=4096, is_paged=False",) * 2,
    "PagedAdEMAMix": (f"{_ADEMAMIX}, optim_bits=32, min_8bit_size=4096",) * 2,
    "PagedAdEMAMix8bit": (f"{_ADEMAMIX}, min_8bit_size=4096",) * 2,
    "PagedAdEMAMix32bit": (f"{_ADEMAMIX}, min_8bit_size=4096",) * 2,
}
PAGED = [n for n in SIGNATURES if n.startswith("Paged")]
UNPAGED = [n for n in SIGNATURES if not n.startswith("Paged")]


def parse(sig: str):
    """[(name, default or inspect._empty)] of a recorded signature."""
    out = []
    for part in inspect.signature(eval(f"lambda {sig}: 0", {})).parameters.values():  # noqa: S307
        out.append((part.name, part.default))
    return out


@pytest.fixture(autouse=True)
def fresh_manager():
    bnb.GlobalOptimManager.get_instance().initialize()
    yield
    bnb.GlobalOptimManager.get_instance().initialize()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 96), torch.nn.Linear(96, 80))


def train(opt, m, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 7), generator=g)
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m


def test_import_forms():
    assert bnb.optim is bnb and mo.bnb is bnb
    assert bnb.optim.AdamW8bit is bnb.AdamW8bit
    assert issubclass(bnb.AdamW8bit, mo.AdamW8bit) and issubclass(bnb.Lion8bit, mo.Lion8bit)
    assert issubclass(bnb.optim.Adagrad8bit, mo.Adagrad8bit)
    assert issubclass(bnb.AdEMAMix8bit, mo.AdEMAMix8bit) and issubclass(bnb.AdEMAMix32bit, mo.AdEMAMix)
    assert issubclass(bnb.LAMB8bit, mo.LAMB8bit) and issubclass(bnb.LARS32bit, mo.LARS8bit)
    assert issubclass(bnb.PytorchLARS, mo.LARS)
    with pytest.raises(AttributeError, match="has no attribute 'PagedLAMB'"):
        bnb.PagedLAMB  # noqa: B018 (bitsandbytes has none either)


@pytest.mark.parametrize("name", SIGNATURES)
def test_signature_is_bitsandbytes(name):
    """0.49's signature exactly (names, order, defaults); 0.50's is it without
    percentile_clipping and block_wise."""
    ours = [(p.name, p.default) for p in inspect.signature(getattr(bnb, name)).parameters.values()][1:]
    v049, v050 = (parse(s) for s in SIGNATURES[name])
    assert ours == v049
    assert [p for p in ours if p[0] not in ("percentile_clipping", "block_wise")] == v050


def groups_of(opt):
    g = opt.param_groups[0]
    return {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "bits", "min_8bit_size") if k in g}


ADAM_VALUES = dict(lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, amsgrad=False, optim_bits=32,
                   args=None, min_8bit_size=100)


@pytest.mark.parametrize("name,bits", [("AdamW8bit", 8), ("AdamW", 32), ("AdamW32bit", 32), ("Adam8bit", 8),
                                       ("Adam", 32), ("Adam32bit", 32)])
def test_adam_every_argument_both_spellings(name, bits):
    cls = getattr(bnb, name)
    p = model().parameters()
    v = list(ADAM_VALUES.values())
    forms = [
        cls(list(p), *v, 100, True, False),  # 0.49, positionally (12 arguments)
        cls(list(model().parameters()), *v, False),  # 0.50, positionally (10: is_paged last)
        cls(list(model().parameters()), **ADAM_VALUES, percentile_clipping=100, block_wise=True, is_paged=False),
        cls(list(model().parameters()), **ADAM_VALUES, is_paged=False),
    ]
    want = dict(lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, bits=bits, min_8bit_size=100)
    for opt in forms:
        assert groups_of(opt) == want
        assert opt.param_groups[0]["amsgrad"] is False


@pytest.mark.parametrize("name,bits", [("AdamW", 8), ("Adam", 8), ("Lion", 8), ("SGD", 8), ("RMSprop", 8),
                                       ("Adagrad", 8)])
def test_optim_bits_8_in_the_base_classes(name, bits):
    opt = getattr(bnb, name)(model().parameters(), lr=1e-3, optim_bits=8)
    assert opt.param_groups[0]["bits"] == 8


@pytest.mark.parametrize("name,bits", [("Lion8bit", 8), ("Lion32bit", 32), ("Lion", 32)])
def test_lion_every_argument_both_spellings(name, bits):
    cls = getattr(bnb, name)
    head = [3e-4, (0.95, 0.98), 0.1] + ([32] if name == "Lion" else []) + [None, 100]
    for opt in (cls(model().parameters(), *head, 100, True, False), cls(model().parameters(), *head, False),
                cls(model().parameters(), lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1, args=None,
                    min_8bit_size=100, is_paged=False)):
        assert groups_of(opt) == dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1, bits=bits, min_8bit_size=100)


@pytest.mark.parametrize("name,bits", [("SGD8bit", 8), ("SGD32bit", 32), ("SGD", 32)])
def test_sgd_every_argument_both_spellings(name, bits):
    cls = getattr(bnb, name)
    head = [0.1, 0.9, 0.0, 0.01, True] + ([32] if name == "SGD" else []) + [None, 100]
    for opt in (cls(model().parameters(), *head, 100, True), cls(model().parameters(), *head),
                cls(model().parameters(), lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True,
                    args=None, min_8bit_size=100, percentile_clipping=100, block_wise=True)):
        g = opt.param_groups[0]
        assert (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"], g["bits"],
                g["min_8bit_size"]) == (0.1, 0.9, 0.0, 0.01, True, bits, 100)
    with pytest.raises(TypeError):
        cls(model().parameters())  # lr is required, as in bitsandbytes


@pytest.mark.parametrize("name,bits", [("RMSprop8bit", 8), ("RMSprop32bit", 32), ("RMSprop", 32)])
def test_rmsprop_every_argument_both_spellings(name, bits):
    cls = getattr(bnb, name)
    head = [0.02, 0.9, 1e-6, 0.01, 0.5, False] + ([32] if name == "RMSprop" else []) + [None, 100]
    for opt in (cls(model().parameters(), *head, 100, True), cls(model().parameters(), *head),
                cls(model().parameters(), lr=0.02, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5,
                    centered=False, args=None, min_8bit_size=100)):
        g = opt.param_groups[0]
        assert (g["lr"], g["alpha"], g["eps"], g["weight_decay"], g["momentum"], g["bits"],
                g["min_8bit_size"]) == (0.02, 0.9, 1e-6, 0.01, 0.5, bits, 100)


@pytest.mark.parametrize("name,bits", [("Adagrad8bit", 8), ("Adagrad32bit", 32), ("Adagrad", 32)])
def test_adagrad_every_argument_both_spellings(name, bits):
    """lr_decay and initial_accumulator_value, which bitsandbytes refuses unless 0, are
    torch's (memfit.optim.Adagrad8bit's math)."""
    cls = getattr(bnb, name)
    head = [0.02, 0.1, 0.01, 0.3, 1e-8, 8 if bits == 8 else 32, None, 100]
    for opt in (cls(model().parameters(), *head, 100, True), cls(model().parameters(), *head),
                cls(model().parameters(), lr=0.02, lr_decay=0.1, weight_decay=0.01,
                    initial_accumulator_value=0.3, eps=1e-8, args=None, min_8bit_size=100)):
        g = opt.param_groups[0]
        assert (g["lr"], g["lr_decay"], g["weight_decay"], g["initial_accumulator_value"], g["eps"],
                g["bits"], g["min_8bit_size"]) == (0.02, 0.1, 0.01, 0.3, 1e-8, bits, 100)


class Args:
    """bitsandbytes' MockArgs: the options as attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_args_replaces_the_arguments_as_in_bitsandbytes():
    opt = bnb.AdamW(model().parameters(), args=Args(optim_bits=8, min_8bit_size=10, max_unorm=0.0,
                                                    skip_zeros=False, percentile_clipping=100, block_wise=True))
    assert groups_of(opt)["bits"] == 8 and groups_of(opt)["min_8bit_size"] == 10
    opt = bnb.Lion8bit(model().parameters(), args={"optim_bits": 32, "min_8bit_size": 5})
    assert groups_of(opt)["bits"] == 32 and groups_of(opt)["min_8bit_size"] == 5


ERRORS = [
    ("AdamW8bit", dict(is_paged=True), "no paged optimizers"),
    ("AdamW8bit", dict(amsgrad=True), "no AMSGrad"),
    ("AdamW", dict(amsgrad=True), "32-bit ones ignore it"),
    ("AdamW8bit", dict(percentile_clipping=5), "no percentile clipping.*clip_grad_norm_"),
    ("Lion8bit", dict(percentile_clipping=0), "percentile_clipping: expected an int in 1..100"),
    ("RMSprop8bit", dict(block_wise=False), "block-wise only"),
    ("AdamW8bit", dict(optim_bits=8), "optim_bits must stay 32"),
    ("Adam8bit", dict(optim_bits=16), "optim_bits must stay 32"),
    ("AdamW", dict(optim_bits=4), "expected 8 or 32.*AdamW4bit"),
    ("AdamW8bit", dict(args=Args(max_unorm=1.0)), "no update-norm clipping"),
    ("AdamW8bit", dict(args=Args(skip_zeros=True)), "updates every element"),
    ("RMSprop", dict(centered=True), "centered"),
    ("AdamW8bit", dict(lr=-1.0), "lr"),
    ("AdamW32bit", dict(optim_bits=8), "AdamW32bit keeps 32-bit states; optim_bits must stay 32"),
    ("Adam32bit", dict(optim_bits="banana"), "Adam32bit keeps 32-bit states; optim_bits must stay 32"),
    ("AdamW32bit", dict(optim_bits=None), "optim_bits must stay 32"),
    ("AdamW", dict(optim_bits="banana"), "optim_bits: expected 8 or 32"),
    ("Adam", dict(optim_bits=None), "optim_bits: expected 8 or 32"),
    ("Lion", dict(optim_bits=True), "optim_bits: expected 8 or 32"),
    ("SGD", dict(lr=0.1, momentum=0.9, optim_bits=8.5), "optim_bits: expected 8 or 32"),
    ("Adagrad8bit", dict(optim_bits=32), "Adagrad8bit keeps 8-bit states; optim_bits must stay 8"),
    ("Adagrad32bit", dict(optim_bits=8), "Adagrad32bit keeps 32-bit states; optim_bits must stay 32"),
    ("Adagrad", dict(optim_bits=4), "optim_bits: expected 8 or 32"),
    ("Adagrad8bit", dict(percentile_clipping=50), "no percentile clipping"),
    ("Adagrad", dict(block_wise=False), "block-wise only"),
    ("Adagrad8bit", dict(lr_decay=-1.0), "lr_decay"),
    ("Adagrad32bit", dict(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    ("AdamW8bit", dict(betas="(0.9,)"), "betas: expected two numbers"),
    ("AdamW8bit", dict(betas="__import__('os').getcwd()"), "betas: expected two numbers"),
    ("Adam", dict(betas="(0.9, '0.9')"), "betas: expected two numbers"),
    ("Lion8bit", dict(betas="(0.9, 0.99)"), "parses string betas only for Adam and AdamW"),
    ("LAMB8bit", dict(amsgrad=True), "no AMSGrad"),
    ("LAMB", dict(percentile_clipping=5), "no percentile clipping"),
    ("LARS8bit", dict(lr=0.1, momentum=0.9, percentile_clipping=50), "no percentile clipping"),
    ("LARS", dict(lr=0.1, momentum=0.9, max_unorm=-1.0), "max_unorm"),
    ("AdEMAMix8bit", dict(is_paged=True), "AdEMAMix8bit: memfit has no paged optimizers"),
    ("AdEMAMix", dict(optim_bits=16), "AdEMAMix: optim_bits: expected 8 or 32"),
    ("AdEMAMix", dict(betas="(0.9, 0.999)"), "AdEMAMix: betas: expected three numbers"),
    ("AdEMAMix32bit", dict(t_alpha=-1), "t_alpha: expected None or a positive int"),
    ("AdEMAMix8bit", dict(t_beta3=-3), "t_beta3: expected None or a positive int"),
    ("AdEMAMix8bit", dict(betas=(0.9, 0.999)), "betas: expected three betas"),
]


@pytest.mark.parametrize("name,kw,match", ERRORS, ids=[f"{n}-{next(iter(k))}" for n, k, _ in ERRORS])
def test_what_memfit_does_not_do_raises_and_says_what_instead(name, kw, match):
    with pytest.raises(ValueError, match=match):
        getattr(bnb, name)(model().parameters(), **kw)


@pytest.mark.parametrize("name", PAGED)
def test_paged_classes_raise(name):
    with pytest.raises(ValueError, match=f"{name}: memfit has no paged optimizers") as e:
        getattr(bnb, name)(model().parameters())
    # and it points at what keeps states off the GPU: the offloader
    assert "memfit.optim.CPUOffloadOptimizer" in str(e.value)


def max_unorm(opt):
    return opt.param_groups[0]["max_unorm"]


def test_lamb_lars_both_positional_spellings():
    """After min_8bit_size: a float is 0.50's max_unorm, an int 0.49's percentile_clipping;
    args.max_unorm sets max_unorm (bitsandbytes reads it from args)."""
    head = (1e-3, True, (0.9, 0.999), 1e-8, 0, False, True, 8, None, 100)
    assert max_unorm(bnb.LAMB(model().parameters(), *head, 0.5)) == 0.5  # 0.50
    assert max_unorm(bnb.LAMB(model().parameters(), *head, 100, False, 0.25)) == 0.25  # 0.49
    assert max_unorm(bnb.LARS8bit(model().parameters(), 0.1, 0.9, 0, 0, False, None, 100, 0.3)) == 0.3
    assert max_unorm(bnb.LARS8bit(model().parameters(), 0.1, 0.9, 0, 0, False, None, 100, 100, 0.3)) == 0.3
    assert max_unorm(bnb.LAMB8bit(model().parameters(), args=Args(max_unorm=0.7))) == 0.7
    with pytest.raises(NotImplementedError, match="LARS without momentum"):
        bnb.LARS(model().parameters(), 0.1)
    with pytest.raises(TypeError, match="0.50's positional max_unorm"):
        bnb.LAMB(model().parameters(), *head, 0.5, False, 0.25)


def test_bool_after_min_8bit_size_with_more_positionals_is_refused():
    with pytest.raises(TypeError, match="0.50's positional is_paged"):
        bnb.AdamW8bit(model().parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.0, False, 32, None, 4096, False, False)


# class -> (bnb constructor kwargs, memfit class, its kwargs, param-group bits for memfit)
SAME_STEP = {
    "AdamW8bit": (dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100), mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100), None),
    "AdamW": (dict(lr=1e-2, weight_decay=0.1), mo.AdamW, dict(lr=1e-2, weight_decay=0.1), None),
    "AdamW-8": (dict(lr=1e-2, optim_bits=8, min_8bit_size=100), mo.AdamW8bit, dict(lr=1e-2, min_8bit_size=100), None),
    "AdamW32bit": (dict(lr=1e-2), mo.AdamW, dict(lr=1e-2), None),
    # bitsandbytes' Adam decays decoupled: memfit's AdamW math
    "Adam8bit": (dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100), mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100), None),
    "Adam": (dict(lr=1e-2, weight_decay=0.1), mo.AdamW, dict(lr=1e-2, weight_decay=0.1), None),
    "Adam32bit": (dict(lr=1e-2, weight_decay=0.1), mo.AdamW, dict(lr=1e-2, weight_decay=0.1), None),
    "Lion8bit": (dict(lr=1e-3, weight_decay=0.1, min_8bit_size=100), mo.Lion8bit, dict(lr=1e-3, weight_decay=0.1, min_8bit_size=100), None),
    "Lion": (dict(lr=1e-3), mo.Lion8bit, dict(lr=1e-3), 32),
    "Lion32bit": (dict(lr=1e-3), mo.Lion8bit, dict(lr=1e-3), 32),
    "SGD8bit": (dict(lr=0.1, momentum=0.9, nesterov=True, min_8bit_size=100), mo.SGD8bit, dict(lr=0.1, momentum=0.9, nesterov=True, min_8bit_size=100), None),
    "SGD": (dict(lr=0.1, momentum=0.9), mo.SGD8bit, dict(lr=0.1, momentum=0.9), 32),
    "SGD32bit": (dict(lr=0.1, momentum=0.9), mo.SGD8bit, dict(lr=0.1, momentum=0.9), 32),
    "RMSprop8bit": (dict(lr=1e-3, momentum=0.5, min_8bit_size=100), mo.RMSprop8bit, dict(lr=1e-3, momentum=0.5, min_8bit_size=100), None),
    "RMSprop": (dict(lr=1e-3), mo.RMSprop8bit, dict(lr=1e-3), 32),
    "RMSprop32bit": (dict(lr=1e-3), mo.RMSprop8bit, dict(lr=1e-3), 32),
    "Adagrad8bit": (dict(lr=1e-2, lr_decay=0.1, initial_accumulator_value=0.2, min_8bit_size=100),
                    mo.Adagrad8bit, dict(lr=1e-2, lr_decay=0.1, initial_accumulator_value=0.2,
                                         min_8bit_size=100), None),
    "Adagrad": (dict(lr=1e-2, weight_decay=0.1), mo.Adagrad, dict(lr=1e-2, weight_decay=0.1), None),
    "Adagrad32bit": (dict(lr=1e-2), mo.Adagrad, dict(lr=1e-2), None),
    # bnb's LAMB/LARS: memfit's trust-ratio classes (which apply what bnb's kernels ignore)
    "LAMB8bit": (dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100, max_unorm=0.5), mo.LAMB8bit,
                 dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100, max_unorm=0.5), None),
    "LAMB": (dict(lr=1e-2, adam_w_mode=False, weight_decay=0.1), mo.LAMB,
             dict(lr=1e-2, adam_w_mode=False, weight_decay=0.1), None),
    "LAMB-8": (dict(lr=1e-2, optim_bits=8, min_8bit_size=100), mo.LAMB8bit, dict(lr=1e-2, min_8bit_size=100), None),
    "LAMB32bit": (dict(lr=1e-2, bias_correction=False), mo.LAMB, dict(lr=1e-2, bias_correction=False), None),
    "LARS8bit": (dict(lr=0.1, momentum=0.9, nesterov=True, min_8bit_size=100), mo.LARS8bit,
                 dict(lr=0.1, momentum=0.9, nesterov=True, min_8bit_size=100), None),
    "LARS": (dict(lr=0.1, momentum=0.9, dampening=0.1), mo.LARS, dict(lr=0.1, momentum=0.9, dampening=0.1), None),
    "LARS32bit": (dict(lr=0.1, momentum=0.9, max_unorm=0.1), mo.LARS, dict(lr=0.1, momentum=0.9, max_unorm=0.1), None),
    "PytorchLARS": (dict(lr=0.1, momentum=0.9), mo.LARS, dict(lr=0.1, momentum=0.9, min_8bit_size=0), None),
    "AdEMAMix8bit": (dict(lr=1e-2, t_alpha=2, t_beta3=2, min_8bit_size=100), mo.AdEMAMix8bit,
                     dict(lr=1e-2, t_alpha=2, t_beta3=2, min_8bit_size=100), None),
    "AdEMAMix": (dict(lr=1e-2, alpha=3.0, betas="(0.8, 0.99, 0.995)"), mo.AdEMAMix,
                 dict(lr=1e-2, alpha=3.0, betas=(0.8, 0.99, 0.995)), None),
    "AdEMAMix-8": (dict(lr=1e-2, optim_bits=8, weight_decay=0.1, min_8bit_size=100), mo.AdEMAMix8bit,
                   dict(lr=1e-2, weight_decay=0.1, min_8bit_size=100), None),
    "AdEMAMix32bit": (dict(lr=1e-2, t_beta3=2), mo.AdEMAMix, dict(lr=1e-2, t_beta3=2), None),
}


def assert_same_training(a, ma, b, mb):
    for (pa, pb) in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("case", SAME_STEP)
def test_step_is_memfits_own_class_bit_for_bit(case):
    kw, cls, mkw, bits = SAME_STEP[case]
    ma, mb = model(), model()
    a = getattr(bnb, case.split("-")[0])(ma.parameters(), **kw)
    params = list(mb.parameters())
    b = cls(params if bits is None else [{"params": params, "bits": bits}], **mkw)
    train(a, ma), train(b, mb)
    assert_same_training(a, ma, b, mb)
    want = 8 if case.endswith(("8bit", "-8")) else 32
    assert a.state[ma[0].weight]["state1"].dtype == (torch.uint8 if want == 8 else torch.float32)



@pytest.mark.parametrize("name", ["AdEMAMix8bit", "AdEMAMix32bit"])
@pytest.mark.parametrize("zero", [0, 0.0])
def test_ademamix_schedule_of_zero_is_no_scheduler(name, zero):
    """bitsandbytes 0.49.2 on reads t_alpha=0 / t_beta3=0 as no scheduler (``if t_alpha:``;
    0.49.0 and 0.49.1 divided by it): the groups hold None and the steps are None's."""
    ma, mb = model(), model()
    a = getattr(bnb, name)(ma.parameters(), lr=1e-2, t_alpha=zero, t_beta3=zero, min_8bit_size=100)
    b = getattr(bnb, name)(mb.parameters(), lr=1e-2, min_8bit_size=100)
    assert (a.param_groups[0]["t_alpha"], a.param_groups[0]["t_beta3"]) == (None, None)
    train(a, ma), train(b, mb)
    assert_same_training(a, ma, b, mb)

def test_bnb_adam_weight_decay_is_decoupled_not_torch_adams_l2():
    ma, mb = model(), model()
    train(bnb.Adam8bit(ma.parameters(), lr=1e-2, weight_decay=0.1), ma)
    train(mo.Adam8bit(mb.parameters(), lr=1e-2, weight_decay=0.1), mb)  # L2: another update
    assert not torch.equal(ma[1].weight, mb[1].weight)


def test_state_dict_loads_into_memfits_class_and_back():
    ma, mb = model(), model()
    a = bnb.AdamW8bit(ma.parameters(), lr=1e-2)
    train(a, ma, 2)
    b = mo.AdamW8bit(mb.parameters(), lr=1e-2)
    mb.load_state_dict(ma.state_dict())
    b.load_state_dict(a.state_dict())
    train(a, ma, 1), train(b, mb, 1)
    assert_same_training(a, ma, b, mb)
    bnb.AdamW8bit(ma.parameters()).load_state_dict(b.state_dict())


# -- GlobalOptimManager ---------------------------------------------------------------------

def state_dtype(opt, p):
    return opt.state[p]["state1"].dtype


def test_register_module_override_keeps_the_embedding_32bit():
    """bitsandbytes' StableEmbedding habit, equal bit for bit to memfit's own form: a
    param group with bits=32."""
    ma, mb = model(), model()
    bnb.GlobalOptimManager.get_instance().register_module_override(ma[0], "weight", {"optim_bits": 32})
    a = bnb.AdamW8bit(ma.parameters(), lr=1e-2, min_8bit_size=100)
    b = mo.AdamW8bit([{"params": [mb[0].weight], "bits": 32}, {"params": list(mb[1].parameters())}],
                     lr=1e-2, min_8bit_size=100)
    train(a, ma), train(b, mb)
    assert state_dtype(a, ma[0].weight) == torch.float32 and state_dtype(a, ma[1].weight) == torch.uint8
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
        assert all(torch.equal(a.state[pa][k], b.state[pb][k]) for k in a.state[pa])


def test_override_config_after_the_optimizer_is_built_as_bitsandbytes_documents():
    m = model()
    mng = bnb.optim.GlobalOptimManager.get_instance()
    mng.register_parameters(m.parameters())
    opt = bnb.optim.Adam(m.parameters(), lr=0.001, optim_bits=8, min_8bit_size=100)
    mng.override_config(m[1].weight, "optim_bits", 32)
    mng.override_config([m[0].weight], key_value_dict={"min_8bit_size": 10**6, "percentile_clipping": 100})
    train(opt, m, 1)
    assert state_dtype(opt, m[1].weight) == torch.float32  # optim_bits=32
    assert state_dtype(opt, m[0].weight) == torch.float32  # smaller than its min_8bit_size
    # memfit's own classes do not read bitsandbytes' manager
    m2 = model()
    mng.override_config(m2[1].weight, "optim_bits", 32)
    own = mo.AdamW8bit(m2.parameters(), min_8bit_size=100)
    train(own, m2, 1)
    assert state_dtype(own, m2[1].weight) == torch.uint8


def test_override_errors():
    m = model()
    mng = bnb.GlobalOptimManager.get_instance()
    with pytest.raises(ValueError, match="'lr'.*param group"):
        mng.override_config(m[0].weight, "lr", 0.1)
    with pytest.raises(ValueError, match="no percentile clipping"):
        mng.override_config(m[0].weight, "percentile_clipping", 5)
    with pytest.raises(ValueError, match="expected 8 or 32"):
        mng.override_config(m[0].weight, "optim_bits", 4)
    with pytest.raises(ValueError, match="no tensor attribute 'wieght'"):
        mng.register_module_override(m[0], "wieght", {"optim_bits": 32})
    with pytest.raises(RuntimeError, match="get_instance"):
        bnb.GlobalOptimManager()
    mng.override_config(m[1].weight, "optim_bits", 8)
    opt = bnb.AdamW(m.parameters())  # 32-bit states: an 8-bit override cannot join this group
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*'bits': 8"):
        train(opt, m, 1)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW", "Adam32bit"])
def test_string_betas_as_fairseq_passes_them(name):
    """bitsandbytes' two-state optimizers parse betas given as a string ("(0.9, 0.995)",
    fairseq's configs); the shim reads the same strings as literals and steps exactly as
    with the pair."""
    ma, mb = model(), model()
    a = getattr(bnb, name)(ma.parameters(), lr=1e-2, betas="(0.9, 0.995)", min_8bit_size=100)
    b = getattr(bnb, name)(mb.parameters(), lr=1e-2, betas=(0.9, 0.995), min_8bit_size=100)
    assert a.param_groups[0]["betas"] == (0.9, 0.995)
    assert bnb.AdamW(model().parameters(), betas=" 0.8, 0.99 ").param_groups[0]["betas"] == (0.8, 0.99)
    train(a, ma), train(b, mb)
    assert_same_training(a, ma, b, mb)


def memfit_twin(case, m):
    """The memfit optimizer of SAME_STEP's ``case``, for ``m``."""
    _, cls, mkw, bits = SAME_STEP[case]
    params = list(m.parameters())
    return cls(params if bits is None else [{"params": params, "bits": bits}], **mkw)


@pytest.mark.parametrize("case", SAME_STEP)
def test_shim_state_dict_loads_into_memfits_class_of_the_same_math_bit_exactly(case):
    """Every shim's state dict (saved as by "bnb.<class>") loads into the memfit class of
    the same math and bits, and back; both resume bit for bit with the optimizer that
    saved the dict stepping on."""
    kw = SAME_STEP[case][0]
    ma, mb = model(), model()
    a = getattr(bnb, case.split("-")[0])(ma.parameters(), **kw)
    train(a, ma, 2)
    assert a.state_dict()["memfit"]["optimizer"] == "bnb." + case.split("-")[0]
    b = memfit_twin(case, mb)
    mb.load_state_dict(ma.state_dict())
    b.load_state_dict(a.state_dict())
    train(a, ma, 2), train(b, mb, 2)
    assert_same_training(a, ma, b, mb)
    # and back, into a fresh shim
    mc = model()
    mc.load_state_dict(mb.state_dict())
    c = getattr(bnb, case.split("-")[0])(mc.parameters(), **kw)
    c.load_state_dict(b.state_dict())
    train(b, mb, 1), train(c, mc, 1)
    assert_same_training(b, mb, c, mc)


def test_shim_dicts_saved_before_the_record_named_the_shim_load():
    """Dicts saved by a shim before state_dict() recorded "bnb.<class>" name the bare
    class ("AdamW32bit", a class memfit.optim does not have): they load by its math."""
    ma, mb = model(), model()
    a = bnb.AdamW32bit(ma.parameters(), lr=1e-2)
    train(a, ma, 2)
    sd = a.state_dict()
    sd["memfit"]["optimizer"] = "AdamW32bit"
    b = mo.AdamW(mb.parameters(), lr=1e-2)
    mb.load_state_dict(ma.state_dict())
    b.load_state_dict(sd)
    train(a, ma, 1), train(b, mb, 1)
    assert_same_training(a, ma, b, mb)


def test_decoupled_adam_state_does_not_load_into_l2_adam_and_back():
    """bitsandbytes' Adam decays decoupled (the shim too); memfit.optim.Adam8bit/Adam
    apply L2: with weight decay, each refuses the other's dict with torch AdamW's advice
    (the optimizer left bit-identical); without, the math is the same and they load."""
    ma, mb = model(), model()
    shim = bnb.Adam8bit(ma.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=100)
    own = mo.Adam8bit(mb.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=100)
    train(shim, ma, 1), train(own, mb, 1)
    assert_refused(own, shim.state_dict(), r"saved by memfit.optim.bnb.Adam8bit with weight decay; "
                                           r"Adam8bit applies weight decay as L2.*memfit.optim.AdamW8bit")
    assert_refused(shim, own.state_dict(), r"saved by memfit.optim.Adam8bit with weight decay; "
                                           r"Adam8bit applies weight decay decoupled.*memfit.optim.Adam8bit")
    own32 = mo.Adam(model().parameters(), weight_decay=0.1)
    assert_refused(bnb.Adam32bit(model().parameters()), own32.state_dict(), "with weight decay")
    mo.Adam8bit(model().parameters(), min_8bit_size=100).load_state_dict(
        bnb.Adam8bit(model().parameters(), min_8bit_size=100).state_dict())  # weight_decay=0


def test_shim_dict_of_other_bits_or_kind_is_refused_saying_why():
    m = model()
    lion = bnb.Lion32bit(m.parameters(), lr=1e-3)
    train(lion, m, 1)
    own = mo.Lion8bit(model().parameters(), min_8bit_size=100)
    train(own, model(), 1)
    assert_refused(own, lion.state_dict(), r"param_groups\[0\] was saved by memfit.optim.bnb.Lion32bit "
                                           r"with 32-bit states, and Lion8bit keeps 8-bit states there: "
                                           r"give that group 'bits': 32")
    sgd = bnb.SGD32bit(model().parameters(), lr=0.1, momentum=0.9)
    assert_refused(mo.RMSprop8bit(model().parameters()), sgd.state_dict(),
                   r"saved by memfit.optim.bnb.SGD32bit, which does SGD, and RMSprop8bit does RMSprop")
