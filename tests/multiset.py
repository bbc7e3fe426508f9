"""Comparing merged token sets, whose row order is an implementation detail."""
import numpy as np


def assert_same_rows(a: np.ndarray, b: np.ndarray, tol: float) -> None:
    """Each batch of `a` [B, M, C] holds the rows of `b` up to `tol`, one for one (a bijection)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    for a_rows, b_rows in zip(a, b):
        dist = np.abs(a_rows[:, None, :] - b_rows[None, :, :]).max(-1)
        nearest = dist.argmin(1)
        assert len(set(nearest.tolist())) == len(nearest), "rows do not pair up one for one"
        worst = dist[np.arange(len(nearest)), nearest].max(initial=0.0)
        assert worst <= tol * (1 + np.abs(b_rows).max(initial=0.0)), f"row mismatch {worst}"
