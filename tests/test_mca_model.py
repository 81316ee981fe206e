"""benchmarks/mca_model.py: loop extraction from gcc assembly (pure Python), and one
real llvm-mca run (skipped where gcc or llvm-mca is missing; CI installs Debian's
`llvm`)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mca_model", ROOT / "benchmarks" / "mca_model.py")
mca_model = importlib.util.module_from_spec(_spec)
sys.modules["mca_model"] = mca_model
_spec.loader.exec_module(mca_model)

ASM = """\
f:
\tmovl\t$0, %eax
#APP
# 5 "k.c" 1
\t# LLVM-MCA-BEGIN demo elems=8 isa=avx2
# 0 "" 2
#NO_APP
\ttestq\t%rdx, %rdx
\tjle\t.L2
\t.p2align 4
.L3:
\tvmovups\t(%rsi,%rax,4), %ymm0
\tvmulps\t%ymm1, %ymm0, %ymm0
\tvmovups\t%ymm0, (%rdi,%rax,4)
\taddq\t$8, %rax
\tcmpq\t%rdx, %rax
\tjne\t.L3
.L2:
#APP
\t# LLVM-MCA-END
#NO_APP
\tret
"""


def test_extracts_only_the_loop_between_markers():
    regions = mca_model.extract_regions(ASM)
    assert [r["name"] for r in regions] == ["demo"]
    reg = regions[0]
    assert reg["elems"] == 8 and reg["isa"] == "avx2"
    # label to backward branch: no setup (testq/jle), no directive, no code after END
    assert reg["loop"][0] == ".L3:"
    assert reg["loop"][-1].split() == ["jne", ".L3"]
    assert not any("testq" in ln or ".p2align" in ln or "ret" in ln for ln in reg["loop"])
    assert len(reg["loop"]) == 7


def test_bad_isa_in_spec_is_refused():
    with pytest.raises(SystemExit, match="isa must be one of"):
        mca_model.parse_spec("demo elems=8 isa=sse9")


def test_avx512_region_is_skipped_on_zen3():
    assert "avx512" not in mca_model.CPU_ISAS["znver3"]
    assert "avx512vbmi" not in mca_model.CPU_ISAS["skylake-avx512"]


@pytest.mark.skipif(shutil.which("gcc") is None or mca_model.find_llvm_mca() is None,
                    reason="needs gcc and llvm-mca (Debian: apt-get install llvm)")
def test_models_one_loop_on_one_cpu(tmp_path, capsys):
    out = tmp_path / "mca.json"
    result = mca_model.main(["--regions", "quant_lut_avx2", "--cpus", "znver3",
                             "--iterations", "50", "--json", str(out)])
    res = result["regions"][0]["results"]["znver3"]
    assert res["cycles_per_iter"] > 0 and res["block_rthroughput"] > 0
    assert result["regions"][0]["elems"] == 8
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if ln.startswith("| quant_lut_avx2"))
    assert float(row.split("|")[4]) > 0  # the znver3 column
    assert out.exists() and '"cycles_per_iter"' in out.read_text()
