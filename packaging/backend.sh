# Which llama.cpp backend this machine can build: sourced by install.sh and
# build-vulkan-server.sh, never run by itself.
#
# Everything it reads from the machine comes through a seam a test can fake:
#   TRAY_APP_SYSFS_ROOT  (default /sys): the DRM cards' PCI vendor ids;
#   PATH: nvidia-smi, nvcc, glslc, pkg-config, apt-get, dpkg-deb, id;
#   CUDA_HOME / CUDA_PATH (default /usr/local/cuda): nvcc off PATH, where
#     NVIDIA's own installer puts it;
#   CUDA_ARCHS: the architectures --cuda-arch names (else nvidia-smi's);
#   TRAY_APP_VULKAN_INCLUDE_DIR: Vulkan headers the user brings (an SDK).
# tests/unit/packaging/test_install_plan.py drives it through `install.sh --plan`.

VULKAN_APT_PACKAGES="libvulkan-dev glslc spirv-headers pkg-config mesa-vulkan-drivers"
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which the
# vendored ggml-vulkan.cpp uses (vk::LayerSettingEXT); Debian 13's (1.4.309)
# have it. This one struct is the test of "new enough".
VULKAN_NEEDED_SYMBOL="VkLayerSettingEXT"
TRAY_APP_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tray-app"

# The kernel's GPUs as vendor names, one per line, from the DRM cards' PCI
# vendor ids. card0-DP-1 and the like are connectors, not cards.
drm_gpu_vendors() {
  local card vendor
  for card in "${TRAY_APP_SYSFS_ROOT:-/sys}"/class/drm/card*; do
    [[ "${card##*/}" =~ ^card[0-9]+$ ]] || continue
    vendor=$(cat "$card/device/vendor" 2>/dev/null) || continue
    case "$vendor" in
      0x10de) echo NVIDIA ;;
      0x1002) echo AMD ;;
      0x8086) echo Intel ;;
    esac
  done | sort -u
}

# The NVIDIA cards' compute capabilities as CMake architectures (8.9 -> 89),
# ';'-joined; empty when nvidia-smi is missing, finds no card, or is too old
# for --query-gpu=compute_cap.
nvidia_cuda_architectures() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | tr -d ' \r' | grep -E '^[0-9]+\.[0-9]+$' | tr -d . | sort -un | paste -sd';' - || true
}

nvidia_smi_sees_a_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

find_nvcc() {
  local candidate
  candidate=$(command -v nvcc 2>/dev/null) && { echo "$candidate"; return 0; }
  candidate="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}/bin/nvcc"
  [ -x "$candidate" ] && echo "$candidate"
}

# CUDA 13.0 update 2 as NVIDIA publishes it on PyPI: nvcc and what it runs,
# the runtime, CCCL and cuBLAS (llama.cpp's CUDA backend links it), pinned
# together, for a machine whose toolkit is missing or lacks cuBLAS. It needs
# an NVIDIA driver of the 580 series or newer (nvidia-smi: "CUDA Version:
# 13.0" or higher). Unpacked into the cache (about 840 MB), never system-wide.
CUDA_WHEELS_VERSION=13.0.2
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14"
CUDA_WHEELS_DRIVER_MAJOR=13
# llama-cpp-python, llama-server and ggml's CUDA module for one architecture,
# measured on 2 cores: 2,169 s from nothing built (the toolkit's wheels
# already downloaded: they add under a minute at 50 MB/s), 4.6 s cached.
# More cores divide it; every architecture more adds most of it again.
CUDA_BUILD_TIME="about 36 minutes on 2 cores for one architecture, once; seconds when cached"

cuda_wheels_root() { echo "$TRAY_APP_CACHE/cuda-toolkit/$CUDA_WHEELS_VERSION/nvidia/cu13"; }

# The toolkit folder nvcc ($1) belongs to: .../bin/nvcc -> ...
cuda_toolkit_root() {
  local real
  real=$(readlink -f "$1" 2>/dev/null) || real=$1
  dirname "$(dirname "$real")"
}

# Whether the toolkit at $1 has cuBLAS, headers and library (a minimal
# toolkit, nvcc and the runtime only, has neither).
cuda_toolkit_has_cublas() {
  { compgen -G "$1/include/cublas_v2.h" || compgen -G "$1/targets/*/include/cublas_v2.h"; } >/dev/null \
    && { compgen -G "$1/lib*/libcublas.so*" || compgen -G "$1/targets/*/lib/libcublas.so*"; } >/dev/null
}

