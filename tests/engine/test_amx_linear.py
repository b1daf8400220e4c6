"""bf16 Linear layers through Corral's AMX kernel (kernels/amx_linear.c) on CPUs with AMX tiles:
the Linear contract, which weights it takes, the Linear module and the engine taking it, and a
build without AMX saying so."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from corral_engine.model import native
from corral_engine.model.llama import Linear
from corral_engine.settings import EngineSettings

from tests.engine.helpers import check_linear_contract, cpu_has

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")


def _amx() -> native.AmxLinear:
    kernel = native.load_amx_linear(EngineSettings(native_kernels=True))
    if kernel is None:
        pytest.skip("no AMX tiles here (or no C compiler): the AMX Linear kernel is not built for this CPU")
    return kernel


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "size", "out"),
    # one row; fewer than a 32-row block; exactly one; one past; several panels of both kinds
    [(1, 768, 1280), (5, 64, 32), (31, 96, 64), (32, 2304, 768), (33, 768, 96), (300, 128, 4608)],
)
def test_amx_linear_meets_the_linear_contract(rows: int, size: int, out: int, bias: bool) -> None:
    kernel = _amx()
    check_linear_contract(lambda x, w, b: kernel(x, kernel.pack(w), b, w.shape[0]), rows, size, out, bias)


def test_amx_linear_takes_what_its_tiles_fit() -> None:
    kernel = _amx()
    assert kernel.fits(torch.zeros(64, 96, dtype=torch.bfloat16))
    assert not kernel.fits(torch.zeros(48, 96, dtype=torch.bfloat16))  # N not a multiple of 32
    assert not kernel.fits(torch.zeros(64, 40, dtype=torch.bfloat16))  # K not a multiple of 32
    assert not kernel.fits(torch.zeros(64, 96))  # float32
    with pytest.raises(native.NativeKernelError):
        kernel.pack(torch.zeros(48, 96, dtype=torch.bfloat16))


def test_linear_layers_multiply_through_the_amx_kernel_where_it_fits() -> None:
    kernel = _amx()
    torch.manual_seed(0)
    layer = Linear(768, 1280, bias=True).bfloat16()
    x = torch.randn(100, 768).bfloat16()
    want = F.linear(x, layer.weight, layer.bias)
    assert layer.prepack_amx(kernel, keep_weight=False)
    assert layer.weight.numel() == 0  # released: the layer can only multiply through the tiles now
    got = layer(x)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got == want).float().mean() > 0.99  # oneDNN sums the same products: mostly the same bits
    for other in (Linear(768, 100).bfloat16(), Linear(64, 64)):  # 100 columns; float32
        assert not other.prepack_amx(kernel, keep_weight=False)
        assert other.amx_packed is None and other.weight.numel() > 0


@needs_cc
def test_a_build_without_amx_reports_none(tmp_path: Path) -> None:
    """On a CPU without AMX (or a build for one) the library still builds, the AMX entry points
    say so, and the paged decode kernel takes its float32 loops."""
    if not cpu_has("avx2"):
        pytest.skip("this CPU cannot run -march=x86-64-v3 code")
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in native.FLAGS]
    target = tmp_path / "decode_stack-v3.so"
    subprocess.run(["cc", *flags, "-o", str(target), str(native.DECODE_STACK_SOURCE), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    assert not native.AmxLinear(lib).available
    bf16 = torch.bfloat16
    assert not native.PagedDecode(lib).uses_amx(bf16, bf16, block_size=16, group=3, head_dim=64)


@needs_cc
def test_the_engine_multiplies_bf16_layers_through_amx_tiles_unless_switched_off(
    tiny_model_dir: Path,
) -> None:
    from corral_engine.sampling_params import SamplingParams

    from tests.engine.helpers import make_engine

    _amx()
    prompts = [[5 + i, 9, 33 + 2 * i, 7] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for switch in ("0", "auto"):
        engine = make_engine(tiny_model_dir, EngineSettings(amx_linear=switch), dtype="bfloat16")
        layers = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        on_tiles = [m for m in layers if m.amx_packed is not None]
        assert bool(on_tiles) == (switch == "auto")
        outputs[switch] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert outputs["auto"] == outputs["0"]
