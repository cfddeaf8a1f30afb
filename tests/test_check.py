"""The one numeric validation helper, and the learning-rate rules that use it (unit)."""
from __future__ import annotations

import math
import re

import pytest
import torch

import phalanx as px
from phalanx import check


@pytest.mark.parametrize("call, says", [
    (lambda: check.positive_int("every", 0, "Fix."), "every=0; expected an integer >= 1. Fix."),
    (lambda: check.positive_int("every", True, "Fix."), "every=True; expected an integer >= 1"),
    (lambda: check.integer("n", 2.0, "Fix."), "n=2.0; expected an integer >= 0"),
    (lambda: check.positive_float("lr", 0, "Fix."), "lr=0; expected a finite number > 0"),
    (lambda: check.positive_float("lr", math.inf, "Fix."), "lr=inf; expected a finite number > 0"),
    (lambda: check.positive_float("lr", "0.1", "Fix."), "lr='0.1'; expected a finite number > 0"),
    (lambda: check.fraction("Owner(ratio", 1.5, "Fix.", close=")"), "Owner(ratio=1.5); expected a fraction in (0, 1]"),
    (lambda: check.number("m", 1, "Fix.", low=0, high=1, low_open=False), "m=1; expected a number in [0, 1)"),
    (lambda: check.parse_float("PHALANX_TIMEOUT", "soon", "Fix."), "PHALANX_TIMEOUT='soon'; expected a number > 0"),
    (lambda: check.parse_float("PHALANX_TIMEOUT", "-3", "Fix."), "PHALANX_TIMEOUT='-3'; expected a number > 0"),
])
def test_each_check_refuses_with_one_line_naming_value_range_and_fix(call, says):
    with pytest.raises(px.ConfigError, match=re.escape(says)) as err:
        call()
    assert "\n" not in str(err.value)


def test_checks_return_the_value_as_int_or_float():
    assert check.positive_int("k", 3, "") == 3
    assert check.fraction("r", 1, "") == 1.0 and isinstance(check.fraction("r", 1, ""), float)
    assert check.number("m", 0, "", low=0, high=1, low_open=False) == 0.0
    assert check.parse_float("T", " 2.5 ", "") == 2.5


def lrs(scheduler: torch.optim.lr_scheduler.LambdaLR, n: int) -> list[float]:
    opt, out = scheduler.optimizer, []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def opt(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_starts_at_the_base_batch_lr_and_reaches_the_scaled_lr_as_goyal_et_al():
    target = px.scale_lr(0.1, base_batch=256, batch=2048)  # k = 8
    got = lrs(px.warmup(opt(target), steps=8, base_batch=256, batch=2048), 10)
    assert got[0] == pytest.approx(0.1) and got[7] == pytest.approx(0.8) and got[9] == pytest.approx(0.8)
    steps = [b - a for a, b in zip(got[:8], got[1:8])]
    assert steps == pytest.approx([0.1] * 7)  # a constant increment each step


def test_warmup_without_batches_wastes_no_step_at_lr_zero():
    assert lrs(px.warmup(opt(1.0), steps=4), 5) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert lrs(px.warmup(opt(1.0), steps=3, start_factor=0.1), 4) == pytest.approx([0.1, 0.55, 1.0, 1.0])


@pytest.mark.parametrize("call, says", [
    (lambda: px.warmup(opt(1.0), steps=0), "warmup(steps=0); expected an integer >= 1"),
    (lambda: px.warmup(opt(1.0), steps=4, start_factor=0.0), "start_factor=0.0); expected a fraction in (0, 1]"),
    (lambda: px.warmup(opt(1.0), steps=4, base_batch=256), "expected both base_batch and batch"),
    (lambda: px.scale_lr(-0.1, base_batch=256, batch=64), "scale_lr(lr=-0.1); expected a finite number > 0"),
])
def test_lr_rules_refuse_bad_input_in_one_line(call, says):
    with pytest.raises(px.ConfigError, match=re.escape(says)):
        call()
