"""memfit.checkpoint at run time: semantics of the non-reentrant checkpoint against
the plain function (torch's behaviour is the reference), int8 compression, and the
planner on a 12-block GPT-style model (CPU)."""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import memfit.checkpoint as mc  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def grads_of(params):
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def zero(params):
    for p in params:
        p.grad = None


def run_both(fn, make_inputs, params, seed=0, **ckpt_kwargs):
    """Forward+backward of fn plainly and through mc.checkpoint with the same seed;
    returns (plain outputs, plain grads, ckpt outputs, ckpt grads)."""
    results = []
    for use_ckpt in (False, True):
        inputs = make_inputs()
        zero(params)
        torch.manual_seed(seed)
        out = mc.checkpoint(fn, *inputs, **ckpt_kwargs) if use_ckpt else fn(*inputs)
        out.sum().backward()
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        results.append((out.detach(), grads_of(params) + [t.grad.clone() for t in leaves]))
    return results


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------- semantics --

def test_gradients_exact_with_dropout():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 16),
                        nn.Dropout(0.2))
    params = list(net.parameters())
    x0 = torch.randn(8, 16)
    (y1, g1), (y2, g2) = run_both(net, lambda: [x0.clone().requires_grad_()], params, seed=3)
    assert torch.equal(y1, y2)
    assert_same(g1, g2)
    assert (y1 == 0).any()  # dropout really dropped something


def test_rng_restored_and_global_stream_untouched():
    x = torch.randn(64, requires_grad=True)

    def fn(t):
        return F.dropout(t, 0.5, training=True) * torch.rand(64)

    torch.manual_seed(7)
    y = mc.checkpoint(fn, x)
    after_fwd = torch.rand(3)
    y.sum().backward()
    after_bwd = torch.rand(3)
    g_ckpt = x.grad.clone()
    x.grad = None
    torch.manual_seed(7)
    y_ref = fn(x)
    ref_fwd = torch.rand(3)
    y_ref.sum().backward()
    ref_bwd = torch.rand(3)
    assert torch.equal(y, y_ref) and torch.equal(g_ckpt, x.grad)
    # the recompute replays the RNG but leaves the global stream as it was
    assert torch.equal(after_fwd, ref_fwd) and torch.equal(after_bwd, ref_bwd)


def test_without_preserve_rng_state_dropout_differs():
    x = torch.randn(4096, requires_grad=True)
    torch.manual_seed(0)
    y = mc.checkpoint(lambda t: F.dropout(t, 0.5, True), x, preserve_rng_state=False)
    y.sum().backward()
    # the recompute drew another mask: the gradient no longer matches the output
    assert not torch.equal(x.grad, (y != 0).float() * 2.0)


def test_no_grad_just_runs():
    calls = []
    lin = nn.Linear(4, 4)

    def fn(t):
        calls.append(torch.is_grad_enabled())
        return lin(t)

    x = torch.randn(2, 4)
    with torch.no_grad():
        y = mc.checkpoint(fn, x)
    assert calls == [False] and not y.requires_grad
    assert torch.equal(y, lin(x).detach())
    with torch.inference_mode():
        y = mc.checkpoint(fn, x)
    assert len(calls) == 2 and not y.requires_grad


def test_kwargs_and_inputs_without_grad():
    lin = nn.Linear(8, 8)
    params = list(lin.parameters())
    x0, b0 = torch.randn(3, 8), torch.randn(8)

    def fn(x, *, bias, scale=1.0, mode="tanh"):
        h = lin(x) + bias
        return (torch.tanh(h) if mode == "tanh" else h.relu()) * scale

    for x_grad in (False, True):
        res = []
        for use_ckpt in (False, True):
            zero(params)
            x = x0.clone().requires_grad_(x_grad)
            bias = b0.clone().requires_grad_()
            kw = dict(bias=bias, scale=3.0, mode="tanh")
            y = mc.checkpoint(fn, x, **kw) if use_ckpt else fn(x, **kw)
            y.sum().backward()
            res.append(grads_of(params) + [bias.grad, x.grad])
        assert_same(res[0], res[1])
        assert (res[1][-1] is None) == (not x_grad)


