# Cross-compiling the core for 64-bit Arm Linux (NVIDIA Grace, AWS Graviton) from another
# machine, with Debian's gcc-aarch64-linux-gnu. The binaries run under qemu-aarch64
# (qemu-user) with `-L /usr/aarch64-linux-gnu` (tests/test_aarch64.py does this):
#   cmake -S . -B build-arm -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#         -DMEMFIT_PYTHON=OFF -DMEMFIT_CUDA=OFF -DMEMFIT_BUILD_TESTS=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(MEMFIT_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "prefix of the cross compiler's name")
set(CMAKE_C_COMPILER ${MEMFIT_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${MEMFIT_CROSS_PREFIX}g++)

# Libraries and headers come from the target's sysroot only, programs from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# ctest runs the test binaries through qemu.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
