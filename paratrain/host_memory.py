"""How CPU ranks allocate host memory: tcmalloc when it is found, else glibc with a fixed mmap threshold
(why: README, Devices and speed, "Host memory on the CPU"; measured in ``bench/peers.py``).

tcmalloc must be loaded before the process starts: ``paratrain launch`` puts it in CPU ranks' ``LD_PRELOAD``
(:func:`rank_env`) and ``paratrain train`` run by hand restarts itself with it once (:func:`restart_with_allocator`).
This module imports no torch: the launcher and the command line use it before torch loads.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from paratrain.errors import UserError

CHOICE_ENV = "PARATRAIN_HOST_ALLOCATOR"
RESTARTED_ENV = "PARATRAIN_HOST_ALLOCATOR_RESTARTED"  # set on the restart, so it happens once
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SEARCH = (Path(sys.prefix) / "lib", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"),
          Path("/usr/lib64"), Path("/usr/lib"), Path("/usr/local/lib"))
# unused spans go back to the system sooner (default 1); the threads' caches of small blocks hold 4 MiB in
# all, not 32: a rank's few threads allocate little that is small (bench/peers.py: 50-70 MB less at the peak)
TCMALLOC_SETTINGS = {"TCMALLOC_RELEASE_RATE": "10", "TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES": str(4 << 20)}
MMAP_THRESHOLD = 4 << 20  # bytes; see fix_mmap_threshold
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _choice(environ: dict) -> str:
    return environ.get(CHOICE_ENV, "auto").strip() or "auto"


def allocator_library(environ: dict | None = None) -> Path | None:
    """The library CPU ranks preload as ``PARATRAIN_HOST_ALLOCATOR`` says: tcmalloc's path when found
    (``auto``), None for ``system`` or when none is found; an explicit path that is not a file is refused."""
    choice = _choice(os.environ if environ is None else environ)
    if choice == "system":
        return None
    if choice != "auto":
        if not Path(choice).is_file():
            raise UserError(f"{CHOICE_ENV}={choice}: no such file; give the path of an allocator library "
                            "(e.g. libtcmalloc_minimal.so.4), or auto, or system")
        return Path(choice)
    return next((folder / name for folder in SEARCH for name in LIBRARIES if (folder / name).is_file()), None)


def rank_env(environ: dict | None = None) -> dict[str, str]:
    """Variables to add to a CPU rank's environment so that it runs with the chosen allocator: ``LD_PRELOAD``
    (the library first, what was there kept) and tcmalloc's settings unless already set; {} for glibc."""
    environ = os.environ if environ is None else environ
    library = allocator_library(environ)
    if library is None:
        return {}
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    added = {"LD_PRELOAD": ":".join([str(library), *(p for p in preload if p != str(library))])}
    if "tcmalloc" in library.name:
        added.update({k: v for k, v in TCMALLOC_SETTINGS.items() if k not in environ})
    return added


def loaded_allocator() -> str | None:
    """The file name of the preloaded allocator library mapped into this process (tcmalloc, jemalloc or
    mimalloc), or None when the C library's malloc serves it."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if "/" in line and name.startswith(("libtcmalloc", "libjemalloc", "libmimalloc")):
            return name
    return None


def describe() -> str:
    """One line naming this process's host allocator, for the start of a run and ``paratrain doctor``."""
    name = loaded_allocator()
    if name:
        return f"{name} (preloaded)"
    if _choice(os.environ) == "system":
        return f"glibc malloc ({CHOICE_ENV}=system)"
    return "glibc malloc (no tcmalloc preloaded: CPU steps spend more time in page faults; see README, Host memory)"


def restart_with_allocator(argv: list[str]) -> None:
    """Replace this process (``train`` only, before torch is imported) by itself with the allocator
    preloaded when it will train on the CPU (a machine with an NVIDIA device file trains on the GPU unless
    ``PARATRAIN_DEVICE=cpu``) and does not have it yet; else return."""
    if not argv or argv[0] != "train" or os.environ.get(RESTARTED_ENV) or loaded_allocator():
        return
    on_gpu = any(Path("/dev").glob("nvidia[0-9]*"))
    if os.environ.get("PARATRAIN_DEVICE", "auto").strip().lower() != "cpu" and on_gpu:
        return
    added = rank_env()
    if not added:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "paratrain", *argv], os.environ | added | {RESTARTED_ENV: "1"})


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 4 MiB (blocks above it returned to the system when freed; 10-25 % of a
    CPU rank's peak in ``bench/peers.py``), unless an allocator is preloaded, ``MALLOC_MMAP_THRESHOLD_`` is set
    or the C library is not glibc; returns whether it was set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux") or loaded_allocator():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
