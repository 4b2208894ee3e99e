"""`packaging/install.sh --plan`: which llama.cpp backend the install builds, and why.

Each test builds a fake machine: a sysfs tree (TRAY_APP_SYSFS_ROOT) whose DRM
cards carry PCI vendor ids, and fake nvidia-smi, nvcc, glslc, pkg-config, id
and apt-get on a PATH that hides the real ones (this machine has an nvcc of
its own, and CI installs the Vulkan tools). The script runs from a copy of
packaging/ in a scratch folder, so a plan that started installing would leave
a .venv there, and the fake apt-get and python3 log any call.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# Tools the fake machine provides or lacks on purpose; everything else on the
# real PATH (coreutils, sed, grep) is linked in as it is.
FAKED = {"nvidia-smi", "nvcc", "glslc", "glslangValidator", "pkg-config", "pkgconf", "x86_64-linux-gnu-pkg-config",
         "id", "apt-get", "dpkg", "dpkg-deb", "dnf", "pacman", "vulkaninfo", "python3", "python"}
NEW_HEADERS = ("#define VK_HEADER_VERSION 309\n"
               "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n"
               "typedef struct VkLayerSettingEXT { int x; } VkLayerSettingEXT;\n")
OLD_HEADERS = ("#define VK_HEADER_VERSION 239\n"
               "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 3, VK_HEADER_VERSION)\n")
VENDORS = {"NVIDIA": "0x10de", "AMD": "0x1002", "Intel": "0x8086", "virtio": "0x1af4"}


@pytest.fixture(scope="session")
def real_tools(tmp_path_factory) -> Path:
    """The real PATH's tools, minus the ones each test fakes."""
    folder = tmp_path_factory.mktemp("real-tools")
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name not in FAKED and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return folder


