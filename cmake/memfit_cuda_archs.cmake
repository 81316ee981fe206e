# Which GPU architectures a CUDA build of memfit compiles for, and whether the nvcc found
# can build memfit at all. CMakeLists.txt includes this file; tests/test_cuda_archs.py runs
# it on its own (`cmake -DMEMFIT_ARCHS_SCRIPT=resolve -P cmake/memfit_cuda_archs.cmake`)
# with a fake nvidia-smi / nvcc on PATH, so the choice is tested on machines without a GPU.
#
# Why not CMake's `native`: it asks nvcc, and where nvcc cannot see the GPU (an empty
# CUDA_VISIBLE_DEVICES, a build sandbox) nvcc only warns and builds sm_52, which fails at
# the first launch on every GPU memfit supports, and build_info would say 'native'. The
# driver's own list of GPUs (nvidia-smi) sees every GPU present whatever the process may
# use, and the resolved numbers are what build_info records.

# The architectures built when no GPU is visible: T4 (75), A100 (80), RTX 30xx/A10 (86),
# RTX 40xx/L4 (89), H100 (90: SASS and PTX, so newer GPUs JIT-compile the PTX).
set(MEMFIT_DEFAULT_CUDA_ARCHS "75-real;80-real;86-real;89-real;90")
# The oldest nvcc that builds memfit: cuda/cuda_util.cuh uses the CUDA 12.0 runtime API
# (cudaGetDriverEntryPoint with its driverStatus argument, added in 12.0), and the default
# list needs sm_89/sm_90 (11.8) and C++17 (11.0). Only nvcc 13.0 is tested here and in CI.
set(MEMFIT_MIN_NVCC_VERSION 12.0)

# The compute capabilities of every GPU the driver sees, as CMake arch numbers ("7.5" ->
# 75), deduplicated and sorted; empty when nvidia-smi is missing or fails. Also the CUDA
# version the driver supports ("12.4"; empty when unknown).
function(memfit_query_gpus out_caps out_driver_cuda)
  set(_caps "")
  set(_driver_cuda "")
  find_program(_smi nvidia-smi NO_CACHE)
  if(_smi)
    execute_process(COMMAND ${_smi} --query-gpu=compute_cap --format=csv,noheader
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_QUIET)
    if(_rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _found "${_out}")
      foreach(_cc ${_found})
        string(REPLACE "." "" _num "${_cc}")
        list(APPEND _caps ${_num})
      endforeach()
      list(REMOVE_DUPLICATES _caps)
      list(SORT _caps COMPARE NATURAL)
    endif()
    execute_process(COMMAND ${_smi} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_QUIET)
    if(_rc EQUAL 0 AND _out MATCHES "CUDA Version: *([0-9]+\\.[0-9]+)")
      set(_driver_cuda ${CMAKE_MATCH_1})
    endif()
  endif()
  set(${out_caps} "${_caps}" PARENT_SCOPE)
  set(${out_driver_cuda} "${_driver_cuda}" PARENT_SCOPE)
endfunction()

# The list to build: MEMFIT_CUDA_ARCHS (the CMake define), else the environment variable
# MEMFIT_CUDA_ARCHS, else the GPUs nvidia-smi lists, else MEMFIT_DEFAULT_CUDA_ARCHS.
# `native` means "the GPUs nvidia-smi lists" and is an error when it lists none. Entries
# are CMake's (75, 75-real, 90a, 80-virtual). The newest architecture always carries PTX
# (a plain entry: SASS + PTX) so a GPU newer than the list still runs. Sets out_archs
# and out_source (where the list came from, for the configure log).
function(memfit_resolve_cuda_archs out_archs out_source)
  set(_req "${MEMFIT_CUDA_ARCHS}")
  set(_source "MEMFIT_CUDA_ARCHS (CMake define)")
  if(_req STREQUAL "" AND NOT "$ENV{MEMFIT_CUDA_ARCHS}" STREQUAL "")
    set(_req "$ENV{MEMFIT_CUDA_ARCHS}")
    set(_source "MEMFIT_CUDA_ARCHS (environment)")
  endif()
  string(REPLACE "," ";" _req "${_req}")
  string(REPLACE " " ";" _req "${_req}")
  list(REMOVE_ITEM _req "")

  if(_req STREQUAL "" OR _req STREQUAL "native")
    memfit_query_gpus(_caps _driver_cuda)
    if(_caps)
      set(_req "")
      foreach(_cc ${_caps})
        list(APPEND _req "${_cc}-real")
      endforeach()
      set(_source "the GPUs nvidia-smi lists")
    elseif(_req STREQUAL "native")
      message(FATAL_ERROR
        "memfit: MEMFIT_CUDA_ARCHS=native, but nvidia-smi lists no GPU (or is not installed). "
        "Name the architectures instead, e.g. MEMFIT_CUDA_ARCHS=75 for a T4, 80 for an A100, "
        "86, 89, 90 (`nvidia-smi --query-gpu=compute_cap --format=csv` on the GPU machine), "
        "or leave it unset for ${MEMFIT_DEFAULT_CUDA_ARCHS}.")
    else()
      set(_req "${MEMFIT_DEFAULT_CUDA_ARCHS}")
      set(_source "the default list (nvidia-smi lists no GPU)")
    endif()
  endif()

  # Validate, and find the newest architecture (by number) to give it PTX.
  set(_newest -1)
  set(_has_ptx FALSE)
  foreach(_a ${_req})
    if(NOT _a MATCHES "^([0-9]+)[af]?(-real|-virtual)?$")
      message(FATAL_ERROR
        "memfit: MEMFIT_CUDA_ARCHS entry '${_a}' is not an architecture number: use e.g. "
        "75, 80-real, 90a, separated by ';' or ',' ('native', 'all' and 'all-major' are "
        "not accepted: the list must name what is built)")
    endif()
    if(CMAKE_MATCH_1 GREATER _newest)
      set(_newest ${CMAKE_MATCH_1})
    endif()
    if(NOT _a MATCHES "-real$")
      set(_has_ptx TRUE)
    endif()
  endforeach()
  if(NOT _has_ptx)
    set(_out "")
    foreach(_a ${_req})
      if(_a MATCHES "^${_newest}[af]?-real$")
        string(REGEX REPLACE "-real$" "" _a "${_a}")
      endif()
      list(APPEND _out "${_a}")
    endforeach()
    set(_req "${_out}")
  endif()
  list(REMOVE_DUPLICATES _req)
  set(${out_archs} "${_req}" PARENT_SCOPE)
  set(${out_source} "${_source}" PARENT_SCOPE)
