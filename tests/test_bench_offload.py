"""benchmarks/bench_offload.py (issue 40 §6) smoke-run on the CPU, the CPU as the device:
the smallest GPT, two timed steps per recipe, and the JSON checked for every per-step
column with values that follow from the model (bytes = parameters x 2 for bf16, one hook
per tensor, the host step after backward without step_in_backward and during it with),
not for any timing (no timing assertions: the machine is shared)."""

import json
import math

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_offload

    out = tmp_path_factory.mktemp("bench_offload") / "bench_offload.json"
    bench_offload.main(["--size", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                        "--recipes", "device,offload,offload+sib,device+clip,offload+clip",
                        "--alone-threads", "1,2",
                        "--alone-reps", "1", "--out", str(out)])
    return bench_offload, json.loads(out.read_text())


def expected_model(bench_offload):
    """(elements, tensors) of the tiny GPT, counted from a model of its own."""
    from memfit.models import GPTConfig

    n_layer, d_model, n_head, vocab, seq, _ = bench_offload.SIZES["tiny"]
    with torch.device("meta"):
        model = bench_offload.CheckpointedGPT(GPTConfig(n_layer=n_layer, d_model=d_model,
                                                        n_head=n_head, vocab=vocab, max_pos=seq))
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def test_rows_and_bytes(bench):
    bench_offload, result = bench
    numel, tensors = expected_model(bench_offload)
    rows = {r["recipe"]: r for r in result["rows"]}
    assert list(rows) == ["device", "offload", "offload+sib", "device+clip", "offload+clip"]
    # each against the device run of its own clipping (on the CPU the norms agree too)
    for name in ("offload", "offload+sib", "offload+clip"):
        assert rows[name]["bit_exact_vs_device"] is True, name
    assert rows["device"]["bit_exact_vs_device"] is None
    assert rows["device+clip"]["bit_exact_vs_device"] is None
    assert rows["device+clip"]["x_device"] == 1.0 and rows["offload+clip"]["x_device"] > 0
    for name in ("offload", "offload+sib", "offload+clip"):
        r, b = rows[name], rows[name]["breakdown"]
        assert r["params"] == numel and r["param_bytes"] == numel * 2  # bf16
        # every tensor's gradient goes out once and its parameter comes back once
        assert b["d2h_bytes"] == b["h2d_bytes"] == numel * torch.bfloat16.itemsize
        assert b["hooks"] == tensors
        for k in ("forward_ms", "backward_ms", "host_step_ms", "hook_ms", "host_ns_per_param",
                  "host_core_ns_per_param", "device_idle_ms", "step_after_backward_ms",
                  "d2h_exposed_ms", "h2d_exposed_ms"):
            assert isinstance(b[k], float) and b[k] >= 0, (name, k, b[k])
        assert b["forward_ms"] > 0 and b["backward_ms"] > 0 and b["host_step_ms"] > 0
        assert b["threads"] >= 1 and b["kernel"] and b["kernel"] != "-"
        assert b["host_core_ns_per_param"] == pytest.approx(b["host_ns_per_param"] * b["threads"])
        # the CPU has no copy engine: no GB/s, no pinned allocator
        assert b["d2h_gb_s"] is None and b["h2d_gb_s"] is None
        assert b["pinned_requests"] is None and b["pinned_new_blocks"] is None
        assert b["staging_allocs"] >= 0
        assert b["host_end_vs_backward_end_ms"] >= b["host_start_vs_backward_end_ms"]
        m = r["model"]
        assert m["measured_ms"] == pytest.approx(b["forward_ms"] + b["backward_ms"]
                                                 + b["device_idle_ms"])
        assert b["device_idle_ms"] >= b["step_after_backward_ms"]  # zero_grad() too
        assert b["iteration_ms"] >= m["measured_ms"] - 1e-6
        assert m["predicted_ms"] >= b["forward_ms"] + b["backward_ms"]
        assert m["serial_ms"] >= b["forward_ms"] + b["backward_ms"] + b["host_step_ms"]
        assert m["model_d2h_ms"] > 0 and m["model_tail_ms"] > 0
    # offload: one host step, after backward; the arena is reused (no allocation once made)
    off, sib = rows["offload"]["breakdown"], rows["offload+sib"]["breakdown"]
    assert off["host_calls"] == 1 and off["host_start_vs_backward_end_ms"] >= 0
    assert off["staging_allocs"] == 0
    # step in backward: one step per tensor, the first during backward
    assert sib["host_calls"] == tensors and sib["host_start_vs_backward_end_ms"] < 0
    dev = rows["device"]["breakdown"]
    assert dev["d2h_bytes"] is None and dev["host_step_ms"] is None
    assert rows["device"]["model"] is None