# The folder of the toolkit at $1 that holds cuBLAS, for the CUDA module's
# run-time search path.
cuda_library_dir() {
  local found
  found=$({ compgen -G "$1/lib*/libcublas.so*" || compgen -G "$1/targets/*/lib/libcublas.so*"; } | head -n1)
  [ -z "$found" ] || dirname "$found"
}

# The CUDA version the driver runs, from nvidia-smi's banner ("CUDA Version:
# 13.0"); empty when there is no driver to ask.
nvidia_driver_cuda_version() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1
}

driver_runs_cuda_wheels() {  # DRIVER_CUDA_VERSION
  [ -n "$1" ] && [ "${1%%.*}" -ge "$CUDA_WHEELS_DRIVER_MAJOR" ] 2>/dev/null
}

# Unpacks CUDA_WHEELS into the cache with PYTHON ($1) and prints the
# toolkit's root. pip installs files, not links: the unversioned library
# names that CMake's FindCUDAToolkit looks for are added here.
fetch_cuda_wheels() {
  local python=$1 dest root status=0
  root=$(cuda_wheels_root)
  dest=${root%/nvidia/cu13}
  if [ -x "$root/bin/nvcc" ] && [ -e "$root/lib/libcublas.so" ]; then echo "$root"; return 0; fi
  mkdir -p "$TRAY_APP_CACHE"
  rm -rf "$dest.partial"
  # shellcheck disable=SC2086 # CUDA_WHEELS is a list
  if "$python" -m pip install -q --no-deps --disable-pip-version-check --target "$dest.partial" $CUDA_WHEELS \
       >"$TRAY_APP_CACHE/cuda-wheels.log" 2>&1; then
    local lib=$dest.partial/nvidia/cu13/lib name
    for name in cublas cublasLt cudart; do ln -sf "lib$name.so.13" "$lib/lib$name.so"; done
    ln -sfn lib "$dest.partial/nvidia/cu13/lib64"
    rm -rf "$dest" && mv "$dest.partial" "$dest"
    echo "$root"
  else
    echo "pip could not install NVIDIA's CUDA wheels ($TRAY_APP_CACHE/cuda-wheels.log: $(tail -n 2 "$TRAY_APP_CACHE/cuda-wheels.log" | tr '\n' ' '))" >&2
    status=1
  fi
  rm -rf "$dest.partial"
  return $status
}

# The driver library to link ggml's CUDA module against, for its virtual
# memory pool: the driver's own libcuda.so.1, or a toolkit's stub. Empty when
# neither is here (a machine without the driver); the build then does
# without that pool (GGML_CUDA_NO_VMM), which the driver is not needed for.
libcuda_for_linking() {  # TOOLKIT_ROOT
  local found
  found=$(compgen -G "$1/lib64/stubs/libcuda.so" || compgen -G "$1/targets/*/lib/stubs/libcuda.so" || true)
  [ -n "$found" ] || found=$(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF; exit}')
  echo "$found" | head -n1
}

running_as_root() { [ "$(id -u)" = 0 ]; }
can_apt_install() { running_as_root && command -v apt-get >/dev/null 2>&1; }
# apt-get download and dpkg-deb -x need no root: they only fetch and unpack.
can_fetch_debian_headers() { command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; }

# The Vulkan build tools that are missing, space-separated (empty: all there).
vulkan_tools_missing() {
  local missing=()
  command -v glslc >/dev/null 2>&1 || missing+=(glslc)
  if ! command -v pkg-config >/dev/null 2>&1; then
    missing+=(pkg-config)
  else
    pkg-config --exists vulkan 2>/dev/null || missing+=("Vulkan headers and loader (libvulkan-dev)")
    pkg-config --exists SPIRV-Headers 2>/dev/null || missing+=(SPIRV-Headers)
  fi
  echo "${missing[*]}"
}

vulkan_header_version() {  # of the headers under include dir $1
  sed -n 's/^#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, \([0-9]*\), \([0-9]*\), VK_HEADER_VERSION)/\1.\2/p' \
    "$1/vulkan/vulkan_core.h" 2>/dev/null | head -n1 | tr -d '\n'
  sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\)$/.\1/p' "$1/vulkan/vulkan_core.h" 2>/dev/null | head -n1
}

