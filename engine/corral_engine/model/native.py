"""Optional native CPU kernels: compiled on first use with the system C compiler, cached per machine.

`load_paged_decode()` returns the paged decode attention kernel (kernels/paged_decode.c) and
`load_fused_ops()` the fused bf16 elementwise ops (kernels/fused_ops.c: SiLU-and-multiply, RMSNorm
with or without the residual add before it, rotary embedding) and the small-batch bf16 matmul;
both come from one library, built from kernels/decode_stack.c, which includes those two sources
and adds the decode stack (model/decode_stack.py);
each is None when it cannot be had (no compiler, a failed build, `native_kernels` off in the
EngineSettings, i.e. `CORRAL_NATIVE_ATTENTION=0`), and
callers then use the pure-PyTorch path, which computes the same thing. The libraries are built with
`-march=native`, so the cache key includes the CPU's feature flags as well as the source and the
compiler. The kernels run without the GIL (ctypes releases it), on torch's thread count, in torch's
own OpenMP runtime (the process has one libgomp).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_decode.c"
FUSED_SOURCE = Path(__file__).parent / "kernels" / "fused_ops.c"
DECODE_STACK_SOURCE = Path(__file__).parent / "kernels" / "decode_stack.c"  # includes the other two
MAX_BLOCK_SIZE = 256  # the paged decode kernel's largest block (MAX_BLOCK_SIZE in paged_decode.c)
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_BUILD_TIMEOUT_S = 120


class NativeKernelError(RuntimeError):
    pass


# The paged decode kernel's variants by (queries' dtype, cache's dtype): a cache in the model's
# dtype, or fp8 (--kv-cache-dtype), each value converted to float32 as it is read (bf16 over
# bf16: AMX tiles where the CPU has them).
_PAGED_DECODE_FNS = {
    (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
    (torch.float32, torch.float32): "paged_decode_f32",
    (torch.bfloat16, torch.float8_e4m3fn): "paged_decode_bf16_e4m3",
    (torch.bfloat16, torch.float8_e5m2): "paged_decode_bf16_e5m2",
    (torch.float32, torch.float8_e4m3fn): "paged_decode_f32_e4m3",
    (torch.float32, torch.float8_e5m2): "paged_decode_f32_e5m2",
}


class PagedDecode:
    """out[S, H, D] = softmax(q K^T * scale) V per sequence, K/V read through the block tables."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns: dict[tuple[torch.dtype, torch.dtype], Any] = {}
        for dtypes, name in _PAGED_DECODE_FNS.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            # pointers: q, k_cache, v_cache, block_tables, ctx_lens, out; then six sizes;
            # then scale, window, threads
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
            fn.argtypes += [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
            self._fns[dtypes] = fn
        self._amx = lib.paged_decode_amx
        self._amx.restype = ctypes.c_int
        self._amx.argtypes = [ctypes.c_int64] * 3

    def uses_amx(
        self, dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, group: int, head_dim: int
    ) -> bool:
        """Whether calls of these shapes score and sum with AMX tiles on this CPU (bf16 queries over a
        bf16 cache, block_size % 16 == 0, head_dim % 64 == 0, group <= 16; see paged_decode.c)."""
        both_bf16 = dtype == cache_dtype == torch.bfloat16
        return both_bf16 and bool(self._amx(block_size, group, head_dim))

    def supports(
        self, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype | None = None
    ) -> bool:
        """Queries of `dtype` over a cache of `cache_dtype` (default: the same) on `device`."""
        return device.type == "cpu" and (dtype, cache_dtype or dtype) in self._fns

    def __call__(
        self,
        q: torch.Tensor,  # [S, H, D], contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int64
        ctx_lens: torch.Tensor,  # [S] int64
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        tensors = (q, k_cache, v_cache, block_tables, ctx_lens)
        if not all(t.is_contiguous() for t in tensors) or block_tables.dtype != torch.int64:
            raise NativeKernelError("paged decode needs contiguous tensors and int64 block tables")
        fn = self._fns.get((q.dtype, k_cache.dtype))
        if fn is None or v_cache.dtype != k_cache.dtype:
            raise NativeKernelError(f"paged decode takes no {q.dtype} queries over a {k_cache.dtype} cache")
        out = torch.empty_like(q)
        failed = fn(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            ctx_lens.data_ptr(), out.data_ptr(),
            num_seqs, block_tables.shape[1], block_size, num_kv_heads, num_heads // num_kv_heads, head_dim,
            scale, window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise NativeKernelError("paged decode could not allocate its scratch buffers")
        return out


class AmxLinear:
    """bf16 Linear layers through AMX tiles (kernels/amx_linear.c): bf16(x W^T + b) with float32
    sums rounded once, as oneDNN computes it, from a weight packed once into the tiles' layout."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._available = lib.amx_linear_available
        self._available.restype = ctypes.c_int
        self._fits = lib.amx_linear_fits
        self._fits.restype = ctypes.c_int
        self._fits.argtypes = [ctypes.c_int64] * 2
        self._pack = lib.amx_linear_pack_bf16
        self._pack.restype = None
        self._pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._linear = lib.amx_linear_bf16
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]

    @property
    def available(self) -> bool:
        """This CPU has AMX tiles, the library was built for them and Linux grants them."""
        return bool(self._available())

    def fits(self, weight: torch.Tensor) -> bool:
        """A bf16 CPU weight [N, K] the kernel takes (N and K multiples of 32)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            return False
        return bool(self._fits(weight.shape[0], weight.shape[1]))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight [N, K] in the kernel's tile layout (a flat bf16 tensor of N * K values)."""
        if not self.fits(weight):
            raise NativeKernelError(
                f"amx_linear takes a bf16 [N, K] weight, N, K multiples of 32, not {weight.shape}"
            )
        weight = weight.detach().contiguous()
        packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
        self._pack(
            weight.data_ptr(), packed.data_ptr(), weight.shape[0], weight.shape[1], torch.get_num_threads()
        )
        return packed

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) for bf16 rows x [M, K] and `packed` = pack(weight)."""
        x = x.contiguous()
        rows, size = x.shape
        out = x.new_empty((rows, out_features))
        if rows:
            failed = self._linear(
                x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.contiguous().data_ptr(),
                out.data_ptr(), rows, out_features, size, torch.get_num_threads(),
            )  # fmt: skip
            if failed:
                raise NativeKernelError(f"amx_linear failed ({failed}: 1 no memory for scratch, 2 no AMX)")
        return out


class FusedOps:
    """bf16 elementwise ops in one pass, rounding like the PyTorch expressions they replace."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._silu_and_mul = lib.silu_and_mul_bf16
        self._silu_and_mul.restype = ctypes.c_int
        self._silu_and_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.restype = ctypes.c_int
        sizes = [ctypes.c_int64] * 2
        self._rms_norm.argtypes = [ctypes.c_void_p] * 3 + sizes + [ctypes.c_float, ctypes.c_int]
        self._add_rms_norm = lib.add_rms_norm_bf16
        self._add_rms_norm.restype = ctypes.c_int
        self._add_rms_norm.argtypes = [ctypes.c_void_p] * 5 + sizes + [ctypes.c_float, ctypes.c_int]
        self._rotary = lib.rotary_bf16
        self._rotary.restype = ctypes.c_int
        self._rotary.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7 + [ctypes.c_int]
        self._linear_rows = lib.linear_rows_bf16
        self._linear_rows.restype = ctypes.c_int
        self._linear_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._race = lib.exponential_race_f32
        self._race.restype = ctypes.c_int
        self._race.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._race_logits = lib.exponential_race_logits_f32
        self._race_logits.restype = ctypes.c_int
        self._race_logits.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._argmax = lib.argmax_rows_f32
        self._argmax.restype = ctypes.c_int
        self._argmax.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._causal_softmax = lib.causal_softmax_bf16
        self._causal_softmax.restype = ctypes.c_int
        # scores; mats, rows, group, cols, first, window; scale; threads
        softmax = self._causal_softmax
        softmax.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
        self._write_kv = lib.write_kv_bf16
        self._write_kv.restype = ctypes.c_int64
        # k, v; their row strides; k_cache, v_cache, slots; tokens, row, slots in the cache; threads
        write_args = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
        self._write_kv.argtypes = write_args + [ctypes.c_int64] * 3 + [ctypes.c_int]

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up, as `F.silu(x[:, :I]) * x[:, I:]` computes it."""
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * bf16(rms_norm(float32(x))) over the last dimension."""
        size = x.shape[-1]
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to bf16 before the norm reads it."""
        size = x.shape[-1]
        out, summed = torch.empty_like(x), torch.empty_like(x)
        self._add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), summed.data_ptr(),
            x.numel() // size, size, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, summed

    @staticmethod
    def supports_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """q [T, H, D] and k [T, KVH, D] with contiguous heads (rows of the fused QKV output are
        fine), cos and sin [T, 1, D] alike with a unit last stride, all bf16 on the CPU."""
        head_dim = q.shape[-1]
        return (
            all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k, cos, sin))
            and q.stride()[1:] == (head_dim, 1)
            and k.stride()[1:] == (head_dim, 1)
            and cos.shape == sin.shape == (q.shape[0], 1, head_dim)
            and cos.stride(-1) == 1
            and sin.stride() == cos.stride()
        )

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place: x * cos + rotate_half(x) * sin for q and k, rounded as those three ops round
        it (see supports_rotary for the layouts)."""
        num_tokens, num_heads, head_dim = q.shape
        self._rotary(
            q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            num_tokens, num_heads, k.shape[1], head_dim, q.stride(0), k.stride(0), cos.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip

    def linear_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias) for a few contiguous bf16 rows [R, K] and a contiguous weight
        [N, K]: float32 sums rounded once (see kernels/fused_ops.c for when this beats PyTorch)."""
        rows, size = x.shape
        out = x.new_empty((rows, weight.shape[0]))
        failed = self._linear_rows(
            x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            rows, weight.shape[0], size, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise NativeKernelError("linear_rows could not allocate its scratch buffer")
        return out

    def exponential_race(
        self, probs: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sampler's draw for each row of `probs` ([R, V] float32 on the CPU, rows not
        necessarily normalised): argmax of p / E with E ~ Exp(1) from a noise stream that depends
        only on the row's seed (`seeds`: [R] int64). Returns [R] int64 token ids.

        With `temperatures` ([R] float32, each > 0) the rows are logits and p is softmax(logits / t)
        (a -inf logit: p = 0), computed inside the race: the draws of the probability tensor's
        path, without writing it."""
        probs = probs.contiguous()
        seeds = seeds.contiguous()
        out = torch.empty(probs.shape[0], dtype=torch.long)
        if temperatures is None:
            self._race(
                probs.data_ptr(), seeds.data_ptr(), out.data_ptr(), probs.shape[0], probs.shape[1],
                torch.get_num_threads(),
            )  # fmt: skip
            return out
        temperatures = temperatures.to(torch.float32).contiguous()
        self._race_logits(
            probs.data_ptr(), temperatures.data_ptr(), seeds.data_ptr(), out.data_ptr(), probs.shape[0],
            probs.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.max(logits, dim=-1).indices for [R, V] float32 CPU logits (first index of a tie; a
        NaN wins), in one native pass per row: 3-5x faster than PyTorch's at 128 rows of a 32k
        vocabulary on two cores."""
        rows, vocab = logits.shape if logits.dim() == 2 else (0, 0)
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or not vocab:
            raise NativeKernelError(
                f"argmax_rows takes [R, V>0] float32 CPU logits, not {logits.dtype} {logits.shape}"
            )
        logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.long)
        if rows:
            self._argmax(logits.data_ptr(), out.data_ptr(), rows, vocab, torch.get_num_threads())
        return out

    def causal_softmax(
        self, scores: torch.Tensor, rows: int, first: int, window: int | None, scale: float = 1.0
    ) -> None:
        """In place: softmax over the last dimension of `scores * scale` ([M, rows * G, cols] bf16,
        contiguous: a prompt block's unscaled scores, query heads interleaved per row) with row r of
        every head seeing columns [first + r - window, first + r) only (from 0 without a window),
        and zeros elsewhere; as `(scores * scale).masked_fill_(hidden, -inf).softmax(-1)` in bf16
        computes it."""
        mats, height, cols = scores.shape
        if self._causal_softmax(
            scores.data_ptr(), mats, rows, height // rows, cols, first, window or 0, scale,
            torch.get_num_threads(),
        ):  # fmt: skip
            raise NativeKernelError("causal_softmax_bf16 could not allocate its row buffers")

    def write_kv(
        self,
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64: block * block_size + offset; < 0 skips the row
    ) -> None:
        """The step's new K/V rows into their cache slots, as `index_copy_` into the flattened
        caches: one pass of row copies. Rows may be strided (views into the QKV output); anything
        else the kernel does not take (another dtype or layout) goes through index_copy_."""
        row = k.shape[1] * k.shape[2]
        if not (
            k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and k.device.type == "cpu"
            and k.stride()[1:] == v.stride()[1:] == (k.shape[2], 1)
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and slots.dtype == torch.int64
            and slots.is_contiguous()
        ):
            k_cache.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slots, k)
            v_cache.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slots, v)
            return
        num_slots = k_cache.numel() // row
        bad = self._write_kv(
            k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), k.shape[0], row, num_slots, torch.get_num_threads(),
        )  # fmt: skip
        if bad:
            raise NativeKernelError(f"write_kv: {bad} slot(s) past the cache's {num_slots}")


@cache
def load_paged_decode(settings: EngineSettings) -> PagedDecode | None:
    lib = load_decode_stack_library(settings)
    return PagedDecode(lib) if lib is not None else None


@cache
def load_amx_linear(settings: EngineSettings) -> AmxLinear | None:
    """The AMX Linear kernel where this CPU has AMX tiles and CORRAL_AMX_LINEAR is not 0."""
    if settings.amx_linear == "0":
        return None
    lib = load_decode_stack_library(settings)
    kernel = None if lib is None else AmxLinear(lib)
    return kernel if kernel is not None and kernel.available else None


@cache
def load_fused_ops(settings: EngineSettings) -> FusedOps | None:
    lib = load_decode_stack_library(settings)
    return FusedOps(lib) if lib is not None else None


@cache
def load_decode_stack_library(settings: EngineSettings) -> ctypes.CDLL | None:
    """The one library of every native kernel: decode_stack.c includes paged_decode.c and
    fused_ops.c, so one build (not three) serves PagedDecode, FusedOps and model/decode_stack.py."""
    return _load(DECODE_STACK_SOURCE, "native CPU kernels", settings)


def _load(source: Path, what: str, settings: EngineSettings) -> ctypes.CDLL | None:
    if not settings.native_kernels:
        logger.info("%s off (CORRAL_NATIVE_ATTENTION=0)", what)
        return None
    try:
        lib = ctypes.CDLL(str(build(source, settings.compiler, settings.kernel_cache_dir)))
    except (NativeKernelError, OSError) as e:
        logger.warning("%s unavailable, using the PyTorch path: %s", what, e)
        return None
    return lib


def build(source: Path, compiler: str | None = None, cache_dir: Path | None = None) -> Path:
    """The compiled library for `source` on this machine, building it on first use with `compiler`
    (default: cc, else gcc) into `cache_dir` (default: ~/.cache/corral/kernels)."""
    compiler = compiler or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelError("no C compiler found (set CC)")
    # What the source may include: the headers, and the other sources (decode_stack.c includes them).
    headers = [
        p.read_bytes() for p in sorted(source.parent.iterdir()) if p.suffix in (".h", ".c") and p != source
    ]
    key = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), *headers, " ".join(FLAGS).encode(), _compiler_id(compiler), _cpu_flags()]
        )
    ).hexdigest()[:16]
    cache_dir = cache_dir or Path.home() / ".cache" / "corral" / "kernels"
    target = cache_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, "-o", str(partial), str(source), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeKernelError(f"{compiler} failed: {e}") from e
        if done.returncode != 0:
            raise NativeKernelError(
                f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    logger.info("built %s", target)
    return target


def _compiler_id(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return b""


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""
