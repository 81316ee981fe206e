"""Every notebook under notebooks/ runs top to bottom on the CPU (as CI does), with no
cell raising, and shows what its text says: after the notebook's own cells, a check
cell from CHECKS runs in the same kernel (on the notebook's variables), and the printed
outputs the prose talks about are read back and checked."""

import json
import math
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def printed(nb, marker: str) -> str:
    """The text printed by the one code cell whose source contains ``marker``."""
    cells = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"expected one cell containing {marker!r}, found {len(cells)}"
    return "".join(o.get("text", "") for o in cells[0].get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def numbers(pattern: str, text: str) -> list:
    found = [float(m) for m in re.findall(pattern, text)]
    assert found, f"{pattern!r} not found in:\n{text}"
    return found


def outputs_00(nb, cwd):
    # "mean absolute error below 0.011 and mean relative error below 0.018 for every block size"
    text = printed(nb, "for block_size in q.BLOCK_SIZES")
    rows = re.findall(r"block\s+(\d+): abs err ([0-9.]+)\s+rel err ([0-9.]+)\s+bytes ([0-9,]+) vs ([0-9,]+)", text)
    assert len(rows) >= 5, text
    for _, abs_err, rel_err, nbytes, f32_bytes in rows:
        assert float(abs_err) < 0.011 and float(rel_err) < 0.018, text
        # one byte per value plus a float32 per block: between 1/4 and 1/3 of float32's
        assert 0.25 < int(nbytes.replace(",", "")) / int(f32_bytes.replace(",", "")) < 0.34, text
    # "the average of many draws equals the input": closer to 0.3 than nearest rounding
    nearest, stochastic = numbers(r"(?:nearest|stochastic mean): ([0-9.]+)", printed(nb, "draws ="))
    assert abs(stochastic - 0.3) < 1e-3 and abs(stochastic - 0.3) < abs(nearest - 0.3) / 4
    # every bad input was refused with a memfit error
    errors = printed(nb, "for bad in").strip().splitlines()
    assert len(errors) == 3 and all(" - " in line for line in errors), errors


CHECK_00 = """
assert len(code) == 256 and (np.diff(code) > 0).all() and code.max() == 1.0 and code.min() >= -1.0
assert int((np.abs(code) < 0.01).sum()) > 32           # "dense near zero"
assert type(b) is np.ndarray and b.dtype == ml_dtypes.bfloat16
assert float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean()) < 0.011
"""


def outputs_01(nb, cwd):
    before = printed(nb, "opt = torch.optim.AdamW(")
    after = printed(nb, "opt = memfit.optim.AdamW8bit(")
    (loss_torch,), (mb_torch,) = numbers(r"loss ([0-9.]+)", before), numbers(r"state ([0-9.]+) MB", before)
    (loss_memfit,), (mb_memfit,) = numbers(r"loss ([0-9.]+)", after), numbers(r"state ([0-9.]+) MB", after)
    assert 0.2 < mb_memfit / mb_torch < 0.35  # "about a quarter of AdamW's"
    # "the loss goes down the same way": both well below the untrained log(256) = 5.55
    assert loss_torch < 4.0 and loss_memfit < 4.0 and abs(loss_torch - loss_memfit) < 0.5


CHECK_01 = """
assert acc.optimizer_steps == steps
assert plan.memory_bytes <= 0.5 * plan.full_memory_bytes and plan.checkpointed_stages
assert isinstance(opt, memfit.optim.AdamW8bit)
"""


def outputs_02(nb, cwd):
    est = printed(nb, '["estimate", "gpt2-medium"')
    assert "gpt2-medium" in est and "fits" in est, est
    rows = json.loads((cwd / "memfit-profile" / "profile.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["baseline", "autocast", "adamw8bit", "checkpoint", "memfit"]
    for r in rows:
        measured = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
        if "estimated_bytes" in r:  # the estimate beside each measurement: within 10%
            assert abs(measured - r["estimated_bytes"]) <= 0.1 * r["estimated_bytes"], r
    assert (cwd / "memfit-profile" / "profile.png").stat().st_size > 0


CHECK_02 = """
assert 0 < est.total <= M.parse_gpu("l4")[0]              # the recommended setting fits the L4
assert est.total < M.estimate(spec, M.Setup(batch=4, seq=2048)).total  # and saves memory
assert slowdown >= 0
"""


def outputs_03(nb, cwd):
    losses = json.loads(printed(nb, "trainer.train()").strip().splitlines()[-1])
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # logged every 4 of 12 steps


CHECK_03 = """
assert plan.checkpointed_stages and plan.memory_bytes <= 0.5 * plan.full_memory_bytes
assert trainer.state.global_step == 12 and optimizer.state
"""


def outputs_04(nb, cwd):
    assert "1024" in printed(nb, 'precision="fp16"')  # setup's init_scale=2**10 for fp16


CHECK_04 = """
assert p in ("bf16", "fp16", "fp32") and p.reason
assert autocast.dtype == torch.float16 and scaler.is_enabled()
assert st["backoffs"] >= 1                              # "the scale backed off once"
assert acc.optimizer_steps == 4                         # 3 full accumulations + the flush
assert math.isfinite(float(acc.last_grad_norm))
assert sorted(sd) == ["_growth_tracker", "backoff_factor", "growth_factor", "growth_interval", "scale"]
"""


def outputs_05(nb, cwd):
    text = printed(nb, "results = {name: train(make)")
    rows = dict((name.strip(), (float(loss), float(mb), float(per)))
                for name, loss, mb, per in re.findall(r"^(.+?)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$",
                                                      text, flags=re.M))
    assert rows["torch.optim.AdamW"][2] == pytest.approx(8.0, abs=0.01)
    assert 2.0 < rows["memfit AdamW8bit"][2] < 2.6  # "a little above 2 and 1"
    assert 1.0 < rows["memfit AdamW4bit"][2] < 1.6
    losses = [v[0] for v in rows.values()]
    assert max(losses) - min(losses) < 0.3, rows  # "the three losses end close together"
    assert "True" in printed(nb, "same = all(")
    refused = printed(nb, "narrow = GPT(").strip().splitlines()
    assert len(refused) == 2 and all(line.startswith("ValueError:") for line in refused)


CHECK_05 = """
assert formats == {"torch.uint8"}                       # min_8bit_size=0: 8-bit states for every matrix
assert set(states) == {"exp_avg", "exp_avg_sq"}
assert all(v.dtype == torch.float32 and v.shape == p.shape for v in states.values())
assert state["state1"].dtype == np.uint8
"""

def outputs_06(nb, cwd):
    text = printed(nb, "fsdp_train.py ckpt")
    # "each rank holds its rows of the weight and the same rows of its states": 19 + 18
    ranks = re.findall(r"rank (\d): weight \(37, 300\) .*local rows (\d+); state1 torch.uint8 local "
                       r"\((\d+), 300\), absmax1 local \((\d+), 2\)", text)
    assert ranks == [("0", "19", "19", "19"), ("1", "18", "18", "18")], text
    assert "resumed on 2 processes from step 4: parameters identical: True" in text, text
    assert len(numbers(r"step \d: loss ([0-9.]+)", text)) == 8
    one = printed(nb, 'fsdp_train.load(model, opt, "ckpt/step4")')
    assert "loaded: Tensor torch.uint8 (37, 300) absmax1 (37, 2) step 4" in one, one
    assert "parameters identical: True, states identical: True" in one, one


CHECK_06 = """
assert same_params and same_states
assert type(st["state1"]) is torch.Tensor and st["state1"].shape == (37, 300)
assert len(ref["grads"]) == 4 and int(st["step"]) == 8
"""

def outputs_07(nb, cwd):
    plan = printed(nb, "mm.estimate(mm.PRESETS[name], setup)")
    # "a 24 GB card ... trains the 7B one" offloaded, which does not fit it plain
    assert "llama-7b" in plan and plan.count("24 GB card: plain does not fit, offloaded fits") >= 1, plan
    train = printed(nb, "CPUOffloadOptimizer(model.parameters()")
    losses = numbers(r"loss ([0-9.]+)", train)
    assert len(losses) == 4 and losses[-1] < losses[0] < 6.0, train  # it learns
    assert "no gradient left on the device after backward: True" in train, train
    assert "parameters identical to AdamW8bit stepping itself: True" in train, train
    host = printed(nb, "def nbytes(ts)")
    (device,) = numbers(r"device: ([0-9.]+) bytes", host)
    (master,), (states,) = numbers(r"master ([0-9.]+)", host), numbers(r"states ([0-9.]+)", host)
    assert device == 2.0 and master == 2.0 and 2.0 <= states < 3.5, host  # "2 bytes, plus ..."
    assert "gradients left after backward: 0" in printed(nb, "sib_model = copy.deepcopy"), nb


CHECK_07 = """
assert same and no_grad_on_device
assert type(opt.optimizer).__name__ == "AdamW8bit" and opt.optimizer.state
assert all(p.grad is None for p in sib_model.parameters())
"""

def outputs_08(nb, cwd):
    split = printed(nb, "muon_param_groups(model, lr=3e-3)")
    assert "use_muon=True: 8 tensors" in split and "use_muon=False" in split, split
    train = printed(nb, "Muon8bit(groups, lr=0.02)")
    muon, adamw = numbers(r"Muon8bit loss ([0-9.]+)", train), numbers(r"AdamW8bit loss ([0-9.]+)", train)
    # "both learn the rule; Muon8bit's loss falls faster per step"
    assert len(muon) == len(adamw) == 4 and muon[-1] < 0.1 and adamw[-1] < 0.1, train
    assert all(m < a for m, a in zip(muon, adamw)), train
    sizes = printed(nb, "def state_bytes(o, params)")
    (muon_b,), (adamw_b,) = numbers(r"Muon8bit: ([0-9.]+) bytes", sizes), numbers(r"AdamW8bit: ([0-9.]+) bytes", sizes)
    # one byte plus a float32 per block (of 256, or of a 128-element row); AdamW8bit two of those
    assert 1 + 4 / 256 <= muon_b <= 1 + 4 / 128 and abs(adamw_b - 2 * muon_b) <= 0.002, sizes
    torch_line = printed(nb, "torch.optim.Muon([w_torch]")
    assert "bit for bit: True" in torch_line or "has no torch.optim.Muon" in torch_line, torch_line
    saved = printed(nb, "saved = copy.deepcopy(opt.state_dict())")
    assert "resumed run identical: True" in saved and "['momentum_buffer']" in saved, saved
    plan = printed(nb, "for optimizer in (\"adamw\", \"adamw8bit\", \"muon8bit\")")
    for a, a8, m8 in re.findall(r"adamw ([0-9.]+) GB \| adamw8bit ([0-9.]+) GB \| muon8bit ([0-9.]+) GB", plan):
        assert float(m8) < float(a8) < float(a), plan


CHECK_08 = """
assert isinstance(opt, memfit.optim.Muon8bit) and opt.param_groups[1]["use_muon"] is False
assert resumed_same and all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
assert exported["state"] and all(v["momentum_buffer"].dtype == torch.float32 for v in exported["state"].values())
"""

CHECKS = {
    "00_quantization.ipynb": (CHECK_00, outputs_00),
    "01_quickstart.ipynb": (CHECK_01, outputs_01),
    "02_will_it_fit.ipynb": (CHECK_02, outputs_02),
    "03_huggingface.ipynb": (CHECK_03, outputs_03),
    "04_amp_loop.ipynb": (CHECK_04, outputs_04),
    "05_8bit_optimizers.ipynb": (CHECK_05, outputs_05),
    "06_distributed.ipynb": (CHECK_06, outputs_06),
    "07_offload.ipynb": (CHECK_07, outputs_07),
    "08_muon.ipynb": (CHECK_08, outputs_08),
}


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ should hold at least one notebook"


def test_every_notebook_is_checked():
    assert sorted(p.name for p in NOTEBOOKS) == sorted(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_shows_what_it_says(path, tmp_path):
    check_cell, check_outputs = CHECKS[path.name]
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import math\n" + check_cell))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell (the checks too)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    check_outputs(nb, tmp_path)
