#!/usr/bin/env bash
# cibuildwheel's before-all for the Linux wheels (pyproject.toml, [tool.cibuildwheel.linux]):
# installs a CUDA toolkit (nvcc, the static runtime, headers) and a host compiler nvcc
# accepts into the manylinux_2_28 container (AlmaLinux 8), as /usr/local/cuda.
#
#   .ci/wheels/install_cuda.sh 12.4            # in the container (root, dnf, network)
#   .ci/wheels/install_cuda.sh 12.4 --dry-run  # anywhere: checks, then prints the commands
#
# Why 12.4: a CUDA 12.x runtime runs on any driver >= 525 (CUDA's minor-version
# compatibility) and 12.4 is Colab's driver's CUDA, so even the compute_90 PTX the wheel
# carries compiles there; nvcc 13 would need driver >= 580. nvcc 12.4 accepts GCC <= 13,
# and manylinux_2_28's default toolset is newer: gcc-toolset-13 is installed for nvcc's
# host compiler (CUDAHOSTCXX in pyproject.toml).
set -euo pipefail

version=${1:-}
dry_run=0
[ "${2:-}" = "--dry-run" ] && dry_run=1
if ! [[ $version =~ ^12\.[0-9]+$ ]]; then
  echo "usage: $0 12.MINOR [--dry-run]   (a CUDA 12.x toolkit: memfit needs nvcc >= 12.0," \
       "and 13.x builds need driver >= 580)" >&2
  exit 2
fi
dashed=${version/./-}
repo=https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
packages=(cuda-nvcc-$dashed cuda-cudart-devel-$dashed cuda-cccl-$dashed cuda-driver-devel-$dashed
          gcc-toolset-13-gcc-c++)
commands=(
  "dnf install -y dnf-plugins-core"
  "dnf config-manager --add-repo $repo"
  "dnf install -y --setopt=install_weak_deps=False ${packages[*]}"
  "ln -sfn /usr/local/cuda-$version /usr/local/cuda"
  "/usr/local/cuda/bin/nvcc --version"
  "/opt/rh/gcc-toolset-13/root/usr/bin/g++ --version"
)

if [ $dry_run = 1 ]; then
  printf '%s\n' "${commands[@]}"
  exit 0
fi
if ! grep -qE '^ID="?(almalinux|rhel|rocky|centos)' /etc/os-release 2>/dev/null \
   || ! grep -qE '^VERSION_ID="?8' /etc/os-release; then
  echo "$0: expects manylinux_2_28 (AlmaLinux 8); run it through cibuildwheel, or use --dry-run" >&2
  exit 1
fi
for c in "${commands[@]}"; do
  echo "+ $c"
  eval "$c"
done