def test_nested_checkpoints():
    torch.manual_seed(1)
    a, b, c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]
    counts = {"inner": 0, "outer": 0}

    def inner(t):
        counts["inner"] += 1
        return F.dropout(torch.sin(b(t)), 0.2, True)

    def outer(t):
        counts["outer"] += 1
        return c(torch.relu(mc.checkpoint(inner, torch.tanh(a(t)))))

    def plain(t):
        return c(torch.relu(F.dropout(torch.sin(b(torch.tanh(a(t)))), 0.2, True)))

    x0 = torch.randn(5, 8)
    (y1, g1), = [run_both(plain, lambda: [x0.clone().requires_grad_()], params, seed=4)[0]]
    zero(params)
    x = x0.clone().requires_grad_()
    torch.manual_seed(4)
    y2 = mc.checkpoint(outer, x)
    y2.sum().backward()
    assert torch.equal(y1, y2)
    assert_same(g1, grads_of(params) + [x.grad])
    assert counts["outer"] == 2 and counts["inner"] >= 2


def test_autograd_grad_and_retain_graph():
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)

    def fn(t):
        return torch.exp(lin(t)).sin()

    y = mc.checkpoint(fn, x)
    gx, gw = torch.autograd.grad(y.sum(), [x, lin.weight], retain_graph=True)
    ref_x, ref_w = torch.autograd.grad(fn(x).sum(), [x, lin.weight])
    assert torch.equal(gx, ref_x) and torch.equal(gw, ref_w)
    # the same graph again (a second backward recomputes again)
    gx2, = torch.autograd.grad(y.sum(), [x])
    assert torch.equal(gx2, ref_x)


def test_non_tensor_and_structured_outputs():
    lin = nn.Linear(4, 4)

    def fn(t):
        h = lin(t)
        return {"out": torch.tanh(h), "aux": (h.sigmoid(), 3, None), "name": "x"}

    x = torch.randn(2, 4, requires_grad=True)
    out = mc.checkpoint(fn, x)
    assert out["aux"][1] == 3 and out["aux"][2] is None and out["name"] == "x"
    (out["out"].sum() + out["aux"][0].sum()).backward()
    g = x.grad.clone()
    x.grad = None
    ref = fn(x)
    (ref["out"].sum() + ref["aux"][0].sum()).backward()
    assert torch.equal(g, x.grad)


def test_recompute_stops_early():
    trace = []

    def fn(t):
        trace.append("start")
        a = t.exp()            # saves its result: the one tensor backward needs
        trace.append("after exp")
        b = a * 2.0            # saves nothing (a constant factor)
        trace.append("after mul")
        return b + 1.0

    x = torch.randn(3, requires_grad=True)
    y = mc.checkpoint(fn, x)
    assert trace == ["start", "after exp", "after mul"]
    y.sum().backward()
    # the recompute stopped inside exp, as soon as its result was saved
    assert trace == ["start", "after exp", "after mul", "start"]
    assert torch.allclose(x.grad, 2 * x.exp())


def test_nothing_outlives_the_backward():
    import gc

    def live_frames():
        return sum(1 for o in gc.get_objects() if type(o) is mc._Frame)

    before = live_frames()
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    # tanh, sigmoid and exp save their outputs: the case where keeping the saved
    # tensor with its grad_fn would make a reference cycle
    y = mc.checkpoint(lambda t: lin(t).tanh().sigmoid().exp(), x)
    assert live_frames() == before + 1
    y.sum().backward()
    del y
    assert live_frames() == before
    # the same with a region of several blocks (auto)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    p = mc.auto(net, x.detach(), budget=mc.min_budget(*_sizes(net, x.detach())))
    try:
        net(x).sum().backward()
    finally:
        p.remove()
    assert live_frames() == before


def _sizes(net, x):
    m = mc.measure(net, x)
    return m.input_bytes, m.saved_bytes


def test_mismatched_recompute_is_detected():
    flag = {"double": False, "half": False, "extra": False}
    lin = nn.Linear(4, 4)

    def fn(t):
        if flag["double"]:
            t = torch.cat([t, t])
        h = lin(t)
        if flag["half"]:
            h = h.double()
        out = torch.tanh(h)
        if flag["extra"]:
            out = out.exp()
        return out.float().sum()

    x = torch.randn(2, 4, requires_grad=True)
    for key, pattern in (("double", r"shape \(4, 4\).*forward saved shape \(2, 4\)"),
                         ("half", r"dtype torch.float64.*dtype torch.float32")):
        y = mc.checkpoint(fn, x)
        flag[key] = True
        with pytest.raises(mc.CheckpointError, match=pattern):
            y.backward()
        flag[key] = False
    # more work in the recompute than in the forward: early stop makes it harmless
    y = mc.checkpoint(fn, x)
    flag["extra"] = True
    y.backward()
    flag["extra"] = False
    # less work in the recompute: the missing tensors are reported
    flag["extra"] = True
    y = mc.checkpoint(fn, x)
    flag["extra"] = False
    with pytest.raises(mc.CheckpointError, match="saved 3 tensors.*forward saved 4"):
        y.backward()
    assert isinstance(mc.CheckpointError("x"), RuntimeError)