@dataclass
class Machine:
    root: Path
    real_tools: Path

    def __post_init__(self) -> None:
        self.bin = self.root / "bin"
        self.sysfs = self.root / "sys"
        self.calls = self.root / "calls.log"
        self.repo = self.root / "repo"
        for folder in (self.bin, self.sysfs / "class" / "drm", self.repo):
            folder.mkdir(parents=True)
        shutil.copytree(REPO / "packaging", self.repo / "packaging")
        self.tool("id", 'echo 1000')
        # Any call to these means the plan started installing.
        for name in ("apt-get", "python3"):
            self.tool(name, f'echo "{name} $*" >> {self.calls}; exit 1')

    def tool(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def card(self, vendor: str, index: int = 0) -> None:
        device = self.sysfs / "class" / "drm" / f"card{index}" / "device"
        device.mkdir(parents=True)
        (device / "vendor").write_text(VENDORS[vendor] + "\n")
        # A connector beside the card: no vendor of its own, and never a second card.
        (self.sysfs / "class" / "drm" / f"card{index}-DP-1").mkdir()

    def answering_tool(self, name: str, answers: dict[str, str]) -> None:
        """A fake tool that answers by its arguments (shell case patterns) and fails otherwise."""
        branches = "".join(f"  {pattern}) {action} ;;\n" for pattern, action in answers.items())
        self.tool(name, f'case "$*" in\n{branches}  *) exit 9 ;;\nesac')

    def nvidia_smi(self, *compute_caps: str, driver_cuda: str = "") -> None:
        self.card("NVIDIA")
        caps = "\\n".join(compute_caps)
        gpus = "\\n".join(f"GPU {i}: NVIDIA GeForce RTX 4090 (UUID: GPU-{i})" for i in range(len(compute_caps)))
        answers = {"*compute_cap*": f'printf "{caps}\\n"', "-L": f'printf "{gpus}\\n"'}
        if driver_cuda:  # the banner plain nvidia-smi prints
            answers['""'] = f'echo "| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: {driver_cuda} |"'
        self.answering_tool("nvidia-smi", answers)

    def nvcc(self) -> None:
        """nvcc alone, as in a minimal toolkit (this machine's): no cuBLAS beside it."""
        self.tool("nvcc", 'echo "Cuda compilation tools, release 12.4"')

    def cuda_toolkit(self, folder: str = "cuda", on_path: bool = True) -> Path:
        """A complete toolkit: nvcc, and cuBLAS's header and library."""
        root = self.root / folder
        for relative in ("bin/nvcc", "include/cublas_v2.h", "lib64/libcublas.so.12"):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
        if on_path:
            (self.bin / "nvcc").symlink_to(root / "bin" / "nvcc")
        return root

    def vulkan_tools(self, headers: str = NEW_HEADERS) -> None:
        include = self.root / "include"
        (include / "vulkan").mkdir(parents=True)
        (include / "vulkan" / "vulkan_core.h").write_text(headers)
        self.tool("glslc", "echo shaderc")
        self.answering_tool("pkg-config", {'"--exists vulkan"|"--exists SPIRV-Headers"': "exit 0",
                                           '"--variable=includedir vulkan"': f"echo {include}"})

    def root_user(self) -> None:
        self.tool("id", "echo 0")

    def install(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(self.repo / "packaging" / "install.sh"), *args],
            capture_output=True, text=True, timeout=60, check=False,
            env={"PATH": f"{self.bin}:{self.real_tools}", "HOME": str(self.root / "home"),
                 "TRAY_APP_SYSFS_ROOT": str(self.sysfs), "CUDA_HOME": str(self.root / "no-cuda"), **env})

    def plan(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        result = self.install("--plan", *args, **env)
        assert not self.calls.exists(), f"--plan started installing: {self.calls.read_text()}"
        assert not (self.repo / ".venv").exists()
        return result


def plan_of(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.splitlines())


@pytest.fixture
def machine(tmp_path, real_tools) -> Machine:
    return Machine(tmp_path, real_tools)


# --- CUDA ------------------------------------------------------------------------------


def test_an_nvidia_card_with_a_toolkit_builds_cuda_modules_for_that_card_only(machine):
    machine.nvidia_smi("8.9")
    machine.cuda_toolkit()
    machine.vulkan_tools()  # Vulkan would work too; CUDA is the better build for NVIDIA
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cuda"
    # Machine code for this card only, and ggml's backends as modules.
    assert "-DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DCMAKE_CUDA_ARCHITECTURES=89-real" in plan["cmake flags"]
    assert "89" in plan["reason"] and "the CUDA toolkit of" in plan["reason"] and "wheels" not in plan["reason"]
    assert "on 2 cores" in plan["build time"]


def test_two_nvidia_cards_build_for_both_architectures(machine):
    machine.nvidia_smi("8.9", "8.6", "8.9")
    machine.cuda_toolkit()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cuda"
    assert "-DCMAKE_CUDA_ARCHITECTURES=86-real;89-real" in plan["cmake flags"]


def test_nvcc_outside_path_is_found_in_cuda_home_and_named_to_cmake(machine):
    machine.nvidia_smi("12.0")
    root = machine.cuda_toolkit(on_path=False)
    plan = plan_of(machine.plan(CUDA_HOME=str(root)))
    assert plan["backend"] == "cuda"
    assert f"-DCMAKE_CUDA_COMPILER={root}/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES=120-real" in plan["cmake flags"]


def test_an_nvcc_without_cublas_takes_the_toolkit_from_nvidias_wheels(machine):
    machine.nvidia_smi("8.9")
    machine.nvcc()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cuda"
    assert "from NVIDIA's PyPI wheels" in plan["reason"] and "has no cuBLAS" in plan["reason"]
    assert "CMAKE_CUDA_COMPILER" not in plan["cmake flags"]  # the wheels' nvcc, named once they are fetched


def test_a_driver_without_a_toolkit_gets_cuda_from_the_wheels(machine):
    # Most NVIDIA users: the driver, no CUDA toolkit.
    machine.nvidia_smi("8.6", driver_cuda="13.0")
    machine.vulkan_tools()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cuda"
    assert plan["reason"].startswith("NVIDIA GPU: CUDA 13.0.2 from NVIDIA's PyPI wheels")


def test_a_driver_too_old_for_the_wheels_builds_vulkan_and_says_why(machine):
    machine.nvidia_smi("8.6", driver_cuda="12.4")
    machine.vulkan_tools()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "vulkan"
    assert "the driver runs CUDA 12.4, and the CUDA build needs 13.0 or newer (driver 580+)" in plan["reason"]


@pytest.mark.parametrize("arch", ["90", "9.0"])
def test_cuda_can_be_asked_for_an_architecture_with_no_card_or_toolkit_here(machine, arch):
    plan = plan_of(machine.plan("--backend", "cuda", "--cuda-arch", arch))
    assert plan["backend"] == "cuda"
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in plan["cmake flags"]
    assert plan["reason"].startswith("asked for; CUDA 13.0.2 from NVIDIA's PyPI wheels")
    assert "(90; --cuda-arch)" in plan["reason"]


# --- Vulkan ----------------------------------------------------------------------------


def test_an_nvidia_card_without_nvcc_or_a_known_driver_builds_vulkan(machine):
    machine.nvidia_smi("8.9")
    machine.vulkan_tools()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "vulkan"
    assert "-DGGML_VULKAN=ON" in plan["cmake flags"] and "CUDA" not in plan["cmake flags"]
    assert plan["reason"].startswith("NVIDIA GPU")


@pytest.mark.parametrize("vendor", ["AMD", "Intel"])
def test_an_amd_or_intel_card_builds_vulkan(machine, vendor):
    machine.card(vendor)
    machine.nvcc()  # a CUDA toolkit without an NVIDIA card does not make a CUDA build
    machine.vulkan_tools()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "vulkan"
    assert "-DGGML_VULKAN=ON" in plan["cmake flags"]
    assert plan["reason"] == f"{vendor} GPU; the Vulkan build tools are installed; the system's Vulkan headers 1.4.309"


def test_as_root_on_debian_the_missing_vulkan_tools_are_installed(machine):
    machine.card("AMD")
    machine.root_user()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "vulkan"
    assert plan["apt packages (as root)"].split() == [
        "libvulkan-dev", "glslc", "spirv-headers", "pkg-config", "mesa-vulkan-drivers"]
    assert "missing glslc" in plan["reason"]


def test_vulkan_headers_too_old_for_llama_cpp_are_replaced_by_debian_13s(machine):
    machine.card("AMD")
    machine.vulkan_tools(headers=OLD_HEADERS)
    machine.tool("dpkg-deb", "exit 0")
    plan = plan_of(machine.plan())
    assert plan["backend"] == "vulkan"
    assert "Debian 13's Vulkan headers" in plan["reason"] and "1.3.239 are too old" in plan["reason"]


# --- CPU -------------------------------------------------------------------------------


def test_no_gpu_builds_for_the_cpu(machine):
    machine.card("virtio")  # a virtual display is no GPU to compute on
    machine.nvcc()
    machine.vulkan_tools()
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cpu"
    assert "no NVIDIA, AMD or Intel GPU found" in plan["reason"]
    assert "GGML_VULKAN" not in plan["cmake flags"] and "GGML_CUDA" not in plan["cmake flags"]


def test_a_gpu_without_build_tools_builds_for_the_cpu_and_says_how_to_enable_it(machine):
    machine.card("Intel")
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cpu"
    reason = plan["reason"]
    assert reason.startswith("Intel GPU found but no Vulkan build tools (missing: glslc pkg-config)")
    assert reason.endswith("to use it: sudo apt-get install -y libvulkan-dev glslc spirv-headers pkg-config "
                           "mesa-vulkan-drivers && bash packaging/install.sh")


def test_an_nvidia_card_without_any_toolchain_names_both_missing(machine):
    machine.nvidia_smi("7.5")
    plan = plan_of(machine.plan())
    assert plan["backend"] == "cpu"
    assert plan["reason"].startswith("NVIDIA GPU found but no nvcc (CUDA toolkit), and no Vulkan build tools")
    assert "apt-get install" in plan["reason"]


# --- overrides ---------------------------------------------------------------------------


@pytest.fixture
def cuda_machine(machine) -> Machine:
    machine.nvidia_smi("8.9")
    machine.cuda_toolkit()
    machine.vulkan_tools()
    return machine


def test_the_environment_variable_overrides_the_choice(cuda_machine):
    assert plan_of(cuda_machine.plan(TRAY_APP_BACKEND="cpu"))["backend"] == "cpu"
    assert plan_of(cuda_machine.plan(TRAY_APP_BACKEND="vulkan"))["backend"] == "vulkan"


def test_the_option_overrides_the_environment_variable(cuda_machine):
    assert plan_of(cuda_machine.plan("--backend", "vulkan", TRAY_APP_BACKEND="cpu"))["backend"] == "vulkan"
    assert plan_of(cuda_machine.plan("--backend=auto", TRAY_APP_BACKEND="cpu"))["backend"] == "cuda"


def test_a_backend_named_in_llama_cmake_args_is_kept(machine):
    plan = plan_of(machine.plan(LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"))
    assert plan["backend"] == "cuda" and plan["cmake flags"] == "-DGGML_CUDA=on"


def test_a_backend_that_cannot_be_built_is_refused(machine):
    result = machine.plan("--backend", "vulkan")
    assert result.returncode == 2 and "--backend vulkan: missing: glslc" in result.stderr
    result = machine.plan("--backend", "metal")
    assert result.returncode == 2 and "unknown backend 'metal'" in result.stderr


def test_the_install_as_root_goes_on_past_the_system_packages(machine):
    # The README's plain install, as root on Debian with nothing to add: it
    # must reach the venv (the fake python3 stops it there), not end silently.
    machine.root_user()
    machine.tool("dpkg", "exit 0")  # every package is installed already
    result = machine.install()
    assert machine.calls.read_text() == "python3 -m venv .venv\n", result.stdout + result.stderr


# --- the wheelhouse key and the device line ----------------------------------------------


def backend_sh(command: str, **env: str) -> str:
    return subprocess.run(["bash", "-c", f"source packaging/backend.sh; {command}"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env}).stdout


def test_the_cpu_build_keeps_its_wheelhouse_key_and_a_gpu_build_gets_its_own():
    # The key a CPU build had before backends were chosen: the wheelhouses on
    # disk stay valid, and nobody rebuilds for this change.
    before = hashlib.sha256(b"0.3.36 -DFLAGS -DSERVER").hexdigest()[:12]
    assert backend_sh('wheelhouse_key 0.3.36 -DFLAGS -DSERVER cpu ""').strip() == before
    cuda = backend_sh('wheelhouse_key 0.3.36 -DFLAGS -DSERVER cuda -DGGML_CUDA=ON').strip()
    vulkan = backend_sh('wheelhouse_key 0.3.36 -DFLAGS -DSERVER vulkan -DGGML_VULKAN=ON').strip()
    assert len({before, cuda, vulkan}) == 3


@pytest.mark.parametrize(("listed", "seen"), [
    ("Available devices:\n  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n",
     "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)"),
    ("Available devices:\n  CUDA0: NVIDIA A (100 MiB, 90 MiB free)\n  CUDA1: NVIDIA B (200 MiB, 10 MiB free)\n",
     "CUDA0: NVIDIA A (100 MiB, 90 MiB free); CUDA1: NVIDIA B (200 MiB, 10 MiB free)"),
    ("load_backend: loaded CPU backend\nAvailable devices:\n  (none)\n", "none"),
], ids=["lavapipe", "two-cuda-cards", "cpu-only-build"])
def test_the_last_line_names_the_devices_llama_server_lists(tmp_path, listed, seen):
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\n[ \"$1\" = --list-devices ] && printf '%s' '{listed}'\n")
    server.chmod(0o755)
    assert backend_sh(f"llama_server_devices {server}").strip() == seen


def test_a_llama_server_that_cannot_start_is_not_reported_as_seeing_no_device(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'error while loading shared libraries: libllama.so' >&2\nexit 127\n")
    server.chmod(0o755)
    assert backend_sh(f"llama_server_devices {server}").strip() == (
        "unknown (llama-server --list-devices failed: error while loading shared libraries: libllama.so)")


# --- the CUDA toolkit from NVIDIA's wheels ------------------------------------------------


def test_the_cuda_wheels_are_unpacked_into_the_cache_with_the_names_cmake_looks_for(tmp_path):
    # A fake python that "installs" what pip would: the wheels' files under --target.
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "$*" > "$HOME/pip-args"\nwhile [ "$1" != --target ]; do shift; done\n'
                      'lib="$2/nvidia/cu13/lib"; mkdir -p "$lib" "$2/nvidia/cu13/bin"\n'
                      'for n in cublas cublasLt cudart; do touch "$lib/lib$n.so.13"; done\n'
                      'touch "$2/nvidia/cu13/bin/nvcc"; chmod +x "$2/nvidia/cu13/bin/nvcc"\n')
    python.chmod(0o755)
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    root = backend_sh(f"fetch_cuda_wheels {python}", **env).strip()
    assert root == f"{tmp_path}/cache/tray-app/cuda-toolkit/13.0.2/nvidia/cu13"
    assert os.readlink(f"{root}/lib/libcublas.so") == "libcublas.so.13"
    assert os.path.isdir(f"{root}/lib64") and not os.path.exists(f"{root}.partial")
    args = (tmp_path / "pip-args").read_text()
    assert "nvidia-cublas==13.0.2.14" in args and "nvidia-cuda-nvcc==13.0.88" in args and "--no-deps" in args
    # Cached: a second call asks pip for nothing.
    (tmp_path / "pip-args").unlink()
    assert backend_sh(f"fetch_cuda_wheels {python}", **env).strip() == root
    assert not (tmp_path / "pip-args").exists()


def test_a_failed_wheel_fetch_says_why_and_leaves_nothing_half_made(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for nvidia-cublas' >&2\nexit 1\n")
    python.chmod(0o755)
    cache = tmp_path / "cache"
    result = subprocess.run(["bash", "-c", f"source packaging/backend.sh; fetch_cuda_wheels {python}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert result.returncode == 1 and "No matching distribution found for nvidia-cublas" in result.stderr
    assert not list((cache / "tray-app" / "cuda-toolkit").glob("*/nvidia"))


def test_the_cuda_module_links_a_stub_driver_when_there_is_one_and_goes_without_otherwise(tmp_path):
    (tmp_path / "lib64" / "stubs").mkdir(parents=True)
    assert backend_sh(f"libcuda_for_linking {tmp_path}", PATH=f"{tmp_path}/no-ldconfig:/usr/bin:/bin").strip() == ""
    (tmp_path / "lib64" / "stubs" / "libcuda.so").write_text("")
    assert backend_sh(f"libcuda_for_linking {tmp_path}").strip() == f"{tmp_path}/lib64/stubs/libcuda.so"
