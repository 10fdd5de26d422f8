"""The native CPU library (kernels/cpu/csrc/*.c): built once per machine, loaded with ctypes.

Every C source under ``kernels/cpu/csrc`` goes into one shared object, built with the system C
compiler on first use into a per-user cache (``$PREFIXGATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/prefixgate``, else ``~/.cache/prefixgate``), keyed by the sources, the flags
and the CPU's feature flags (it is built with ``-march=native``). The library links the
``libgomp.so.1`` torch already loaded, so its OpenMP loops share torch's thread pool.

Processes that start together (test workers, replicas on one host) build it once: the build
holds a lock file beside the target and the others wait for it, then load what it made. The
sources compile in parallel, one compiler per core.

No compiler or a failed build: :func:`library` returns None, the outcome is logged once as a
warning naming the reason and visible through :func:`native_status` (the server repeats it
at start-up and in ``/v1/models``), and every caller falls back to its torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# NOTE: linked in a separate step WITHOUT -ffast-math: linking a shared object with it pulls in
# crtfastmath.o, whose load-time hook turns on flush-to-zero for the whole process
LINK_FLAGS = ("-shared", "-fopenmp")
# NOTE: measured on a 2-core Xeon (Sapphire Rapids, KVM). At load average 0.3 the slowest
# source (paged_prefill.c) compiles in 20 s and the library in 37 s one source at a time; at
# load average 5.5 (other jobs) paged_prefill.c alone took 109 s and the library 210 s one
# source at a time, 149 s two at a time. Shared machines reach load averages of 17-25. The
# timeout only catches a compiler that hangs: a build that merely runs slowly must never fall
# back to the torch path (the old 120 s did, silently, on a loaded 2-core machine).
BUILD_TIMEOUT_S = 1200.0  # one compiler or linker run

_status = "not loaded yet"


class NativeBuildError(RuntimeError):
    """The library could not be built here; the message says why (the source, the compiler's
    error, or the timeout and the machine's load)."""


def native_status() -> str:
    """``"native (<path>)"`` once loaded, else why not (``"unavailable: ..."``)."""
    return _status


def sources() -> list[Path]:
    """The C sources of the library, in a fixed order."""
    return sorted(SOURCE_DIR.glob("*.c"))


def headers() -> list[Path]:
    """The headers the sources include (part of the build key, never compiled alone)."""
    return sorted(SOURCE_DIR.glob("*.h"))


def _cache_dir() -> Path:
    explicit = os.environ.get("PREFIXGATE_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    preferred = Path(base) / "prefixgate" / "kernels"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK | os.X_OK):
            return preferred
    except OSError:
        pass
    # a read-only or missing home (containers, CI sandboxes): a private per-user temp dir
    return _private_dir(Path(tempfile.gettempdir()) / f"prefixgate-kernels-{os.getuid()}")


def _private_dir(path: Path) -> Path:
    """``path`` created 0700, and refused unless it is ours and nobody else can write it: we
    load code from it, and /tmp is shared."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not a private directory of this user; not loading code from it")
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# /proc/cpuinfo flags of the bf16 instructions, the best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def bf16_instructions() -> str | None:
    """The best bf16 dot-product instructions this CPU has (``"amx_bf16"`` or
    ``"avx512_bf16"``, as /proc/cpuinfo names them), or None: where the bf16 mode's GEMMs would
    run emulated, slower than fp32."""
    flags = set(_cpu_flags().split())
    return next((flag for flag in BF16_FLAGS if flag in flags), None)


# /proc/cpuinfo flags the int8-activation mode's kernel needs (VPDPBUSD on zmm, byte ops)
INT8_FLAGS = ("avx512_vnni", "avx512bw")


def int8_instructions() -> str | None:
    """``"avx512_vnni"`` where the CPU has AVX512-VNNI and AVX512-BW (the q8 mode's integer dot
    products, kernels/cpu/csrc/linear_q8.c), else None: the mode would be emulated there."""
    flags = set(_cpu_flags().split())
    return INT8_FLAGS[0] if all(flag in flags for flag in INT8_FLAGS) else None


def _build(compiler: str) -> Path:
    """The library's path, built first unless this machine has it already.

    Raises:
        NativeBuildError: a source did not compile, the link failed, a run timed out, or
            another process's build held the lock past its worst case.
    """
    files = sources()
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
    parts = [f.name.encode() + b"\0" + f.read_bytes() for f in [*files, *headers()]]
    key = hashlib.sha256(
        b"\0".join([*parts, flags, compiler.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"prefixgate_cpu-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # the holder's worst case: every compile and the link each run up to the timeout
    with _build_lock(target.with_suffix(".lock"), (len(files) + 1) * BUILD_TIMEOUT_S):
        if not target.exists():  # else another process built it while we waited
            _compile_and_link(compiler, files, target)
    return target


@contextlib.contextmanager
def _build_lock(path: Path, wait_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: one process builds, the others wait (up to
    ``wait_s``). The kernel drops it when its holder dies, so a killed build never blocks the
    next one."""
    # read-only is enough for flock: another user sharing the cache directory can open it too
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    logger.info("waiting for another process's build of the native CPU kernels")
                    waiting = True
                if time.monotonic() > deadline:
                    raise NativeBuildError(f"waited {wait_s:g} s for another process's build "
                                           f"({path} is locked)") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile_and_link(compiler: str, files: list[Path], target: Path) -> None:
    # build next to the target, then rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(prefix="tmp-prefixgate_cpu-", suffix=".so", dir=target.parent)
    os.close(fd)
    objects = [f"{tmp[: -len('.so')]}-{f.stem}.o" for f in files]
    started = time.monotonic()
    logger.info("building the native CPU kernels (%d sources, once per machine) into %s",
                len(files), target)
    try:
        workers = max(1, min(len(files), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="prefixgate-cc") as pool:
            errors = list(pool.map(
                lambda job: _run(compiler, [*COMPILE_FLAGS, "-c", str(job[0]), "-o", job[1]],
                                 job[0].name), zip(files, objects, strict=True)))
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise NativeBuildError(first)
        error = _run(compiler, [*LINK_FLAGS, *objects, "-o", tmp, "-lm"], "linking")
        if error is not None:
            raise NativeBuildError(error)
        os.chmod(tmp, 0o755)  # loadable by every user sharing the cache directory
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    logger.info("native CPU kernels built in %.1f s", time.monotonic() - started)


def _run(compiler: str, arguments: list[str], what: str) -> str | None:
    """Run the compiler once; None when it succeeded, else why not (``what`` names the step:
    the source compiled, or "linking")."""
    # NOTE: its own process group, killed whole on a timeout: the driver's children (cc1, as)
    # hold its output pipes open, and waiting for them would outlast any timeout
    with subprocess.Popen([compiler, *arguments], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return (f"build timed out: {what} took over {BUILD_TIMEOUT_S:g} s (load average "
                    f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    if process.returncode != 0:
        # the compiler names the source by its full path: keep its message, start with the file
        return f"build failed: {what}: {(stderr or '').strip()[-500:]}"
    return None


_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# ctypes signatures of the exported functions, in the C argument order: name -> (argtypes,
# restype), grouped by source file
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    # paged_decode.c
    "pg_paged_decode_f32": ([
        *(_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i64, _p),  # tensors and strides
        *(_i32, _i32, _i32, _i32, _i32, _f32),  # sizes and scale
        _i32,  # num_threads
        _i64,  # num_pages
        _i64,  # num_rows
        _i32,  # kv_bf16
        _i32,  # window (0: none)
        _p,  # sinks [Hq] fp32 (NULL: none)
    ], _i32),
    # cpu_ops.c
    "pg_rms_norm_f32": ([_p, _i64, _p, _p, _i64, _i64, _i32, _f32, _i32], None),
    "pg_rms_norm_heads_f32": ([_p, _i64, _i32, _i32, _i32, _p, _p, _i64, _f32, _i32], None),
    "pg_silu_mul_f32": ([_p, _i64, _p, _i64, _i32, _i32], None),
    "pg_rope_f32": ([_p, _i64, _i32, _i32, _p, _p, _i64, _i32], None),
    "pg_write_kv_f32": ([_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _i64], _i32),
    "pg_write_kv_bf16": ([_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _i64], _i32),
    # linear.c
    "pg_linear_f32": ([_p, _i64, _p, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32], None),
    "pg_linear_preferred": ([], _i32),
    # linear_quant.c
    "pg_linear_quant_f32": (
        [_i32, _p, _i64, _p, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _i32], _i32
    ),
    "pg_linear_quant_preferred": ([], _i32),
    "pg_quant_group_bytes": ([_i32], _i32),
    "pg_quant_rows_f32": ([_i32, _p, _i64, _i32, _p, _i64, _p, _i64, _i32], _i64),
    # linear_amx.c (a stub answering "no" where the library was built without AMX)
    "pg_amx_available": ([], _i32),
    "pg_linear_quant_amx_f32": (
        [_i32, _p, _i64, _p, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32], _i32
    ),
    # linear_bf16.c (-1 where the library was built without AVX512-BF16)
    "pg_linear_bf16_preferred": ([], _i32),
    "pg_linear_bf16": ([_p, _i64, _p, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _i32], _i32),
    # linear_q8.c (-1 where the library was built without AVX512-VNNI)
    "pg_linear_q8_preferred": ([], _i32),
    "pg_linear_q8": ([_i32, _p, _i64, _p, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32], _i32),
    "pg_q8_rows_f32": ([_i32, _p, _i64, _i32, _p, _i64, _p, _i64, _i32], _i64),
    # linear_mxfp4.c (path: 0 best, 1 C, 2 AVX2, 3 AVX-512; -2 where not built)
    "pg_linear_mxfp4_best": ([], _i32),
    "pg_linear_mxfp4": ([_p, _i64, _p, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32], _i32),
    # token_bitmask.c
    "pg_apply_token_bitmask_f32": ([_p, _i64, _p, _i64, _i64, _i64], None),
    # paged_prefill.c
    "pg_paged_prefill_f32": ([
        *(_p, _i64, _p, _p, _p, _i64),  # query, its row stride, k/v caches, pages, pages given
        *(_i32, _i32, _p, _i64),  # ctx_len, n_rows, out, its row stride
        *(_i32, _i32, _i32, _i32, _f32, _i32, _i64),  # heads, head_dim, page_size, scale,
        # threads, pool
        _i32,  # kv_bf16
        _i32,  # window (0: none)
        _p,  # sinks [Hq] fp32 (NULL: none)
    ], _i32),
    # decode_step.c (pointers to the ctypes Structures of kernels/cpu/decode_step.py)
    "pg_dense_decode_step": ([
        *(_p, _p, _i64),  # model, 2L K/V cache pointers, pool pages
        *(_p, _p, _p, _p, _p, _p, _p),  # hidden, spare, x, qkv, attn, gate_up, act
        *(_i64, _p, _p, _p),  # rows, cos, sin, slots
        *(_p, _i32, _i32),  # groups, their count, threads
    ], _i32),
    # paged_cascade.c
    "pg_cascade_decode_f32": ([
        *(_p, _i64, _p, _p, _p, _i64, _i32),  # query, its row stride, k/v caches, run pages,
        # tokens
        *(_p, _i32, _p, _p, _i64, _p),  # rows, their count, own_lse, out, its row stride, lse
        *(_i32, _i32, _i32, _i32, _f32, _i32),  # heads, head_dim, page_size, scale, threads
        *(_i64, _i64, _i32),  # pool pages, query rows, kv_bf16
    ], _i32),
}  # fmt: skip

# the kernels' compile-time limits: C function -> the two attributes set on the library
_LIMITS = {
    "pg_limits": ("max_group", "max_head_dim"),
    "pg_prefill_limits": ("prefill_max_group", "prefill_max_head_dim"),
    "pg_cascade_limits": ("cascade_max_rows", "cascade_max_head_dim"),
}


def _declare(lib: ctypes.CDLL) -> None:
    """Set the exported functions' ctypes signatures; read the AMX state and the limits."""
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    lib.amx_available = bool(lib.pg_amx_available())  # asks Linux for the tile state once
    for name, attributes in _LIMITS.items():
        limits = (ctypes.c_int(), ctypes.c_int())
        getattr(lib, name)(ctypes.byref(limits[0]), ctypes.byref(limits[1]))
        for attribute, limit in zip(attributes, limits, strict=True):
            setattr(lib, attribute, limit.value)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library (built on first call), or None when it cannot be built here."""
    global _status
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _status = "unavailable: no C compiler (cc/gcc) on PATH"
        logger.warning("native CPU kernels %s; using the torch path", _status)
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except NativeBuildError as exc:
        _status = f"unavailable: {exc}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        _status = f"unavailable: {exc}"
    else:
        _status = f"native ({path})"
        logger.info("native CPU kernels loaded: %s", path)
        return lib
    logger.warning("native CPU kernels %s; using the torch path (slower decode and prefill)",
                   _status)
    return None


__all__ = ["NativeBuildError", "bf16_instructions", "int8_instructions", "library",
           "native_status", "sources"]