def test_autocast_restored():
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def fn(t):
        return (lin(t) @ lin.weight).float().tanh()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mc.checkpoint(fn, x)
    y.sum().backward()  # outside autocast: the recompute must still use bf16
    g = [x.grad.clone(), lin.weight.grad.clone()]
    x.grad = None
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = fn(x)
    y_ref.sum().backward()
    assert torch.equal(y, y_ref)
    assert_same(g, [x.grad, lin.weight.grad])


def test_options():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="compress"):
        mc.checkpoint(torch.sin, x, compress="int4")
    with pytest.raises(ValueError, match="determinism_check"):
        mc.checkpoint(torch.sin, x, determinism_check="strict")
    with pytest.warns(UserWarning, match="non-reentrant"):
        y = mc.checkpoint(torch.sin, x, use_reentrant=True)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.cos(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mc.checkpoint(torch.sin, x, use_reentrant=False, debug=False)
    entered = []

    class Ctx:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    x.grad = None
    y = mc.checkpoint(torch.sin, x, context_fn=lambda: (Ctx("fwd"), Ctx("recompute")))
    y.sum().backward()
    assert entered == ["fwd", "recompute"]


# ------------------------------------------------------------------- int8 --

def _mlp_chain(width=64, depth=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(depth)])


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 0.26), (torch.bfloat16, 0.51)])
def test_int8_compression_memory_and_error_bounds(dtype, ratio):
    pytest.importorskip("memfit.quant")
    net = _mlp_chain().to(dtype)
    params = list(net.parameters())
    x0 = torch.randn(32, 64, dtype=dtype)
    outs, grads, meters = [], [], []
    for compress in (None, "int8"):
        zero(params)
        x = x0.clone().requires_grad_()
        with mc.ActivationMeter(exclude=net) as m:
            h = x
            for block in net:
                h = mc.checkpoint(block, h, compress=compress)
        h.float().pow(2).sum().backward()
        outs.append(h.detach())
        grads.append(grads_of(params) + [x.grad.clone()])
        meters.append(m)
    # the forward is untouched: only what backward reads is approximate
    assert torch.equal(outs[0], outs[1])
    plain, q = meters
    # block 0's input is a leaf that requires grad: kept as is; the other 3 are int8
    kept = x0.numel() * x0.element_size()
    assert plain.boundary_bytes == 4 * kept
    assert kept + 3 * kept * 0.25 * (4 / x0.element_size()) <= q.boundary_bytes \
        <= kept + 3 * kept * ratio
    # error: the parameter gradients move by a fraction of a percent to a few percent
    rel = []
    for g0, g1 in zip(grads[0], grads[1]):
        rel.append(((g1.float() - g0.float()).norm() / g0.float().norm()).item())
    assert max(rel) < (0.03 if dtype == torch.float32 else 0.05), rel
    assert max(rel) > 0  # it did quantize
    # the input gradient of the first block goes through the exact graph only
    # partially (its backward reads recomputed activations), so it is close too
    assert rel[-1] < 0.05


def test_int8_dequantized_boundary_error_is_blockwise_bounded():
    quant = pytest.importorskip("memfit.quant")
    x = torch.randn(64, 256) * torch.linspace(0.01, 10, 64)[:, None]
    state = quant.quantize_blockwise(x.contiguous())
    y = quant.dequantize_blockwise(state)
    err = (y - x).abs().reshape(-1, 256)
    absmax = x.abs().reshape(-1, 256).amax(dim=1, keepdim=True)
    # dynamic 8-bit code: every element within 1/64 of its block's absmax (the widest
    # gap of the code near 1 is ~2/127), and on average far less
    assert (err <= absmax / 64).all()
    assert (err.mean() / x.abs().mean()).item() < 0.02


# ------------------------------------------------------- GPT-style model --

class Block(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.p = heads, p

    def forward(self, x, attention_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool).tril() if attention_mask is None else attention_mask
        att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(-1), self.p, self.training)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


def gpt_blocks(n=12, d=32, heads=4, p=0.1, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d, heads, p) for _ in range(n)])


