# Which llama.cpp backend this machine can build: sourced by install.sh and
# build-vulkan-server.sh, never run by itself.
#
# Everything it reads from the machine comes through a seam a test can fake:
#   TRAY_APP_SYSFS_ROOT  (default /sys): the DRM cards' PCI vendor ids;
#   PATH: nvidia-smi, nvcc, glslc, pkg-config, apt-get, dpkg-deb, id;
#   CUDA_HOME / CUDA_PATH (default /usr/local/cuda): nvcc off PATH, where
#     NVIDIA's own installer puts it;
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
  local requested="$1" vendors archs nvcc missing headers gpus
  BACKEND="" BACKEND_REASON="" BACKEND_FLAGS="" BACKEND_APT=""
  vendors=$(drm_gpu_vendors)
  archs=$(nvidia_cuda_architectures)
  if [ -n "$archs" ] || nvidia_smi_sees_a_gpu; then vendors=$(printf '%s\nNVIDIA\n' "$vendors" | grep . | sort -u); fi
  gpus=$(echo "$vendors" | paste -sd/ -)
  nvcc=$(find_nvcc || true)
  missing=$(vulkan_tools_missing)

  case "$requested" in
    cpu)
      BACKEND=cpu BACKEND_REASON="asked for (--backend cpu / TRAY_APP_BACKEND=cpu)"; return 0 ;;
    cuda)
      if [ -z "$nvcc" ]; then
        BACKEND_REASON="--backend cuda needs nvcc (the CUDA toolkit): not on PATH nor in \${CUDA_HOME:-/usr/local/cuda}/bin"
        return 2
      fi
      cuda_flags "$archs" "$nvcc"; BACKEND=cuda BACKEND_REASON="asked for; $BACKEND_REASON"; return 0 ;;
    vulkan)
      if vulkan_choice "$missing"; then BACKEND_REASON="asked for; $BACKEND_REASON"; return 0; fi
      BACKEND_REASON="--backend vulkan: $BACKEND_REASON"; return 2 ;;
    auto) ;;
    *) BACKEND_REASON="unknown backend '$requested' (auto, cuda, vulkan or cpu)"; return 2 ;;
  esac

  if [ -n "$nvcc" ] && [[ "$vendors" == *NVIDIA* ]]; then
    cuda_flags "$archs" "$nvcc"; BACKEND=cuda; return 0
  fi
  if [ -z "$vendors" ]; then
    BACKEND=cpu BACKEND_REASON="no NVIDIA, AMD or Intel GPU found (nvidia-smi, ${TRAY_APP_SYSFS_ROOT:-/sys}/class/drm): nothing to enable"
    return 0
  fi
  if vulkan_choice "$missing"; then BACKEND_REASON="$gpus GPU; $BACKEND_REASON"; return 0; fi
  local lacking="no Vulkan build tools ($BACKEND_REASON)"
  [[ "$vendors" == *NVIDIA* ]] && lacking="no nvcc (CUDA toolkit) and $lacking"
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

cuda_flags() {  # ARCHS NVCC
  BACKEND=cuda BACKEND_FLAGS="-DGGML_CUDA=ON"
  if [ -n "$1" ]; then
    BACKEND_FLAGS+=" -DCMAKE_CUDA_ARCHITECTURES=$1"
    BACKEND_REASON="NVIDIA GPU with nvcc ($2): building for this card's architecture only ($1)"
  else
    BACKEND_REASON="nvcc ($2), but nvidia-smi reports no compute capability: building for llama.cpp's default architectures"
  fi
  command -v nvcc >/dev/null 2>&1 || BACKEND_FLAGS+=" -DCMAKE_CUDA_COMPILER=$2"
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
