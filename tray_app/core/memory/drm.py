"""What the Linux kernel's DRM drivers say about GPU memory, for cards NVML can't see.

Two interfaces, both plain text:

- **sysfs**, per card (`/sys/class/drm/cardN/device/`): `uevent` names the driver and the PCI
  slot. amdgpu adds `mem_info_vram_total` and `mem_info_vram_used` (bytes), the whole card's
  numbers. Intel's mainline i915 and xe publish no VRAM total there; some builds do
  (`lmem_total_bytes` from Intel's out-of-tree i915, `tile*/physical_vram_size_bytes` from early
  xe), so those are read where present.
- **fdinfo**, per open DRM file (`/proc/<pid>/fdinfo/<fd>`, Documentation/gpu/drm-usage-stats.rst):
  `drm-driver`, `drm-pdev` (the card's PCI slot), `drm-client-id`, and memory per region as
  `drm-resident-<region>`, `drm-total-<region>` and amdgpu's older `drm-memory-<region>`, each
  `<uint>` with an optional ` KiB`/` MiB`. The VRAM regions are `vram` (amdgpu), `vram0`, `vram1`
  (xe) and `local0`... (i915); an integrated GPU has none. One client can sit behind several fds
  (dup, or one fd passed to another process), so each `drm-client-id` is counted once.

The parsers are pure functions over text; `scan_cards` and `scan_clients` are the only reads.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SYS_ROOT = Path("/sys")
PROC_ROOT = Path("/proc")
# Where distributions keep the PCI ID database (the names lspci prints).
PCI_IDS_PATHS = (Path("/usr/share/misc/pci.ids"), Path("/usr/share/hwdata/pci.ids"), Path("/usr/share/pci.ids"))

VENDOR_NAMES = {0x1002: "AMD", 0x8086: "Intel", 0x10DE: "NVIDIA"}

_CARD_NAME = re.compile(r"card(\d+)")
_MEMORY_KEY = re.compile(r"drm-(resident|memory|total)-(.+)")
# VRAM regions as the drivers name them; "stolen-local0" (firmware-reserved) is left out.
_VRAM_REGION = re.compile(r"vram\d*|local\d+")
_SIZE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB)?")
_UNIT_BYTES = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
# The key to trust first for what a client holds in VRAM now: resident is in VRAM; amdgpu's
# legacy drm-memory- is resident on new kernels and total on old ones; total counts buffers
# that may live elsewhere, so it is the last resort.
_KEY_PREFERENCE = ("resident", "memory", "total")


@dataclass(frozen=True)
class DrmCard:
    name: str  # "card1"
    path: Path  # /sys/class/drm/card1
    driver: str | None  # "amdgpu", "i915", "xe", "nvidia", ...
    pci_slot: str | None  # "0000:03:00.0", the same text as fdinfo's drm-pdev
    vendor_id: int | None
    device_id: int | None

    @property
    def device_dir(self) -> Path:
        return self.path / "device"


@dataclass(frozen=True)
class DrmClient:
    """One open DRM file, as its fdinfo describes it."""

    driver: str
    pdev: str | None
    client_id: str | None
    # None when the driver reports no VRAM region for this client (an integrated GPU, an old
    # kernel, a driver without memory stats); 0 when it reports one and nothing is in it.
    vram_bytes: int | None


@dataclass(frozen=True)
class CardClients:
    vram_bytes_by_pid: Mapping[int, int]
    # Whether any client of the card reported a VRAM figure; without one the per-process
    # list means "unknown", not "nobody".
    reported: bool


# --------------------------------------------------------------------------
# Pure parsers
# --------------------------------------------------------------------------


def parse_key_values(text: str, separator: str) -> dict[str, str]:
    """`key<sep>value` lines (uevent uses "=", fdinfo ":"); the first of a repeated key wins."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(separator)
        if sep and key.strip() and key.strip() not in found:
            found[key.strip()] = value.strip()
    return found