def loss_and_grads(model, x, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    h = model(x)
    h.pow(2).mean().backward()
    return h.detach(), [p.grad.clone() for p in model.parameters()]


def test_gpt_auto_half_budget_exact_grads_and_within_budget():
    model = gpt_blocks().train()
    x = torch.randn(2, 16, 32)
    ref_out, ref_grads = loss_and_grads(model, x, seed=11)
    plan = mc.auto(model, x, budget="50%")
    try:
        full = plan.full_memory_bytes
        assert plan.budget_bytes == full // 2
        assert plan.memory_bytes <= plan.budget_bytes
        assert plan.exact  # identical blocks share a large unit
        assert any(c for _, _, c in plan.segments)
        # at most the cost of checkpointing every block (which also fits)
        every = mc.Plan.from_segments([(i, i + 1, True) for i in range(12)], plan.input_bytes,
                                      plan.saved_bytes, plan.forward_cost)
        assert every.memory_bytes <= plan.budget_bytes
        assert plan.recompute_cost <= every.recompute_cost
        # identical gradients, dropout included
        with mc.ActivationMeter(exclude=model) as meter:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(11)
            h = model(x)
        h.pow(2).mean().backward()
        assert torch.equal(h.detach(), ref_out)
        assert_same(ref_grads, [p.grad for p in model.parameters()])
        # what really stayed for backward fits the budget
        assert meter.recomputes >= 1
        assert 0 < meter.total_bytes <= plan.budget_bytes
        assert meter.total_bytes <= plan.memory_bytes
        print(plan)
        print(meter)
    finally:
        plan.remove()
    # and without checkpointing, more is kept than the budget allows
    with mc.ActivationMeter(exclude=model) as meter:
        model(x)
    assert meter.total_bytes > plan.budget_bytes
    assert meter.total_bytes <= full


def test_gpt_checkpoint_sequential_budget_and_segments():
    model = gpt_blocks(n=6).train()
    x = torch.randn(2, 8, 32)
    ref_out, ref_grads = loss_and_grads(model, x, seed=5)
    for kw in ({"budget": "40%"}, {"segments": 3}, {}, {"budget": "40%", "compress": None}):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        h = mc.checkpoint_sequential(model, x, **kw)
        h.pow(2).mean().backward()
        assert torch.equal(h.detach(), ref_out), kw
        assert_same(ref_grads, [p.grad for p in model.parameters()])
    # torch's calling convention: (functions, segments, input)
    for call in (lambda: mc.checkpoint_sequential(model, 3, x, use_reentrant=False),
                 lambda: mc.checkpoint_sequential(functions=model, segments=3, input=x)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        h = call()
        h.pow(2).mean().backward()
        assert torch.equal(h.detach(), ref_out)
        assert_same(ref_grads, [p.grad for p in model.parameters()])
    with torch.no_grad():
        assert torch.equal(mc.checkpoint_sequential(model.eval(), x, segments=2), model(x))
    with pytest.raises(ValueError, match="segments"):
        mc.checkpoint_sequential(model, x, segments=0)
    with pytest.raises(ValueError, match="at most one"):
        mc.checkpoint_sequential(model, x, budget="1GB", segments=2)
    with pytest.raises(ValueError, match="smallest feasible budget"):
        mc.checkpoint_sequential(model, x, budget=100)


class HFStyleModel(nn.Module):
    """The shape of a Hugging Face decoder: embeddings, a ModuleList of blocks called
    in a Python loop with keyword arguments and tuple outputs, a final norm."""

    def __init__(self, n=8, d=32, vocab=50):
        super().__init__()
        torch.manual_seed(2)
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([HFBlock(d) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, input_ids, use_cache=False):
        hidden = self.wte(input_ids)
        T = input_ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for block in self.h:
            outputs = block(hidden, attention_mask=mask, output_attentions=False)
            hidden = outputs[0]
        return self.ln_f(hidden)


class HFBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.inner = Block(d, 4, 0.1)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        return (self.inner(hidden_states, attention_mask=attention_mask), None)


def test_auto_on_a_hf_style_block_list():
    model = HFStyleModel().train()
    ids = torch.randint(0, 50, (2, 12))
    ref_out, ref_grads = loss_and_grads(model, ids, seed=3)
    plan = mc.auto(model, ids, budget="30%")
    try:
        assert plan.n_stages == 8  # found model.h
        assert len(plan.checkpointed_stages) > 0
        # segments of several blocks are replayed block by block
        assert any(e - s > 1 for s, e, c in plan.segments if c) or plan.segments
        out, grads = loss_and_grads(model, ids, seed=3)
        assert torch.equal(out, ref_out)
        assert_same(ref_grads, grads)
    finally:
        plan.remove()
    assert all("forward" not in b.__dict__ for b in model.h)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_auto_on_hugging_face_models(arch):
    transformers = pytest.importorskip("transformers")
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, n_positions=64,
                                      vocab_size=100, bos_token_id=0, eos_token_id=0)
        make = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64,
                                       intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=100,
                                       max_position_embeddings=64, attention_dropout=0.1,
                                       bos_token_id=0, eos_token_id=0)
        make = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = make(cfg).train()
    ids = torch.randint(0, 100, (2, 24))

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters()
                                   if p.grad is not None]

    loss0, g0 = step()
    plan = mc.auto(model, {"input_ids": ids, "use_cache": False}, budget="35%")
    try:
        assert plan.n_stages == cfg.num_hidden_layers  # found the decoder block list
        assert plan.checkpointed_stages
        loss1, g1 = step()
    finally:
        plan.remove()
    assert torch.equal(loss0, loss1)
    assert_same(g0, g1)