def test_host_step_alone_and_metadata(bench):
    bench_offload, result = bench
    numel, _ = expected_model(bench_offload)
    alone = result["host_step_alone"]
    keys = {(r["step"].split()[0], r["dtype"], r["threads"]) for r in alone}
    assert keys == {(who, d, t) for who in ("memfit", "torch") for d in ("bfloat16", "float32")
                    for t in (1, 2)}
    for r in alone:
        assert r["params"] == numel  # the tiny model is under the cap: all of it
        assert r["s"] > 0 and r["ns_per_param"] == pytest.approx(r["s"] * 1e9 / numel)
        assert r["core_ns_per_param"] == pytest.approx(r["ns_per_param"] * r["threads"])
        if r["step"].startswith("torch"):
            assert r["x_torch"] == 1.0 and r["kernel"] in ("fused", "foreach")
    assert result["pinned_bandwidth"]["d2h_gb_s"] is None and result["pinned_bandwidth"]["note"]
    assert result["model_bandwidth_gb_s"]["d2h"] > 0
    meta = result["meta"]
    assert meta["commit"] and meta["date"] and meta["device"] == "cpu"
    assert len(meta["loadavg_before_after"]) == 2 and "--size tiny" in meta["command"]


def test_thread_counts_and_shapes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_offload
    from memfit.models import GPTConfig

    assert bench_offload.thread_counts(16) == [1, 2, 8, 15, 16]
    assert bench_offload.thread_counts(2) == [1, 2]
    assert bench_offload.thread_counts(1) == [1]
    n_layer, d_model, n_head, vocab, seq, _ = bench_offload.SIZES["1b"]
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, vocab=vocab, max_pos=seq)
    shapes = bench_offload.alone_shapes(cfg, 60_000_000)
    total = sum(math.prod(s) for s in shapes)
    # within the cap, matrices and vectors both (a block's mix), the embedding left out
    assert 40_000_000 < total <= 60_000_000
    assert (vocab, d_model) not in shapes and any(len(s) == 1 for s in shapes)
    assert any(len(s) == 2 and s[0] != s[1] for s in shapes)