def parse_size(text: str) -> int | None:
    """`<uint>[ KiB|MiB]` as drm-usage-stats prints it (no unit = bytes), in bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        return None
    return int(match.group(1)) * _UNIT_BYTES[match.group(2)]


def parse_int(text: str) -> int | None:
    """A sysfs number: decimal, or hex with 0x (vendor and device ids)."""
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


def parse_fdinfo(text: str) -> DrmClient | None:
    """A DRM client from one fdinfo file; None when it is not a DRM file."""
    fields = parse_key_values(text, ":")
    driver = fields.get("drm-driver")
    if not driver:
        return None
    # region -> {key kind -> bytes}
    regions: dict[str, dict[str, int]] = {}
    for key, value in fields.items():
        match = _MEMORY_KEY.fullmatch(key)
        if match is None or not _VRAM_REGION.fullmatch(match.group(2)):
            continue
        size = parse_size(value)
        if size is not None:
            regions.setdefault(match.group(2), {})[match.group(1)] = size
    vram = None
    if regions:
        vram = sum(next(kinds[kind] for kind in _KEY_PREFERENCE if kind in kinds) for kinds in regions.values())
    return DrmClient(driver=driver, pdev=fields.get("drm-pdev") or None,
                     client_id=fields.get("drm-client-id") or None, vram_bytes=vram)


def card_from_uevent(name: str, path: Path, uevent: str) -> DrmCard:
    fields = parse_key_values(uevent, "=")
    vendor = device = None
    vendor_text, _, device_text = fields.get("PCI_ID", "").partition(":")
    if vendor_text and device_text:
        vendor, device = parse_int("0x" + vendor_text), parse_int("0x" + device_text)
    return DrmCard(name=name, path=path, driver=fields.get("DRIVER") or None,
                   pci_slot=(fields.get("PCI_SLOT_NAME") or "").lower() or None,
                   vendor_id=vendor, device_id=device)


def clients_of_card(clients: Iterable[tuple[int, int, DrmClient]], card: DrmCard,
                    cards_with_driver: int = 1) -> CardClients:
    """Each process's VRAM on `card`, from (pid, fd, client) triples, counting each client once.

    A client is the card's when its drm-pdev is the card's PCI slot; a client without drm-pdev
    (kernels before 6.5 for some drivers) only when no other card has the same driver.
    """
    by_pid: dict[int, int] = {}
    seen: set[tuple[object, ...]] = set()
    reported = False
    for pid, fd, client in sorted(clients, key=lambda entry: (entry[0], entry[1])):
        if client.pdev is not None:
            if client.pdev.lower() != card.pci_slot:
                continue
        elif client.driver != card.driver or cards_with_driver != 1:
            continue
        if client.vram_bytes is None:
            continue
        reported = True
        # Without a client id the fd is all there is to tell clients apart.
        identity: tuple[object, ...] = ("client", client.client_id) if client.client_id else ("fd", pid, fd)
        if identity in seen:
            continue
        seen.add(identity)
        by_pid[pid] = by_pid.get(pid, 0) + client.vram_bytes
    return CardClients(vram_bytes_by_pid=by_pid, reported=reported)


def pci_device_name(pci_ids: str, vendor_id: int, device_id: int) -> str | None:
    """The device's name in a pci.ids database (vendor lines at column 0, devices one tab in)."""
    vendor_prefix = f"{vendor_id:04x} "
    in_vendor = False
    device_prefix = f"\t{device_id:04x} "
    for line in pci_ids.splitlines():
        if not line or line.startswith("#"):
            continue
        if not line.startswith("\t"):
            if in_vendor:
                return None
            in_vendor = line.lower().startswith(vendor_prefix)
        elif in_vendor and line.lower().startswith(device_prefix):
            return line[len(device_prefix):].strip() or None
    return None


def card_label(card: DrmCard, product_name: str | None, pci_ids: str | None) -> str:
    """The best name we have: the board's own product name, the PCI database's, or the ids."""
    if product_name:
        return product_name
    vendor = VENDOR_NAMES.get(card.vendor_id or -1)
    prefix = f"{vendor} " if vendor else ""
    if card.vendor_id is None or card.device_id is None:
        return f"{prefix}GPU ({card.name})"
    known = pci_device_name(pci_ids, card.vendor_id, card.device_id) if pci_ids else None
    if known:
        return f"{prefix}{known}"
    return f"{prefix}GPU [{card.vendor_id:04x}:{card.device_id:04x}]"