def test_auto_survives_deepcopy():
    import copy

    model = gpt_blocks(n=6, p=0.0)
    x = torch.randn(2, 8, 32)
    plan = mc.auto(model, x, budget="30%")
    try:
        twin = copy.deepcopy(model)  # e.g. an EMA copy
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        # the copy runs its own (halved) weights, checkpointed, not the original's
        out, grads = loss_and_grads(twin, x, seed=0)
    finally:
        plan.remove()
    wrapped = [b for b in twin if "forward" in b.__dict__]
    assert len(wrapped) == len(plan.checkpointed_stages) > 0
    for b in wrapped:
        assert b.__dict__["forward"].module is b
        del b.__dict__["forward"]
    ref, ref_grads = loss_and_grads(twin, x, seed=0)
    assert torch.equal(out, ref)
    assert_same(ref_grads, grads)


def test_auto_multi_block_segment_keeps_one_input():
    model = gpt_blocks(n=8, p=0.0)
    x = torch.randn(2, 8, 32)
    m = mc.measure(model, x)
    # a budget where several blocks share one checkpoint
    p = mc.plan(m.input_bytes, m.saved_bytes, m.forward_cost,
                max(mc.min_budget(m.input_bytes, m.saved_bytes), m.full_memory_bytes // 3))
    seg = mc.auto(model, x, budget=p.budget_bytes)
    try:
        n_ckpt_segments = sum(1 for *_, c in seg.segments if c)
        with mc.ActivationMeter(exclude=model) as meter:
            h = model(x)
        h.sum().backward()
        kept = x.numel() * x.element_size()
        assert meter.boundary_bytes == n_ckpt_segments * kept
        assert meter.total_bytes <= seg.memory_bytes
    finally:
        seg.remove()


def test_auto_with_int8_boundaries():
    pytest.importorskip("memfit.quant")
    model = gpt_blocks(n=6, p=0.0)
    x = torch.randn(2, 16, 32)
    ref_out, ref_grads = loss_and_grads(model, x, seed=0)
    metered = {}
    for compress in (None, "int8"):
        plan = mc.auto(model, x, budget="30%", compress=compress)
        try:
            with mc.ActivationMeter(exclude=model) as meter:
                model.zero_grad(set_to_none=True)
                h = model(x)
            h.pow(2).mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
        finally:
            plan.remove()
        assert torch.equal(h.detach(), ref_out)  # the forward is exact either way
        metered[compress] = (meter, grads, plan)
    m_plain, g_plain, p_plain = metered[None]
    m_q, g_q, p_q = metered["int8"]
    assert p_plain.segments == p_q.segments
    assert_same(ref_grads, g_plain)
    n_ck = sum(1 for *_, c in p_q.segments if c)
    kept = x.numel() * x.element_size()
    assert m_plain.boundary_bytes == n_ck * kept
    assert m_q.boundary_bytes <= n_ck * kept * 0.26
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(g_q, ref_grads))
    assert 0 < err < 0.05


def test_measure_restores_rng_and_buffers():
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(16, 8)
    before = net[1].running_mean.clone()
    torch.manual_seed(0)
    m = mc.measure(net, x)
    after_rng = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(after_rng, torch.rand(2))
    assert torch.equal(net[1].running_mean, before)
    assert len(m) == 4 and all(c > 0 for c in m.forward_cost)
    assert m.saved_bytes[0] == x.numel() * 4  # the Linear saves its input
    assert m.input_bytes == [x.numel() * 4] * 4
    blocks = gpt_blocks(n=5)
    t = mc.measure(blocks, torch.randn(2, 8, 32))
    assert len(set(t.forward_cost)) == 1 and len(set(t.saved_bytes)) == 1  # identical blocks
    f = mc.measure(net, x, cost="flops")
    assert f.forward_cost[0] == 2 * 16 * 8 * 8 and f.forward_cost[2] == 0


# ------------------------------------------------------------------- CUDA --

@pytest.mark.cuda
@requires_cuda
def test_cuda_rng_and_int8_on_gpu():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.3), nn.Linear(256, 64)).to(dev)
    x0 = torch.randn(32, 64, device=dev)
    params = list(net.parameters())
    (y1, g1), (y2, g2) = run_both(net, lambda: [x0.clone().requires_grad_()], params, seed=9)
    assert torch.equal(y1, y2)
    assert_same(g1, g2)
    # a CUDA RNG draw after backward is the same as without the checkpoint
    torch.manual_seed(9)
    y = mc.checkpoint(net, x0.clone().requires_grad_())
    y.sum().backward()
    a = torch.rand(4, device=dev)
    torch.manual_seed(9)
    net(x0.clone().requires_grad_()).sum().backward()
    assert torch.equal(a, torch.rand(4, device=dev))
    # int8 boundaries on the GPU
    h = torch.tanh(x0 @ torch.randn(64, 64, device=dev)).requires_grad_()
    mid = h * 1.0
    y = mc.checkpoint(net, mid, compress="int8")
    y.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


