"""torch.compile with memfit: a model planned by checkpoint.auto() (plan then compile,
compile then plan), memfit.checkpoint.checkpoint inside a compiled module, int8
boundaries (eager, outside the graph), memfit optimizers stepping a compiled model and
torch.compile around opt.step().

Gradient checks use backend="aot_eager": dynamo and AOTAutograd (where the checkpoint
becomes a recompute in the backward graph) without inductor's C++ code generation, so
the same aten kernels run in the same order and gradients match eager bit for bit. One
inductor test checks the generated code, to a tolerance: inductor fuses pointwise ops
and reassociates float sums (a few float32 ulps).
"""

import pytest

torch = pytest.importorskip("torch")

import memfit.checkpoint as mc  # noqa: E402
import memfit.optim as mo  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _blocks(n=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layers.append(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                          torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                          torch.nn.Linear(64, 16)))
    return torch.nn.Sequential(*layers)


X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def _train(model, run, steps=3):
    """The first step's gradients and the parameters after `steps` AdamW8bit steps
    of run(X).pow(2).mean() (8-bit states on the 64x64 weights)."""
    opt = mo.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1024)
    grads = None
    for s in range(steps):
        opt.zero_grad()
        run(X).pow(2).mean().backward()
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _saved_bytes(model, run):
    with mc.ActivationMeter(exclude=model) as meter:
        y = run(X)
    y.sum().backward()
    return meter.saved_bytes, meter.boundary_bytes


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("order", ["plan-then-compile", "compile-then-plan"])
def test_auto_plan_compiles_fullgraph_and_trains_like_eager(order):
    # the reference: no plan, no compile
    ref_model = _blocks()
    ref_grads, ref_params = _train(ref_model, ref_model)
    full_saved, _ = _saved_bytes(ref_model, ref_model)

    model = _blocks()
    if order == "plan-then-compile":
        p = mc.auto(model, X, budget="40%")
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    else:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(X)  # compiled before the plan: the wrapped blocks must recompile
        p = mc.auto(compiled, X, budget="40%")
    assert any(c for _, _, c in p.segments)
    grads, params = _train(model, compiled)
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)
    # the compiled graph really recomputes: it keeps no more than the plan's bound
    saved, _ = _saved_bytes(model, compiled)
    assert saved <= p.memory_bytes < full_saved


def test_auto_plan_under_inductor_matches_eager_to_float_rounding():
    ref_model = _blocks()
    ref_grads, _ = _train(ref_model, ref_model, steps=1)
    model = _blocks()
    mc.auto(model, X, budget="40%")
    grads, _ = _train(model, torch.compile(model, fullgraph=True), steps=1)
    for g, w in zip(grads, ref_grads, strict=True):
        # inductor fuses and reorders float32 sums: a few ulps of the largest entries
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_checkpoint_inside_compiled_module_fullgraph():
    """With dropout: the recompute must draw the forward's mask (preserve_rng_state)."""
    lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def f(x, scale):
        return mc.checkpoint(lambda t, s: lin2(torch.nn.functional.dropout(
            torch.nn.functional.gelu(lin1(t)), 0.3)) * s, x, scale)

    x = X.clone().requires_grad_(True)
    torch.manual_seed(7)
    f(x, 2.0).pow(2).sum().backward()
    want = [t.grad.clone() for t in (x, lin1.weight, lin2.weight)]
    for t in (x, lin1.weight, lin2.weight):
        t.grad = None
    torch.manual_seed(7)
    torch.compile(f, backend="aot_eager", fullgraph=True)(x, 2.0).pow(2).sum().backward()
    _assert_same([t.grad for t in (x, lin1.weight, lin2.weight)], want)


def test_int8_boundaries_run_eagerly_inside_compiled_model():
    eager = _blocks()
    mc.auto(eager, X, budget="40%", compress="int8")
    want_bytes = _saved_bytes(eager, eager)
    want = [p.grad.clone() for p in eager.parameters()]

    model = _blocks()
    mc.auto(model, X, budget="40%", compress="int8")
    got_bytes = _saved_bytes(model, torch.compile(model, backend="aot_eager"))
    assert got_bytes == want_bytes and want_bytes[1] > 0  # int8 codes kept, as in eager
    _assert_same([p.grad for p in model.parameters()], want)

    torch._dynamo.reset()  # else the frames compiled above (with breaks) are reused
    strict = torch.compile(_blocks(), backend="aot_eager", fullgraph=True)
    mc.auto(strict, X, budget="40%", compress="int8")
    with pytest.raises(Exception, match="compress='int8'"):
        strict(X)


def test_compiled_model_and_compiled_step_train_like_eager():
    """A compiled model stepped by AdamW8bit (8-bit states on its 2-D weights), with
    torch.compile around opt.step() too: the step is C code dynamo cannot trace, so it
    runs eagerly behind one graph break (step() is torch.compiler.disable-d) and the
    parameters equal an eager run's exactly."""
    from torch._dynamo.utils import counters

    ref = _blocks()
    _, want = _train(ref, ref)
    model = _blocks()
    opt = mo.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1024)
    compiled, step = torch.compile(model, backend="aot_eager"), torch.compile(opt.step)
    counters.clear()
    for s in range(3):
        opt.zero_grad()
        compiled(X).pow(2).mean().backward()
        step()
    assert opt.state[model[0][2].weight]["state1"].dtype == torch.uint8  # 8-bit states
    _assert_same([p.detach() for p in model.parameters()], want)
    breaks = {k: v for k, v in counters["graph_break"].items() if "disable" in k}
    assert sum(breaks.values()) == 1, dict(counters["graph_break"])
