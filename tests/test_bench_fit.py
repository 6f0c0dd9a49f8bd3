"""``memsave bench --fit``: the search for the largest model that fits, and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from memsave.bench.fit import FitOptions, largest_fitting, run_fit_bench


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 9, 31, 100, 250])
@pytest.mark.parametrize("start", [1, 4, 64])
def test_largest_fitting_brackets_the_limit(limit: int, start: int) -> None:
    tried: list[int] = []

    def fits(n: int) -> dict | None:
        tried.append(n)
        return {"n": n} if n <= limit else None

    n, best, trials = largest_fitting(fits, start, most=1024)
    assert trials == len(tried) == len(set(tried))  # never the same size twice
    assert n <= limit and best == {"n": n}
    assert limit - n <= max(1, n // 16), (limit, n)  # within 1/16 of the limit
    assert trials <= 2 * (limit.bit_length() + 6)


def test_largest_fitting_stops_at_most_and_reports_none_fitting() -> None:
    assert largest_fitting(lambda n: {"n": n}, 4, most=48)[:2] == (48, {"n": 48})
    assert largest_fitting(lambda n: None, 4, most=48)[:2] == (0, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on machines without CUDA")
def test_fit_bench_needs_cuda() -> None:
    with pytest.raises(NotImplementedError, match="needs one"):
        run_fit_bench(["zero3-bf16"], FitOptions())