vulkan_headers_new_enough() { grep -q "$VULKAN_NEEDED_SYMBOL" "$1/vulkan/vulkan_core.h" 2>/dev/null; }

system_vulkan_include_dir() { pkg-config --variable=includedir vulkan 2>/dev/null; }

# Debian 13's libvulkan-dev headers, fetched once into the cache: a private
# apt source list, `apt-get download`, `dpkg-deb -x`. Nothing is installed
# system-wide; the build gets -DVulkan_INCLUDE_DIR. Prints the include dir.
fetch_debian13_vulkan_headers() {
  local dest="$TRAY_APP_CACHE/vulkan-headers/debian13" work status=0
  if [ -f "$dest/usr/include/vulkan/vulkan_core.h" ]; then echo "$dest/usr/include"; return 0; fi
  work=$(mktemp -d)
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    > "$work/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
  if apt-get "${opts[@]}" update -qq >"$work/apt.log" 2>&1 \
     && (cd "$work" && apt-get "${opts[@]}" download libvulkan-dev >>"$work/apt.log" 2>&1) \
     && rm -rf "$dest.partial" && mkdir -p "$dest.partial" && dpkg-deb -x "$work"/libvulkan-dev_*.deb "$dest.partial" \
     && [ -f "$dest.partial/usr/include/vulkan/vulkan_core.h" ]; then
    rm -rf "$dest" && mv "$dest.partial" "$dest"
    echo "$dest/usr/include"
  else
    echo "fetching Debian 13's libvulkan-dev failed: $(tail -n 3 "$work/apt.log" | tr '\n' ' ')" >&2
    status=1
  fi
  rm -rf "$work" "$dest.partial"
  return $status
}

# The include dir the Vulkan build uses: the user's, the system's when new
# enough, else Debian 13's (fetched). On failure says why on stderr.
resolve_vulkan_include_dir() {
  local dir
  if [ -n "${TRAY_APP_VULKAN_INCLUDE_DIR:-}" ]; then
    vulkan_headers_new_enough "$TRAY_APP_VULKAN_INCLUDE_DIR" && { echo "$TRAY_APP_VULKAN_INCLUDE_DIR"; return 0; }
    echo "TRAY_APP_VULKAN_INCLUDE_DIR=$TRAY_APP_VULKAN_INCLUDE_DIR has no vulkan/vulkan_core.h with $VULKAN_NEEDED_SYMBOL" >&2
    return 1
  fi
  dir=$(system_vulkan_include_dir)
  if [ -n "$dir" ] && vulkan_headers_new_enough "$dir"; then echo "$dir"; return 0; fi
  if can_fetch_debian_headers; then fetch_debian13_vulkan_headers; return; fi
  echo "the Vulkan headers ($(vulkan_header_version "$dir")) are too old for llama.cpp (no $VULKAN_NEEDED_SYMBOL); set TRAY_APP_VULKAN_INCLUDE_DIR to newer ones (Vulkan SDK 1.3.261 or later)" >&2
  return 1
}

# How the Vulkan headers will be had, for the plan; fails when they can't.
vulkan_headers_plan() {
  local dir
  if [ -n "${TRAY_APP_VULKAN_INCLUDE_DIR:-}" ]; then
    vulkan_headers_new_enough "$TRAY_APP_VULKAN_INCLUDE_DIR" || return 1
    echo "the headers in TRAY_APP_VULKAN_INCLUDE_DIR"; return 0
  fi
  dir=$(system_vulkan_include_dir)
  if [ -z "$dir" ] || [ ! -f "$dir/vulkan/vulkan_core.h" ]; then
    echo "the headers installed with libvulkan-dev (Debian 13's fetched if they are too old)"; return 0
  fi
  if vulkan_headers_new_enough "$dir"; then echo "the system's Vulkan headers $(vulkan_header_version "$dir")"; return 0; fi
  can_fetch_debian_headers || return 1
  echo "Debian 13's Vulkan headers, fetched into $TRAY_APP_CACHE (the system's $(vulkan_header_version "$dir") are too old)"
}