# ------------------------------------------------------------- README --

def _repo_file(name):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not in this checkout")
    with open(path) as f:
        return f.read()


def test_readme_section_examples_run(capsys):
    import re

    text = _repo_file("docs/checkpoint.md")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if "memfit.checkpoint" in b]
    assert len(blocks) >= 2, "docs/checkpoint.md lost its runnable examples"
    for code in blocks:
        exec(compile(code, "docs/checkpoint.md", "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    assert "[(0, 1, True), (1, 2, True), (2, 4, False)]" in out
    assert "smallest feasible budget for this chain is 18 bytes" in out
    assert "checkpoint plan: 12 stages" in out


def test_readme_points_to_the_checkpoint_section():
    readme = _repo_file("README.md")
    assert "memfit.checkpoint" in readme and "docs/checkpoint.md" in readme


# ---- inputs modified in place after the forward (issue 24 §5) ----------------------------

_INPLACE = r"modified by an inplace operation: \[torch.FloatTensor \[4, 3\]\], {} of the " \
           r"checkpointed function, is at version 1; expected version 0 instead"


def test_input_modified_in_place_after_forward_raises_like_autograd():
    x = torch.randn(4, 3, requires_grad=True)
    for run in (torch.sin, lambda t: mc.checkpoint(torch.sin, t)):
        h = x * 1.0  # a non-leaf input, which may be modified in place
        y = run(h)
        h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()  # plain autograd raises; so must the checkpoint
    h = x * 1.0
    y = mc.checkpoint(torch.sin, h)
    h.add_(1.0)
    with pytest.raises(mc.CheckpointError, match=_INPLACE.format("argument 0")):
        y.sum().backward()
    assert x.grad is None  # nothing was computed from the new value (cos(x + 1))


def test_keyword_input_modified_in_place_is_named():
    x = torch.randn(4, 3, requires_grad=True)
    scale = torch.randn(4, 3)
    y = mc.checkpoint(lambda t, s: torch.sin(t) * s, x, s=scale)
    scale.mul_(2.0)
    with pytest.raises(RuntimeError, match=_INPLACE.format("keyword argument 's'")):
        y.sum().backward()


def test_function_that_modifies_its_own_input_still_works():
    # not a later modification: the recompute does it again, and twice (retain_graph)
    x = torch.randn(4, 3, requires_grad=True)
    mask = torch.randn(4, 3)

    def f(t, m):
        m.clamp_(min=0.0)  # idempotent: the recompute sees the same values
        return torch.sin(t) * m

    y = mc.checkpoint(f, x, mask)
    y.sum().backward(retain_graph=True)
    g = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.allclose(g, torch.cos(x.detach()) * mask) and torch.equal(x.grad, g)


def test_auto_block_input_modified_in_place_raises():
    model = gpt_blocks(n=6, p=0.0)
    x = torch.randn(2, 16, 32)
    plan = mc.auto(model, x, budget="30%")
    try:
        h = x * 1.0
        out = model(h)
        h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    finally:
        plan.remove()


# ---- auto() under hostile use (issue 31 §1): a block used twice, hook-wrapped forwards,
# auto() raising part-way, a refused re-plan. Rule: auto() installs a complete plan or
# leaves the model exactly as it was.

def _mlp(d=8, h=32):
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d))


