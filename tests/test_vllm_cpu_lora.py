"""lmforge's grouped CPU LoRA ops (`lmforge.inference.vllm_cpu_lora`, a vLLM general plugin): the same
results as vLLM's own torch ops for every adapter index, no delta for the base model's tokens
(index -1, where vLLM's applies the last adapter), and installed where vLLM's CPU path finds them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


def _case(tokens: int, indices: list[int]) -> tuple:
    generator = torch.Generator().manual_seed(len(indices) + tokens)
    x = torch.randn(tokens, 64, generator=generator)
    a = torch.randn(3, 1, 8, 64, generator=generator)  # 3 adapters of rank 8 on a 64-wide layer
    b = torch.randn(3, 1, 96, 8, generator=generator)  # expanding to 96 (a padded output)
    index = torch.tensor(indices, dtype=torch.long)
    return x, a, b, index


@pytest.mark.parametrize(
    "indices",
    [[0] * 40, [2] * 40, [0, 1, 2, 1, 0] * 8, [1] * 20 + [0] * 20],
    ids=["one adapter", "the last", "interleaved", "two groups"],
)
def test_the_grouped_ops_match_vllms_own(indices: list[int]) -> None:
    from lmforge.inference import vllm_cpu_lora as mine

    x, a, b, index = _case(len(indices), indices)
    theirs_s, ours_s = torch.zeros(len(indices), 8), torch.zeros(len(indices), 8)
    ops.bgmv_shrink(x, a, theirs_s, index, 0.5)
    mine.bgmv_shrink(x, a, ours_s, index, 0.5)
    torch.testing.assert_close(ours_s, theirs_s, rtol=1e-5, atol=1e-5)
    for add in (True, False):
        theirs_e, ours_e = torch.ones(len(indices), 128), torch.ones(len(indices), 128)
        ops.bgmv_expand(theirs_s, b, theirs_e, index, add)
        mine.bgmv_expand(theirs_s, b, ours_e, index, add)
        torch.testing.assert_close(ours_e, theirs_e, rtol=1e-5, atol=1e-5)
        theirs_sl, ours_sl = torch.ones(len(indices), 200), torch.ones(len(indices), 200)
        ops.bgmv_expand_slice(theirs_s, b, theirs_sl, index, 40, 96, add)
        mine.bgmv_expand_slice(theirs_s, b, ours_sl, index, 40, 96, add)
        torch.testing.assert_close(ours_sl, theirs_sl, rtol=1e-5, atol=1e-5)


def test_the_base_models_tokens_get_no_delta() -> None:
    """-1 marks a token of a request to the base model: vLLM's torch ops index weights[-1] (the last
    adapter) for it; the grouped ops leave its rows as they are, as vLLM's GPU kernels do."""
    from lmforge.inference import vllm_cpu_lora as mine

    indices = [-1, 0, -1, 1, -1]
    x, a, b, index = _case(5, indices)
    ours = torch.full((5, 8), 7.0)
    mine.bgmv_shrink(x, a, ours, index, 1.0)
    assert torch.equal(ours[[0, 2, 4]], torch.zeros(3, 8))  # shrink writes its output: zero for them
    out = torch.ones(5, 96)
    mine.bgmv_expand(ours, b, out, index, True)
    assert torch.equal(out[[0, 2, 4]], torch.ones(3, 96))  # expand adds nothing to their rows
    theirs = torch.zeros(5, 8)
    ops.bgmv_shrink(x, a, theirs, index, 1.0)
    assert not torch.equal(theirs[[0, 2, 4]], torch.zeros(3, 8))  # vLLM's: the last adapter's delta
    torch.testing.assert_close(ours[[1, 3]], theirs[[1, 3]])