# The command that installs the Vulkan build tools here, for the CPU hint.
vulkan_install_command() {
  local sudo=""
  running_as_root || sudo="sudo "
  if command -v apt-get >/dev/null 2>&1; then echo "${sudo}apt-get install -y $VULKAN_APT_PACKAGES"
  elif command -v dnf >/dev/null 2>&1; then echo "${sudo}dnf install -y vulkan-headers vulkan-loader-devel glslc spirv-headers-devel"
  elif command -v pacman >/dev/null 2>&1; then echo "${sudo}pacman -S --needed vulkan-headers vulkan-icd-loader shaderc spirv-headers"
  else echo "install the Vulkan SDK (headers, loader, glslc, SPIRV-Headers)"
  fi
}

# choose_backend REQUESTED (auto|cuda|vulkan|cpu) sets:
#   BACKEND         cuda, vulkan or cpu
#   BACKEND_REASON  one line: why, and for cpu on a GPU machine the command that enables it
#   BACKEND_FLAGS   the CMake flags it adds (empty for cpu)
#   BACKEND_APT     Debian packages to install first (root only)
# Returns 2 when an explicit request can't be met (BACKEND_REASON says why).
choose_backend() {
  local requested="$1" vendors archs nvcc missing headers gpus driver
  BACKEND="" BACKEND_REASON="" BACKEND_FLAGS="" BACKEND_APT=""
  vendors=$(drm_gpu_vendors)
  archs=${CUDA_ARCHS:-$(nvidia_cuda_architectures)}
  if [ -n "$archs" ] || nvidia_smi_sees_a_gpu; then vendors=$(printf '%s\nNVIDIA\n' "$vendors" | grep . | sort -u); fi
  gpus=$(echo "$vendors" | paste -sd/ -)
  nvcc=$(find_nvcc || true)
  driver=$(nvidia_driver_cuda_version)
  missing=$(vulkan_tools_missing)

  case "$requested" in
    cpu)
      BACKEND=cpu BACKEND_REASON="asked for (--backend cpu / TRAY_APP_BACKEND=cpu)"; return 0 ;;
    cuda)
      cuda_flags "$archs" "$nvcc"; BACKEND_REASON="asked for; $BACKEND_REASON"; return 0 ;;
    vulkan)
      if vulkan_choice "$missing"; then BACKEND_REASON="asked for; $BACKEND_REASON"; return 0; fi
      BACKEND_REASON="--backend vulkan: $BACKEND_REASON"; return 2 ;;
    auto) ;;
    *) BACKEND_REASON="unknown backend '$requested' (auto, cuda, vulkan or cpu)"; return 2 ;;
  esac

  if [[ "$vendors" == *NVIDIA* ]] && { [ -n "$nvcc" ] || driver_runs_cuda_wheels "$driver"; }; then
    cuda_flags "$archs" "$nvcc"; return 0
  fi
  if [ -z "$vendors" ]; then
    BACKEND=cpu BACKEND_REASON="no NVIDIA, AMD or Intel GPU found (nvidia-smi, ${TRAY_APP_SYSFS_ROOT:-/sys}/class/drm): nothing to enable"
    return 0
  fi
  local old_driver=""
  [ -z "$driver" ] || [[ "$vendors" != *NVIDIA* ]] \
    || old_driver="; the driver runs CUDA $driver, and the CUDA build needs $CUDA_WHEELS_DRIVER_MAJOR.0 or newer (driver 580+)"
  if vulkan_choice "$missing"; then BACKEND_REASON="$gpus GPU$old_driver; $BACKEND_REASON"; return 0; fi
  local lacking="no Vulkan build tools ($BACKEND_REASON)"
  [[ "$vendors" == *NVIDIA* ]] && lacking="no nvcc (CUDA toolkit)$old_driver, and $lacking"
  BACKEND=cpu BACKEND_FLAGS="" BACKEND_APT=""
  BACKEND_REASON="$gpus GPU found but $lacking; to use it: $VULKAN_FIX"
  return 0
}

# The wheelhouse key. The CPU build hashes exactly what it hashed before
# backends were chosen, so wheelhouses already built stay valid; a GPU build
# adds its backend and flags.
wheelhouse_key() {  # VERSION CMAKE_ARGS SERVER_FLAGS BACKEND BACKEND_FLAGS
  local input
  input=$(printf '%s %s %s' "$1" "$2" "$3")
  [ -z "$5" ] || input+=" backend=$4 $5"
  printf '%s' "$input" | sha256sum | cut -c1-12
}