def _snapshot(model):
    """Everything auto() could touch, by identity: each module's attributes (the
    forward included), the items of its dicts (parameters, buffers, submodules, every
    hooks dict), and the parameter values."""
    mods = []
    for mod in model.modules():
        attrs = {k: (v, list(v.items()) if isinstance(v, dict) else None)
                 for k, v in vars(mod).items()}
        mods.append((mod, attrs))
    return mods, [p.detach().clone() for p in model.parameters()]


def _assert_unchanged(model, snap):
    mods, values = snap
    now, now_values = _snapshot(model)
    assert [m for m, _ in now] == [m for m, _ in mods]
    for (mod, attrs), (_, attrs_now) in zip(mods, now):
        assert attrs.keys() == attrs_now.keys(), (mod, attrs.keys() ^ attrs_now.keys())
        for k, (v, items) in attrs.items():
            v_now, items_now = attrs_now[k]
            assert v_now is v, (type(mod).__name__, k, v, v_now)
            if items is not None:
                assert len(items) == len(items_now) and all(
                    a == c and b is d for (a, b), (c, d) in zip(items, items_now)), (k, items_now)
    assert all(torch.equal(a, b) for a, b in zip(values, now_values))


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-7), (g - w).abs().max()


def _torch_checkpointed(model, x, seed):
    """torch's own non-reentrant checkpoint around every place of the chain (its
    checkpoint_sequential would iterate model.children(), which lists a reused block
    once)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    h = x
    for blk in model:
        h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
    h.pow(2).mean().backward()
    return h.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("budget", ["100%", "least"])
def test_auto_block_used_twice_trains_like_torch_and_remove_restores(budget):
    torch.manual_seed(0)
    b = _mlp()
    model = nn.Sequential(b, nn.Tanh(), b)  # weight tying by reuse
    x = torch.randn(4, 8)
    before = _snapshot(model)
    ref_out, ref_grads = loss_and_grads(model, x, seed=0)
    torch_out, torch_grads = _torch_checkpointed(model, x, seed=0)
    _assert_close(torch_grads, ref_grads)
    if budget == "least":
        m = mc.measure(model, x)
        assert m.saved_bytes[0] == m.saved_bytes[2] > 0  # each place measured
        budget = mc.min_budget(m.input_bytes, m.saved_bytes)
    plan = mc.auto(model, x, budget=budget)
    try:
        fwd = b.__dict__.get("forward")  # never measure()'s wrapper
        assert fwd is None or getattr(fwd, "__memfit_checkpoint__", False)
        if plan.checkpointed_stages:
            assert {0, 2} <= set(plan.checkpointed_stages)
        for _ in range(2):  # the second pass finds the places again
            out, grads = loss_and_grads(model, x, seed=0)
            assert torch.equal(out, ref_out) and torch.equal(out, torch_out)
            _assert_close(grads, ref_grads)
            _assert_close(grads, torch_grads)
    finally:
        plan.remove()
    _assert_unchanged(model, before)


class _Twice(nn.Module):
    """Stacks its input on itself: the places after it see a batch twice as large."""

    def forward(self, t):
        return torch.cat([t, t])


def test_auto_block_stored_at_one_place_and_checkpointed_at_others():
    # one block at three places of different sizes (0: batch 4, 2 and 3: batch 8), the
    # plan stores place 0 and checkpoints the segments [1, 3) and [3, 4): each call
    # must run as its place's plan says, also after a pass that raised half-way (here
    # in a hook, where no wrapper sees it).
    torch.manual_seed(0)
    b = _mlp()
    model = nn.Sequential(b, _Twice(), b, b)
    x = torch.randn(4, 8)
    before = _snapshot(model)
    ref_out, ref_grads = loss_and_grads(model, x, seed=0)
    m = mc.measure(model, x, cost="flops")
    want = [(0, 1, False), (1, 3, True), (3, 4, True)]
    budget = mc.Plan.from_segments(want, m.input_bytes, m.saved_bytes).memory_bytes
    plan = mc.auto(model, x, budget=budget, cost="flops")
    try:
        assert plan.segments == want

        def check():
            model.zero_grad(set_to_none=True)
            with mc.ActivationMeter(exclude=model) as meter:
                out = model(x)
            out.pow(2).mean().backward()
            assert torch.equal(out, ref_out)
            _assert_close([p.grad for p in model.parameters()], ref_grads)
            # place 0 keeps what its backward needs, the two segments their inputs
            assert meter.saved_bytes == m.saved_bytes[0]
            assert meter.boundary_bytes == m.input_bytes[1] + m.input_bytes[3]
            assert meter.total_bytes <= plan.memory_bytes

        check()
        check()
        calls = [0]

        def boom(mod, args):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("boom")

        handle = b.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        handle.remove()
        check()
    finally:
        plan.remove()
    _assert_unchanged(model, before)


def _hooked_model():
    """Four blocks, two with an instance forward as hook libraries set one (a bound
    method, a functools.partial) that doubles the output, and a forward hook."""
    import functools
    import types

    torch.manual_seed(0)
    model = nn.Sequential(*[_mlp() for _ in range(4)])

    def doubled(self, t):
        return type(self).forward(self, t) * 2.0

    model[1].forward = types.MethodType(doubled, model[1])
    model[2].forward = functools.partial(doubled, model[2])
    model[3].register_forward_hook(lambda mod, args, out: out + 1.0)
    return model


def test_auto_keeps_instance_forwards_and_remove_restores_them():
    model = _hooked_model()
    x = torch.randn(4, 8)
    before = _snapshot(model)
    ref_out, ref_grads = loss_and_grads(model, x, seed=0)
    m = mc.measure(model, x)
    plan = mc.auto(model, x, budget=mc.min_budget(m.input_bytes, m.saved_bytes))
    try:
        assert plan.checkpointed_stages == [0, 1, 2, 3]
        out, grads = loss_and_grads(model, x, seed=0)  # the doubling forwards ran
        assert torch.equal(out, ref_out)
        _assert_close(grads, ref_grads)
    finally:
        plan.remove()
    _assert_unchanged(model, before)
    out, grads = loss_and_grads(model, x, seed=0)
    assert torch.equal(out, ref_out)


class _FailsOnCall(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.n = n
        self.calls = []  # a list, so that counting calls changes no attribute

    def forward(self, t):
        self.calls.append(1)
        if len(self.calls) == self.n:
            raise RuntimeError("block failed")
        return self.lin(t)


@pytest.mark.parametrize("failure", ["budget", "block"])
def test_auto_that_raises_leaves_the_model_exactly_as_it_was(failure):
    model = _hooked_model()
    model.append(model[0])  # a block used twice
    if failure == "block":  # measured three times: fails in the second measuring pass
        model.append(_FailsOnCall(2))
    x = torch.randn(4, 8)
    before = _snapshot(model)
    with pytest.raises((ValueError, RuntimeError), match="smallest feasible|block failed"):
        mc.auto(model, x, budget=1 if failure == "budget" else "100%")
    _assert_unchanged(model, before)


def test_refused_replan_keeps_the_installed_plan():
    torch.manual_seed(0)
    model = nn.Sequential(*[_mlp() for _ in range(4)])
    x = torch.randn(4, 8)
    original = _snapshot(model)
    ref_out, ref_grads = loss_and_grads(model, x, seed=0)
    m = mc.measure(model, x)
    least = mc.min_budget(m.input_bytes, m.saved_bytes)
    first = mc.auto(model, x, budget=least)
    assert first.installed and first.checkpointed_stages == [0, 1, 2, 3]
    planned = _snapshot(model)
    with pytest.raises(ValueError, match="smallest feasible budget for this chain is"):
        mc.auto(model, x, budget=1)
    _assert_unchanged(model, planned)  # the same wrappers, still on
    assert first.installed
    with mc.ActivationMeter(exclude=model) as meter:
        out = model(x)
    assert meter.total_bytes <= first.memory_bytes
    out, grads = loss_and_grads(model, x, seed=0)
    assert torch.equal(out, ref_out)
    _assert_close(grads, ref_grads)
    second = mc.auto(model, x, budget=least)  # replaces the first plan
    assert second.installed and not first.installed
    replanned = _snapshot(model)
    first.remove()  # not its wrappers any more: nothing happens
    _assert_unchanged(model, replanned)
    second.remove()
    assert not second.installed
    _assert_unchanged(model, original)


def test_auto_with_a_budget_beyond_int64_stores_everything():
    torch.manual_seed(0)
    model = nn.Sequential(*[_mlp() for _ in range(3)])
    x = torch.randn(4, 8)
    for budget in (2**63, 10**30, "1e30GB"):
        plan = mc.auto(model, x, budget=budget)
        assert plan.segments == [(0, 3, False)] and plan.budget_bytes >= 2**63
        assert all("forward" not in blk.__dict__ for blk in model)
        plan.remove()
    y = mc.checkpoint_sequential(model, x, budget=2**64)
    assert torch.equal(y, model(x))
