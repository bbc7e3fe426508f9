"""How many samples the Frechet distance needs before it separates settings: `python -m tomesd quality
--fd-curve 64,128,...`. FD's estimate moves with the sample count (it is biased upwards at small counts)
and with the noise the samples came from, so a difference between two settings' FDs means something only
where it exceeds what the baseline's FD does across noise seeds at the same count. This measures both over
growing prefixes of the same samples (labels cycle 0-9, so every prefix is balanced to within one sample per digit)
and names, for each setting, the smallest count from which FD resolves it from the baseline."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from . import metrics


def curve(samples: Dict[str, Any], baselines: Sequence[Any], classifier: Any, real_features: Any,
          counts: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per count n: the baseline's FD (first of `baselines`, from the same noise as `samples`), the
    band (largest |FD difference| between it and the baselines from other noise, all on their first n
    samples), and each setting's FD minus the baseline's, with whether it exceeds the band."""
    if len(baselines) < 2:
        raise ValueError("the FD curve needs the baseline from at least two noise seeds")
    rows = []
    for n in counts:
        fd = lambda x: metrics.frechet_distance(metrics.features(classifier, x[:n]), real_features)  # noqa: E731
        base = [fd(b) for b in baselines]
        band = max(abs(b - base[0]) for b in base[1:])
        diffs = {name: fd(x) - base[0] for name, x in samples.items()}
        rows.append({"n": n, "baseline_fd": base[0], "band": band, "diffs": diffs,
                     "resolved": {name: abs(d) > band for name, d in diffs.items()}})
    return rows


def resolved_from(rows: List[Dict[str, Any]], name: str) -> Optional[int]:
    """The smallest count from which `name`'s FD difference exceeds the band at every larger count measured;
    None if it does not at the largest."""
    found = None
    for row in reversed(rows):
        if not row["resolved"][name]:
            break
        found = row["n"]
    return found


def table(rows: List[Dict[str, Any]]) -> str:
    names = list(rows[0]["diffs"])
    lines = ["| samples | baseline FD | FD band across noise seeds | " + " | ".join(f"{n}: FD - baseline's" for n in names)
             + " |", "|---|---|---|" + "---|" * len(names)]
    for row in rows:
        cells = [f"{row['diffs'][n]:+.2f}" + (" (resolved)" if row["resolved"][n] else "") for n in names]
        lines.append(f"| {row['n']} | {row['baseline_fd']:.2f} | ±{row['band']:.2f} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in names:
        n = resolved_from(rows, name)
        lines.append(f"{name}: " + (f"FD resolves it from the baseline from {n} samples on" if n is not None else
                                    f"FD does not resolve it from the baseline at up to {rows[-1]['n']} samples"))
    return "\n".join(lines)