endfunction()

# FATAL_ERROR unless `nvcc` is at least MEMFIT_MIN_NVCC_VERSION and can build every
# architecture in `archs`; a WARNING when the driver of this machine is older than nvcc's
# CUDA major version (the build links nvcc's static runtime, which then cannot run on this
# machine's GPU: CUDA 13 needs driver >= 580, CUDA 12 >= 525). Runs before
# enable_language(CUDA), whose own compiler check fails with a less useful message.
function(memfit_check_nvcc nvcc archs)
  execute_process(COMMAND ${nvcc} --version RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_QUIET)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "release ([0-9]+\\.[0-9]+)")
    message(FATAL_ERROR "memfit: cannot read the version of ${nvcc} (`${nvcc} --version` failed)")
  endif()
  set(_ver ${CMAKE_MATCH_1})
  if(_ver VERSION_LESS MEMFIT_MIN_NVCC_VERSION)
    message(FATAL_ERROR
      "memfit: ${nvcc} is CUDA ${_ver}; memfit needs nvcc >= ${MEMFIT_MIN_NVCC_VERSION} "
      "(the CUDA 12 runtime API). Put a CUDA 12.x or 13.x toolkit first on PATH "
      "(CUDACXX=/usr/local/cuda-12.x/bin/nvcc), or build without CUDA: -C cmake.define.MEMFIT_CUDA=OFF")
  endif()
  execute_process(COMMAND ${nvcc} --list-gpu-code RESULT_VARIABLE _rc OUTPUT_VARIABLE _codes ERROR_QUIET)
  if(_rc EQUAL 0)
    string(REGEX MATCHALL "sm_[0-9]+" _sms "${_codes}")
    string(REPLACE "sm_" "" _nums "${_sms}")
    foreach(_a ${archs})
      string(REGEX MATCH "^[0-9]+" _n "${_a}")
      if(NOT _n IN_LIST _nums)
        string(REPLACE ";" " " _supported "${_nums}")
        message(FATAL_ERROR
          "memfit: nvcc ${_ver} cannot build architecture ${_n} (it builds ${_supported}). "
          "For a GPU newer than this nvcc, use a newer CUDA toolkit or build the newest it "
          "knows with PTX (e.g. MEMFIT_CUDA_ARCHS=90), which the driver compiles for the GPU; "
          "for an older GPU, use an older CUDA toolkit (>= ${MEMFIT_MIN_NVCC_VERSION}).")
      endif()
    endforeach()
  endif()
  set(MEMFIT_NVCC_VERSION ${_ver} PARENT_SCOPE)
  memfit_query_gpus(_caps _driver_cuda)
  if(_driver_cuda)
    string(REGEX MATCH "^[0-9]+" _nvcc_major "${_ver}")
    string(REGEX MATCH "^[0-9]+" _driver_major "${_driver_cuda}")
    if(_nvcc_major GREATER _driver_major)
      message(WARNING
        "memfit: nvcc is CUDA ${_ver} but this machine's NVIDIA driver supports CUDA "
        "${_driver_cuda}: the kernels built will not run here (cudaErrorInsufficientDriver). "
        "Build with a CUDA ${_driver_major}.x nvcc (CUDACXX=/usr/local/cuda-${_driver_major}.x/bin/nvcc) "
        "or update the driver (CUDA 13 needs >= 580).")
    endif()
  endif()
endfunction()

# Script mode, for tests/test_cuda_archs.py: prints the resolved list, or checks an nvcc.
if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(MEMFIT_ARCHS_SCRIPT STREQUAL "resolve")
    memfit_resolve_cuda_archs(_archs _source)
    message(STATUS "archs=${_archs}")
    message(STATUS "source=${_source}")
  elseif(MEMFIT_ARCHS_SCRIPT STREQUAL "check-nvcc")
    memfit_resolve_cuda_archs(_archs _source)
    memfit_check_nvcc("${NVCC}" "${_archs}")
    message(STATUS "nvcc=${MEMFIT_NVCC_VERSION}")
  endif()
endif()