def test_help_and_bad_arguments(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_offload

    with pytest.raises(SystemExit) as e:
        bench_offload.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "predicted = forward + max(backward" in text and "--alone-params" in text
    with pytest.raises(SystemExit) as e:
        bench_offload.main(["--steps", "0"])
    assert e.value.code == 2


@pytest.mark.slow
def test_gpu_validate_offload_stage_dry_run(tmp_path):
    """gpu_validate.sh's offload and offload3b stages end to end on the CPU
    (GPU_OFFLOAD_DRY_RUN=1): the commands the GPU run will make, their tables last and
    their JSON in $OUT."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import memfit

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    root = Path(__file__).resolve().parents[1]
    found = str(Path(memfit.__file__).resolve().parent.parent)
    env = {**os.environ, "OUT": str(tmp_path), "GPU_OFFLOAD_DRY_RUN": "1",
           "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([found, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["bash", str(root / "benchmarks" / "gpu_validate.sh"), "offload",
                        "offload3b"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "| bench_offload --size tiny --device cpu --steps 1 --warmup 1 | ok |" in r.stdout
    assert "| recipe | s/step | x device |" in r.stdout and "predicted" in r.stdout
    result = json.loads((tmp_path / "bench_offload.json").read_text())
    recipes = [row["recipe"] for row in result["rows"]]
    assert recipes[:4] == ["device", "device", "offload", "offload+sib"]
    assert result["rows"][1]["bit_exact_vs_device"] is True  # the CPU repeats itself
    stage = "| bench_offload --size tiny --device cpu --steps 1 --warmup 1 (3b stage) | ok |"
    assert stage in r.stdout
    result = json.loads((tmp_path / "bench_offload_3b.json").read_text())
    rows = {row["recipe"]: row for row in result["rows"]}
    assert list(rows) == ["device", "offload", "device+clip", "offload+clip"]
    assert rows["offload+clip"]["bit_exact_vs_device"] is True and result["host_step_alone"] == []


def _probe_module():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _offload_probe

    return _offload_probe


def test_event_log_read_defensively():
    """The per-step numbers from a hand-made event log in the chunked pipeline's kinds
    (host_step_start/_end framing chunk_step_start/_end, chunk_landed, chunk_h2d,
    chunk_d2h_start/_end), with kinds and details it does not know mixed in: those are
    ignored, the chunks are the host's calls, and the numbers follow from the times."""
    probe_mod = _probe_module()

    class Staging:
        allocations = 3

    class Opt:
        _events = None
        _staging = Staging()

    opt = Opt()
    probe = probe_mod.StepProbe(opt, torch.device("cpu"))
    probe.begin()
    assert opt._events == []
    ms = 1_000_000
    probe.t0, probe.t1, probe.t2, probe.t3 = 0, 10 * ms, 110 * ms, 116 * ms
    probe.t4, probe.t_end = 117 * ms, 118 * ms  # zero_grad() returned; the iteration's end
    probe.staging1, probe.pinned1 = 4, None
    t2 = probe.t2
    opt._events = [
        (20 * ms, "hook", (0, 2 * ms)), (60 * ms, "hook", (2, 1 * ms)),
        (61 * ms, "hook", "not a pair"), (62 * ms, "hook", (99, 5 * ms)),  # index unknown
        (t2, "chunk_d2h_start", 0), (t2 + ms // 4, "chunk_d2h_end", 0),  # not host work
        (t2 + ms // 2, "host_step_start", None), (t2 + ms // 2, "chunk_landed", 0),
        (t2 + 1 * ms, "chunk_step_start", 0), (t2 + 3 * ms, "chunk_step_end", 0),
        (t2 + 3 * ms, "chunk_h2d", 0),
        (t2 + 3 * ms, "chunk_step_start", 1), (t2 + 4 * ms, "chunk_stepped", 1),
        (t2 + 5 * ms, "chunk_h2d", 1), (t2 + 5 * ms, "something_new", {"x": 1}),
        (t2 + 6 * ms, "host_step_end", None), (t2 + 6 * ms, "step_returning", None),
    ]
    sizes = [(1000, 2), (10, 2), (500, 2)]  # slot 1 had no gradient this step
    b = probe.phases(sizes, threads=3)
    assert b["forward_ms"] == 10 and b["backward_ms"] == 100 and b["step_after_backward_ms"] == 6
    assert b["zero_grad_ms"] == 1 and b["iteration_ms"] == 118
    assert b["d2h_bytes"] == b["h2d_bytes"] == (1000 + 500) * 2
    assert b["hooks"] == 3 and b["hook_ms"] == 8  # every well-formed hook event, timed
    assert b["d2h_exposed_ms"] == 0.5 and b["h2d_exposed_ms"] == 1.0
    assert b["host_start_vs_backward_end_ms"] == 1 and b["host_end_vs_backward_end_ms"] == 4
    assert b["host_step_ms"] == 3 and b["host_calls"] == 2  # two chunks: 2 ms + 1 ms busy
    assert b["host_ns_per_param"] == pytest.approx(3 * ms / 1500)
    assert b["host_core_ns_per_param"] == pytest.approx(3 * 3 * ms / 1500)
    assert b["device_idle_ms"] == 7 and b["staging_allocs"] == 1  # until zero_grad() returned
    assert b["d2h_gb_s"] is None and b["pinned_requests"] is None  # GPU only


def test_event_log_without_host_events():
    """An optimizer that logs nothing (torchao, the device recipe): times only, the
    offloader's columns None (printed "-")."""
    probe_mod = _probe_module()
    probe = probe_mod.StepProbe(object(), torch.device("cpu"))
    probe.begin()
    probe.t0, probe.t1, probe.t2, probe.t3 = 0, 1_000_000, 3_000_000, 4_000_000
    probe.t4 = probe.t_end = 4_000_000
    probe.staging1, probe.pinned1 = None, None
    b = probe.phases([(10, 4)], threads=None)
    assert b["forward_ms"] == 1 and b["backward_ms"] == 2 and b["device_idle_ms"] == 1
    for k in ("d2h_bytes", "d2h_exposed_ms", "h2d_exposed_ms", "host_step_ms", "hook_ms",
              "host_ns_per_param", "staging_allocs"):
        assert b[k] is None, k
    assert probe_mod.predicted_ms(b, 1.0, 1.0) is None


def test_step_time_model():
    """predicted = fwd + max(bwd, d2h, host) + (host + h2d) * min(1, 64 MiB / h2d bytes);
    serial = fwd + bwd + d2h exposed + host + h2d, by hand."""
    probe_mod = _probe_module()
    nbytes = 256 * 2**20  # four chunks
    b = {"forward_ms": 10.0, "backward_ms": 100.0, "host_step_ms": 80.0, "d2h_bytes": nbytes,
         "h2d_bytes": nbytes, "d2h_exposed_ms": 2.0, "device_idle_ms": 30.0}
    gb_s = nbytes / 1e9 / 0.05  # 50 ms each way
    m = probe_mod.predicted_ms(b, gb_s, gb_s)
    assert m["model_d2h_ms"] == pytest.approx(50) and m["model_h2d_ms"] == pytest.approx(50)
    assert m["model_tail_ms"] == pytest.approx((80 + 50) / 4)
    assert m["predicted_ms"] == pytest.approx(10 + 100 + (80 + 50) / 4)
    assert m["serial_ms"] == pytest.approx(10 + 100 + 2 + 80 + 50)
    b["host_step_ms"] = 300.0  # the host step longer than backward sets the pace
    assert probe_mod.predicted_ms(b, gb_s, gb_s)["predicted_ms"] == pytest.approx(
        10 + 300 + (300 + 50) / 4)
    assert probe_mod.measured_ms(b) == 140.0
    assert probe_mod.predicted_ms(b, None, gb_s) is None  # no bandwidth, no model
