"""Shapes the core is checked on: (B, h, w, sx, sy, r) with odd batches, batch 1, grids that do not
divide by the stride, sx != sy, r = 0 and r beyond the src set."""
CASES = [
    (2, 8, 8, 2, 2, 32),
    (1, 8, 8, 2, 2, 20),
    (3, 7, 9, 2, 2, 25),
    (2, 9, 7, 3, 2, 30),
    (2, 6, 10, 1, 3, 20),
    (2, 8, 8, 2, 2, 0),
    (2, 8, 8, 2, 2, 1000),
    (2, 5, 5, 4, 4, 10),
    (2, 32, 32, 2, 2, 512),
]
