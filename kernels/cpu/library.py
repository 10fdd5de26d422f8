"""The native CPU library (kernels/cpu/csrc/*.c): built once per machine, loaded with ctypes.

Every C source under ``kernels/cpu/csrc`` goes into one shared object, built with the system C
compiler on first use into a per-user cache (``$PREFIXGATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/prefixgate``, else ``~/.cache/prefixgate``), keyed by the sources, the flags
and the CPU's feature flags (it is built with ``-march=native``). The library links the
``libgomp.so.1`` torch already loaded, so its OpenMP loops share torch's thread pool.

No compiler or a failed build: :func:`library` returns None, the outcome is logged once and
visible through :func:`native_status`, and every caller falls back to its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# NOTE: linked in a separate step WITHOUT -ffast-math: linking a shared object with it pulls in
# crtfastmath.o, whose load-time hook turns on flush-to-zero for the whole process
LINK_FLAGS = ("-shared", "-fopenmp")

_status = "not loaded yet"


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
    # build next to the target, then rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(prefix="tmp-prefixgate_cpu-", suffix=".so", dir=target.parent)
    os.close(fd)
    objects = [f"{tmp[: -len('.so')]}-{f.stem}.o" for f in files]
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True, timeout=120)
    try:
        for source, obj in zip(files, objects, strict=True):
            run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj])
        run([compiler, *LINK_FLAGS, *objects, "-o", tmp, "-lm"])
        os.chmod(tmp, 0o755)  # loadable by every user sharing the cache directory
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


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
    ], _i32),
    # cpu_ops.c
    "pg_rms_norm_f32": ([_p, _i64, _p, _p, _i64, _i64, _i32, _f32, _i32], None),
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
    except subprocess.CalledProcessError as exc:
        _status = f"unavailable: build failed: {(exc.stderr or '').strip()[-500:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        _status = f"unavailable: {exc}"
    else:
        _status = f"native ({path})"
        logger.info("native CPU kernels loaded: %s", path)
        return lib
    logger.warning("native CPU kernels %s; using the torch path", _status)
    return None


__all__ = ["bf16_instructions", "int8_instructions", "library", "native_status", "sources"]