# --------------------------------------------------------------------------
# Reading the kernel's files (the only I/O here)
# --------------------------------------------------------------------------


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def read_sysfs_int(path: Path) -> int | None:
    text = read_text(path)
    return None if text is None else parse_int(text)


def scan_cards(sys_root: Path = SYS_ROOT) -> list[DrmCard]:
    """The DRM cards (not their connectors, card0-DP-1), in card order."""
    try:
        entries = list((sys_root / "class" / "drm").iterdir())
    except OSError:
        return []
    cards = []
    for entry in entries:
        match = _CARD_NAME.fullmatch(entry.name)
        if match is None:
            continue
        uevent = read_text(entry / "device" / "uevent") or ""
        cards.append((int(match.group(1)), card_from_uevent(entry.name, entry, uevent)))
    return [card for _, card in sorted(cards, key=lambda pair: pair[0])]


def scan_clients(proc_root: Path = PROC_ROOT) -> list[tuple[int, int, DrmClient]]:
    """Every open DRM file we may look at, as (pid, fd, client).

    Only fds that point into /dev/dri are read: a desktop has thousands of fds, and readlink
    is one call where fdinfo is three. Other users' processes are not readable without root;
    they are left out, which is why a per-process list is never taken as complete.
    """
    found = []
    try:
        pids = [int(entry.name) for entry in os.scandir(proc_root) if entry.name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = [entry.name for entry in os.scandir(fd_dir) if entry.name.isdigit()]
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("/dev/dri/"):
                client = read_client(proc_root, pid, int(fd))
                if client is not None:
                    found.append((pid, int(fd), client))
    return found


def read_client(proc_root: Path, pid: int, fd: int) -> DrmClient | None:
    """One fd's DRM client now; None when the fd is closed or no longer a DRM file."""
    text = read_text(proc_root / str(pid) / "fdinfo" / str(fd))
    return parse_fdinfo(text) if text is not None else None


class ClientScanner:
    """`scan_clients` at a sampler's pace without walking every fd of every process each time.

    A full walk (about 15 ms per thousand fds) runs every `full_scan_every_s`; in between only
    the DRM fds found last time are read again, so what known clients hold stays current and a
    process that opens the GPU is seen within one full-scan interval.
    """

    def __init__(self, proc_root: Path = PROC_ROOT, *, full_scan_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._proc_root = proc_root
        self._full_scan_every_s = full_scan_every_s
        self._clock = clock
        self._known: list[tuple[int, int]] | None = None
        self._scanned_at = 0.0

    def scan(self) -> list[tuple[int, int, DrmClient]]:
        now = self._clock()
        if self._known is None or now - self._scanned_at >= self._full_scan_every_s:
            found = scan_clients(self._proc_root)
            self._known, self._scanned_at = [(pid, fd) for pid, fd, _ in found], now
            return found
        again = [(pid, fd, read_client(self._proc_root, pid, fd)) for pid, fd in self._known]
        return [(pid, fd, client) for pid, fd, client in again if client is not None]


def read_pci_ids(paths: Iterable[Path] = PCI_IDS_PATHS) -> str | None:
    for path in paths:
        text = read_text(path)
        if text is not None:
            return text
    return None


def intel_vram_total_bytes(card: DrmCard) -> int | None:
    """An Intel card's VRAM where a kernel build publishes it; mainline i915 and xe don't."""
    for path in (card.path / "lmem_total_bytes", card.device_dir / "lmem_total_bytes"):
        total = read_sysfs_int(path)
        if total:
            return total
    # xe: one file per tile (a multi-tile card's VRAM is split among its tiles), in the tile's
    # folder or, in later layouts, its memory/ folder. It is the physical size, a little more
    # than the usable one.
    known = []
    for tile in sorted(card.device_dir.glob("tile[0-9]*")):
        sizes = (read_sysfs_int(tile / "physical_vram_size_bytes"),
                 read_sysfs_int(tile / "memory" / "physical_vram_size_bytes"))
        known += [size for size in sizes if size][:1]
    return sum(known) if known else None
