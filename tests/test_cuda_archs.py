"""cmake/memfit_cuda_archs.cmake: which GPU architectures a CUDA build compiles for, and
the refusal of an nvcc that cannot build memfit. Run in CMake's script mode with a fake
nvidia-smi and a fake nvcc first on PATH, so every case runs on a machine without a GPU
(and without nvcc, except the last test)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cmake" / "memfit_cuda_archs.cmake"
CMAKE = shutil.which("cmake")
DEFAULT = "75-real;80-real;86-real;89-real;90"

pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake")


def fake_tool(bindir: Path, name: str, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def fake_smi(bindir: Path, caps=None, driver_cuda="12.4") -> None:
    """nvidia-smi listing GPUs of compute capabilities `caps` ("7.5", ...), or failing as
    it does without a driver when `caps` is None."""
    if caps is None:
        fake_tool(bindir, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it couldn't "
                                        "communicate with the NVIDIA driver.'\nexit 9\n")
        return
    lines = "\\n".join(caps)
    fake_tool(bindir, "nvidia-smi",
              f'case "$*" in\n  *compute_cap*) printf "{lines}\\n" ;;\n'
              f'  *) echo "| NVIDIA-SMI 550.54.15  Driver Version: 550.54.15  CUDA Version: {driver_cuda} |" ;;\nesac\n')


def fake_nvcc(bindir: Path, release: str, sms=(75, 80, 86, 89, 90)) -> Path:
    codes = "\\n".join(f"sm_{n}" for n in sms)
    fake_tool(bindir, "nvcc",
              f'case "$*" in\n  *--version*) echo "Cuda compilation tools, release {release}, V{release}.1" ;;\n'
              f'  *--list-gpu-code*) printf "{codes}\\n" ;;\n  *) exit 1 ;;\nesac\n')
    return bindir / "nvcc"


def run(bindir: Path, mode="resolve", env_archs=None, define=None, nvcc=None):
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_CUDA_ARCHS"}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    if env_archs is not None:
        env["MEMFIT_CUDA_ARCHS"] = env_archs
    args = [CMAKE, f"-DMEMFIT_ARCHS_SCRIPT={mode}"]
    if define is not None:
        args.append(f"-DMEMFIT_CUDA_ARCHS={define}")
    if nvcc is not None:
        args.append(f"-DNVCC={nvcc}")
    r = subprocess.run([*args, "-P", str(SCRIPT)], capture_output=True, text=True, env=env,
                       timeout=60)
    values = dict(line[3:].split("=", 1) for line in r.stdout.splitlines()
                  if line.startswith("-- ") and "=" in line)
    return r, values


def resolved(tmp_path, **kw):
    r, values = run(tmp_path / "bin", **kw)
    assert r.returncode == 0, r.stderr
    return values["archs"], values["source"]


def test_no_gpu_builds_the_default_list(tmp_path):
    fake_smi(tmp_path / "bin", None)
    assert resolved(tmp_path) == (DEFAULT, "the default list (nvidia-smi lists no GPU)")


def test_every_gpu_present_deduplicated_newest_with_ptx(tmp_path):
    fake_smi(tmp_path / "bin", ["8.6", "7.5", "8.6"])
    assert resolved(tmp_path) == ("75-real;86", "the GPUs nvidia-smi lists")


def test_one_gpu(tmp_path):
    fake_smi(tmp_path / "bin", ["7.5"])  # a T4 (Colab)
    assert resolved(tmp_path)[0] == "75"


def test_two_digit_minor_and_three_digit_major(tmp_path):
    fake_smi(tmp_path / "bin", ["12.0", "9.0"])  # an RTX 50xx beside an H100
    assert resolved(tmp_path)[0] == "90-real;120"


def test_environment_overrides_the_gpus(tmp_path):
    fake_smi(tmp_path / "bin", ["7.5"])
    # commas as well as semicolons; PTX added to the newest when no entry has any
    assert resolved(tmp_path, env_archs="80-real,90-real") == (
        "80-real;90", "MEMFIT_CUDA_ARCHS (environment)")


def test_define_overrides_the_environment(tmp_path):
    fake_smi(tmp_path / "bin", ["7.5"])
    assert resolved(tmp_path, env_archs="80", define="86-real;89") == (
        "86-real;89", "MEMFIT_CUDA_ARCHS (CMake define)")


def test_a_list_with_ptx_is_kept(tmp_path):
    fake_smi(tmp_path / "bin", None)
    assert resolved(tmp_path, define="75-real;80-virtual;90a-real")[0] == "75-real;80-virtual;90a-real"


def test_native_means_the_gpus_nvidia_smi_lists(tmp_path):
    fake_smi(tmp_path / "bin", ["8.0"])
    assert resolved(tmp_path, define="native")[0] == "80"


def test_native_without_a_gpu_is_an_error_not_sm52(tmp_path):
    fake_smi(tmp_path / "bin", None)
    r, values = run(tmp_path / "bin", define="native")
    assert r.returncode != 0 and "archs" not in values
    assert "MEMFIT_CUDA_ARCHS=native, but nvidia-smi lists no GPU" in " ".join(r.stderr.split())


@pytest.mark.parametrize("bad", ["sm_80", "all", "all-major", "75;eighty"])
def test_entries_that_do_not_name_an_architecture_are_refused(tmp_path, bad):
    fake_smi(tmp_path / "bin", None)
    r, values = run(tmp_path / "bin", define=bad)
    assert r.returncode != 0 and "archs" not in values
    assert "is not an architecture number" in " ".join(r.stderr.split())


def test_nvcc_older_than_12_is_refused(tmp_path):
    fake_smi(tmp_path / "bin", None)
    nvcc = fake_nvcc(tmp_path / "bin", "11.8")
    r, values = run(tmp_path / "bin", mode="check-nvcc", nvcc=nvcc)
    assert r.returncode != 0 and "nvcc" not in values
    assert "is CUDA 11.8; memfit needs nvcc >= 12.0" in " ".join(r.stderr.split())


def test_architecture_the_nvcc_cannot_build_is_refused(tmp_path):
    fake_smi(tmp_path / "bin", ["10.0"])  # a B200 and an nvcc 12.4, which stops at sm_90
    nvcc = fake_nvcc(tmp_path / "bin", "12.4")
    r, values = run(tmp_path / "bin", mode="check-nvcc", nvcc=nvcc)
    assert r.returncode != 0
    assert "nvcc 12.4 cannot build architecture 100" in " ".join(r.stderr.split())


def test_nvcc_newer_than_the_driver_warns(tmp_path):
    fake_smi(tmp_path / "bin", ["7.5"], driver_cuda="12.4")  # Colab: driver 550
    r, values = run(tmp_path / "bin", mode="check-nvcc", nvcc=fake_nvcc(tmp_path / "bin", "13.0"))
    assert r.returncode == 0 and values["nvcc"] == "13.0"
    assert "supports CUDA 12.4: the kernels built will not run here" in " ".join(r.stderr.split())
    r, values = run(tmp_path / "bin", mode="check-nvcc", nvcc=fake_nvcc(tmp_path / "bin", "12.5"))
    assert r.returncode == 0 and values["nvcc"] == "12.5"
    assert "will not run here" not in r.stderr  # CUDA 12 minor versions run on a 12.x driver


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_real_nvcc_builds_the_default_list(tmp_path):
    fake_smi(tmp_path / "bin", None)
    r, values = run(tmp_path / "bin", mode="check-nvcc", nvcc=shutil.which("nvcc"))
    assert r.returncode == 0, r.stderr
    assert values["nvcc"].split(".")[0] in ("12", "13")