def test_the_plugin_installs_the_ops_where_vllms_cpu_path_looks_them_up() -> None:
    """Registered as a vLLM general plugin; in a fresh process, after vLLM loads its plugins, the CPU
    punica wrapper and the torch ops package call lmforge's functions (and `LMFORGE_VLLM_LORA_OPS=upstream`
    keeps vLLM's)."""
    from importlib.metadata import entry_points

    assert "lmforge_cpu_lora" in {e.name for e in entry_points(group="vllm.general_plugins")}
    probe = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "import vllm.lora.punica_wrapper.punica_cpu as p, vllm.lora.ops.torch_ops.lora_ops as o\n"
        "print(p.bgmv_shrink.__module__, o.bgmv_expand.__module__, o.bgmv_expand_slice.__module__)\n"
    )
    for env, expected in (
        ({}, "lmforge.inference.vllm_cpu_lora"),
        ({"LMFORGE_VLLM_LORA_OPS": "upstream"}, ops.__name__),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [expected] * 3, (env, out.stdout, out.stderr[-1000:])


@pytest.mark.parametrize(
    ("ranks", "max_rank", "indices"),
    [
        ((8, 8, 8), 8, [0, 1, 2, 1, 0, 2] * 5),  # ranks as trained
        ((8, 16, 4), 16, [1] * 7 + [0] * 9 + [2] * 3),  # padded to --max-lora-rank
        ((32, 16, 8), 32, [0, -1, 2, -1, 1] * 6),  # a stacked adapter (16 + 16) beside others, base tokens
        ((16, 16, 16), 64, [2]),  # one decode token, rank padded 4x
    ],
    ids=["as trained", "padded", "stacked and base tokens", "one token"],
)
def test_every_buffer_shape_vllm_passes_gives_vllms_results(ranks: tuple, max_rank: int, indices: list[int]) -> None:
    """vLLM stacks adapters of different ranks into [max_loras, 1, max_rank, in] / [.., out, max_rank]
    weights, zero beyond each adapter's rank, and hands zeroed float32 shrink buffers of max_rank
    columns. The grouped ops must give vLLM's results on every row that has an adapter, leave the
    base model's rows (-1) alone, and read nothing they did not write: the output buffers start as
    NaN where either op would overwrite them, and stay finite."""
    from lmforge.inference import vllm_cpu_lora as mine

    generator = torch.Generator().manual_seed(max_rank + len(indices))
    tokens, width, out = len(indices), 64, 96
    a = torch.zeros(len(ranks), 1, max_rank, width)
    b = torch.zeros(len(ranks), 1, out, max_rank)
    for slot, rank in enumerate(ranks):
        a[slot, 0, :rank] = torch.randn(rank, width, generator=generator)
        b[slot, 0, :, :rank] = torch.randn(out, rank, generator=generator)
    x = torch.randn(tokens, width, generator=generator).to(torch.bfloat16)
    index = torch.tensor(indices, dtype=torch.long)
    adapted = index >= 0
    theirs_s = torch.full((tokens, max_rank), float("nan"))
    ours_s = torch.full((tokens, max_rank), float("nan"))
    ops.bgmv_shrink(x, a, theirs_s, index, 0.5)
    mine.bgmv_shrink(x, a, ours_s, index, 0.5)
    assert torch.isfinite(ours_s).all()
    torch.testing.assert_close(ours_s[adapted], theirs_s[adapted], rtol=1e-4, atol=1e-4)
    for add in (True, False):
        start = torch.randn(tokens, out + 32, generator=generator)
        theirs_e, ours_e = start.clone(), start.clone()
        ops.bgmv_expand(theirs_s, b, theirs_e, index, add)
        mine.bgmv_expand(ours_s, b, ours_e, index, add)
        torch.testing.assert_close(ours_e[adapted], theirs_e[adapted], rtol=1e-4, atol=1e-4)
        untouched = start[~adapted] if add else torch.zeros_like(start[~adapted])
        untouched[:, out:] = start[~adapted][:, out:]
        torch.testing.assert_close(ours_e[~adapted], untouched)
        theirs_sl, ours_sl = start.clone(), start.clone()
        ops.bgmv_expand_slice(theirs_s, b, theirs_sl, index, 16, out, add)
        mine.bgmv_expand_slice(ours_s, b, ours_sl, index, 16, out, add)
        torch.testing.assert_close(ours_sl[adapted], theirs_sl[adapted], rtol=1e-4, atol=1e-4)
        assert torch.isfinite(ours_sl).all()
