"""The block quantiser's figures and edges: the bytes it sends agree with the documented formula, and values
near float32's maximum come back finite and within half a level (issue 41, item 5)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import phalanx as px
from support.paths import REPO

FMAX = torch.finfo(torch.float32).max
DOC_FORMULA = "⌈n/block⌉·(block·bits/8 + 4) + 4"  # as docs/strategies.md writes it


def documented_bytes(n: int, bits: int, block: int) -> int:
    """docs/strategies.md's formula, evaluated: whole blocks of packed values (the last one padded), one float32
    scale per block, one float32 weight."""
    return math.ceil(n / block) * (block * bits // 8 + 4) + 4


@pytest.mark.parametrize("bits, sent", [(4, 548), (8, 1060)])
def test_the_documented_byte_formula_is_what_is_sent_for_a_padded_last_block(bits, sent):
    q = px.Quantize(bits, block=128)
    message = q.encode(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    # what send() all-gathers and counts is this message, byte for byte
    assert message.numel() * message.element_size() == sent == documented_bytes(1000, bits, 128)
    assert q.message_bytes(1000) == sent


def test_the_docs_and_the_docstring_state_the_formula_the_code_follows():
    with open(os.path.join(REPO, "docs", "strategies.md"), encoding="utf-8") as f:
        assert DOC_FORMULA in f.read()
    assert "ceil(n / block) * (block * bits / 8 + 4) + 4" in px.strategies.quantize.__doc__


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("values", [
    [FMAX] * 4,
    [FMAX, -FMAX, 1.0, 0.5 * FMAX],
    [-FMAX, FMAX * (1 - 2**-20), 3.0e38, -1.0e38],
])
def test_values_near_float32s_maximum_come_back_finite_and_within_half_a_level(bits, values):
    q = px.Quantize(bits, block=4)
    x = torch.tensor(values, dtype=torch.float32)
    back = q.decompress(*q.compress(x))
    assert torch.isfinite(back).all(), back
    levels = 2 ** (bits - 1) - 1
    # half a level of the block, plus the float32 rounding of a scale that cannot be levels x FMAX / levels
    bound = x.double().abs().max() / levels / 2 * (1 + 1e-6) + FMAX * 2**-22
    assert ((back.double() - x.double()).abs() <= bound).all(), (back, x)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_mean_of_messages_near_float32s_maximum_is_finite(bits):
    """Two workers both sending values near the maximum: their mean is in range, though their sum is not."""
    q = px.Quantize(bits, block=4)
    x = torch.tensor([FMAX, -FMAX, 0.9 * FMAX, 1.0])
    mean = q.sum_messages([q.encode(x, weight=1.0), q.encode(x, weight=3.0)], x.numel())
    assert torch.isfinite(mean).all(), mean
    levels = 2 ** (bits - 1) - 1
    assert ((mean.double() - x.double()).abs() <= FMAX / levels / 2 * (1 + 1e-6) + FMAX * 2**-22).all()
