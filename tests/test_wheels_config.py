"""The wheel recipe (pyproject.toml's [tool.cibuildwheel], .ci/wheels/install_cuda.sh,
.github/workflows/wheels.yml) as far as it can be checked without a container: it parses,
the wheel's architectures are the build's default list, the toolkit is a CUDA 12.x that
builds memfit, and the before-all script stops cleanly outside the container."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "wheels" / "install_cuda.sh"
CBW = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["cibuildwheel"]


def default_archs() -> str:
    text = (ROOT / "cmake" / "memfit_cuda_archs.cmake").read_text()
    return re.search(r'set\(MEMFIT_DEFAULT_CUDA_ARCHS "([^"]+)"\)', text).group(1).replace(";", ",")


def test_wheels_build_and_check_the_default_architectures():
    env = CBW["linux"]["environment"]
    assert env["MEMFIT_CUDA_ARCHS"] == default_archs() == "75-real,80-real,86-real,89-real,90"
    assert f"b['cuda_archs'] == '{default_archs()}'" in CBW["test-command"][0]
    assert CBW["linux"]["config-settings"]["cmake.define.MEMFIT_CUDA"] == "ON"
    assert CBW["manylinux-x86_64-image"] == "manylinux_2_28"
    assert all(b.endswith("-manylinux_x86_64") for b in CBW["build"])


def test_toolkit_is_a_cuda_12_that_builds_memfit():
    version = re.fullmatch(r"bash \{project\}/\.ci/wheels/install_cuda\.sh (\d+)\.(\d+)",
                           CBW["linux"]["before-all"])
    assert version, CBW["linux"]["before-all"]
    minimum = re.search(r"set\(MEMFIT_MIN_NVCC_VERSION (\d+)\.(\d+)\)",
                        (ROOT / "cmake" / "memfit_cuda_archs.cmake").read_text())
    assert int(version.group(1)) == 12  # 13 would need driver >= 580
    assert (int(version.group(1)), int(version.group(2))) >= (int(minimum.group(1)), int(minimum.group(2)))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_before_all_script():
    dry = subprocess.run(["bash", str(SCRIPT), "12.4", "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "cuda-nvcc-12-4 cuda-cudart-devel-12-4" in dry.stdout
    assert "ln -sfn /usr/local/cuda-12.4 /usr/local/cuda" in dry.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "13.0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "a CUDA 12.x toolkit" in bad.stderr
    if not Path("/etc/os-release").exists() or "almalinux" not in Path("/etc/os-release").read_text().lower():
        outside = subprocess.run(["bash", str(SCRIPT), "12.4"], capture_output=True, text=True)
        assert outside.returncode == 1 and "expects manylinux_2_28" in outside.stderr


def test_workflow_runs_cibuildwheel():
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "wheels.yml").read_text())
    steps = wf["jobs"]["linux"]["steps"]
    assert any("cibuildwheel --platform linux" in s.get("run", "") for s in steps)
    assert "workflow_dispatch" in wf[True]  # YAML 1.1 reads the key `on` as True