# Sets BACKEND=cuda, its flags and reason, and CUDA_TOOLKIT: "system" (the
# toolkit of NVCC, complete) or "wheels" (CUDA_WHEELS, fetched at install).
# ggml's backends are built as modules (GGML_BACKEND_DL): llama-server loads
# the CUDA one at start, and a missing or mismatched driver removes that
# device, not the server, which then serves on the CPU module.
cuda_flags() {  # ARCHS NVCC
  local archs="" arch toolkit
  for arch in ${1//;/ }; do archs+="${archs:+;}$arch-real"; done  # machine code only: no PTX to JIT
  BACKEND=cuda BACKEND_FLAGS="-DGGML_CUDA=ON -DGGML_BACKEND_DL=ON"
  if [ -n "$2" ] && cuda_toolkit_has_cublas "$(cuda_toolkit_root "$2")"; then
    CUDA_TOOLKIT=system toolkit="the CUDA toolkit of $2"
    command -v nvcc >/dev/null 2>&1 || BACKEND_FLAGS+=" -DCMAKE_CUDA_COMPILER=$2"
  else
    CUDA_TOOLKIT=wheels
    toolkit="CUDA $CUDA_WHEELS_VERSION from NVIDIA's PyPI wheels into $TRAY_APP_CACHE/cuda-toolkit"
    [ -z "$2" ] || toolkit+=" (the toolkit of $2 has no cuBLAS)"
  fi
  if [ -n "${CUDA_ARCHS:-}" ]; then
    BACKEND_FLAGS+=" -DCMAKE_CUDA_ARCHITECTURES=$archs"
    BACKEND_REASON="$toolkit; building for the architecture asked for (${1//;/, }; --cuda-arch)"
  elif [ -n "$archs" ]; then
    BACKEND_FLAGS+=" -DCMAKE_CUDA_ARCHITECTURES=$archs"
    BACKEND_REASON="NVIDIA GPU: $toolkit; building for this card's architecture only (${1//;/, })"
  else
    BACKEND_REASON="$toolkit; nvidia-smi reports no compute capability: building for llama.cpp's default architectures (--cuda-arch names one)"
  fi
}

# Vulkan if its tools are there or can be installed; else fails with the
# missing parts in BACKEND_REASON.
vulkan_choice() {  # MISSING
  local headers
  if [ -z "$1" ]; then
    if headers=$(vulkan_headers_plan); then
      BACKEND=vulkan BACKEND_FLAGS="-DGGML_VULKAN=ON"
      BACKEND_REASON="the Vulkan build tools are installed; $headers"
      # mesa-vulkan-drivers is AMD's and Intel's Vulkan driver; dpkg skips what is there.
      can_apt_install && BACKEND_APT="$VULKAN_APT_PACKAGES"
      return 0
    fi
    local dir; dir=$(system_vulkan_include_dir)
    BACKEND_REASON="the Vulkan headers $(vulkan_header_version "$dir") are too old (no $VULKAN_NEEDED_SYMBOL) and apt-get can't fetch newer ones"
    VULKAN_FIX="TRAY_APP_VULKAN_INCLUDE_DIR=<the include folder of Vulkan SDK 1.3.261 or later> bash packaging/install.sh"
    return 1
  fi
  if can_apt_install; then
    BACKEND=vulkan BACKEND_FLAGS="-DGGML_VULKAN=ON" BACKEND_APT="$VULKAN_APT_PACKAGES"
    BACKEND_REASON="missing $1: installing $VULKAN_APT_PACKAGES"
    return 0
  fi
  BACKEND_REASON="missing: $1"
  VULKAN_FIX="$(vulkan_install_command) && bash packaging/install.sh"
  return 1
}

# The devices llama-server ($1) offloads to, as it lists them, '; '-joined
# ("CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23400 MiB free)"); "none"
# when it lists none, which is every CPU-only build.
llama_server_devices() {
  local output listed
  [ -x "${1:-}" ] || { echo "unknown (no llama-server to ask)"; return 0; }
  if ! output=$(timeout 60 "$1" --list-devices 2>&1); then
    echo "unknown (llama-server --list-devices failed: $(tail -n 1 <<<"$output"))"
    return 0
  fi
  listed=$(sed -n 's/^  \([^ (].*\)$/\1/p' <<<"$output" | paste -sd';' - | sed 's/;/; /g')
  echo "${listed:-none}"
}
