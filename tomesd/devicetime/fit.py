"""Fitting the device-time model on the recorded profiles, and validating it leave-one-model-out:
`python -m tomesd.devicetime fit` writes tomesd/devicetime/rates.json and docs/device-model.md (and .json).

Each recorded configuration is traced on the meta device at the width, size, batch and dtype it ran at, with
today's code (a ToMe row recorded before a later change of ToMe's kernels is traced as ToMe is now: such a row is
flagged by its kernel counts and reported apart), but with mean merges scattered as the runs did (a merge taken as
a product, torch_backend's merge_pays_as_product, came after them: its classes are priced at their fitted rates
and checked when a GPU is next lent). The rates are one non-negative least-squares fit (`fit`) over every
(record, class), each row weighed by its forward's total (so a 300 ms forward does not outweigh a 40 ms one). The
validation fits without one model (an architecture at one size, on every GPU) and predicts its device-time ratios,
each configuration against the same run's baseline."""
from __future__ import annotations

import json
import statistics
from typing import Any, Dict, List, Optional, Tuple

from .model import Rates, predict
from .records import Record, load
from .trace import ATTENTION, BY_FLOPS, CLASSES, TERMS, Launch, TraceRefused

Key = Tuple[Tuple[Tuple[str, Any], ...], str]


def traced(records: List[Record]) -> Tuple[Dict[Key, List[Launch]], Dict[Key, str]]:
    """({(settings, label): launches}, {(settings, label): why it could not be traced})."""
    from ..backends.torch import scattered_merges
    from ..bench.forward_trace import ForwardTracer

    launches: Dict[Key, List[Launch]] = {}
    refused: Dict[Key, str] = {}
    by_settings: Dict[Any, List[str]] = {}
    for r in records:
        by_settings.setdefault(r.settings, [])
        if r.label not in by_settings[r.settings]:
            by_settings[r.settings].append(r.label)
    for settings, labels in by_settings.items():
        tracer = ForwardTracer(dict(settings))
        for label in labels:
            try:
                with scattered_merges():  # the recorded runs' merges were scatters (products came after them)
                    launches[(settings, label)] = tracer.launches(label)
            except TraceRefused as exc:
                refused[(settings, label)] = str(exc)
    return launches, refused


# The fit's columns: the shared floor, then each class's work terms (trace.Launch's fields), in units that keep
# them comparable (GFLOP, MB, million pairs).
COLUMNS = [("floor", None)] + [(cls, "flops") for cls in BY_FLOPS] + [(term, "bytes") for term in TERMS] \
    + [(ATTENTION, "scores")]
_UNIT = {"flops": 1e9, "bytes": 1e6, "scores": 1e6}


def _rows(records: List[Record], launches: Dict[Key, List[Launch]], scale: Dict[str, Tuple[float, float]]
          ) -> Tuple[List[List[float]], List[float]]:
    """The least-squares rows: one per (record, class), its columns (COLUMNS) over the forward's total time, each
    GPU's columns times its (compute, memory) scale against the reference GPU."""
    rows, ys = [], []
    for r in records:
        key = (r.settings, r.label)
        if key not in launches:
            continue
        compute, memory = scale[r.gpu]
        measured = dict(r.by_class)
        for cls in CLASSES:
            mine = [l for l in launches[key] if l.cls == cls]
            row = []
            for owner, work in COLUMNS:
                if work is None:
                    row.append(len(mine) * memory)
                elif work == "bytes":
                    row.append(sum(l.bytes for l in mine if l.term == owner) / _UNIT[work] * memory)
                elif work == "flops":
                    row.append(sum(l.padded_flops or l.flops for l in mine) / _UNIT[work] * compute
                               if owner == cls else 0.0)
                else:
                    row.append(sum(getattr(l, work) for l in mine) / _UNIT[work] * compute if owner == cls else 0.0)
            rows.append([v / r.total_ms for v in row])
            ys.append(measured[cls] / r.total_ms)
    return rows, ys


def _rates(gpu: str, coef: Any, compute: float, memory: float) -> Rates:
    got = {column: float(c) / (_UNIT[column[1]] if column[1] else 1.0) for column, c in zip(COLUMNS, coef)}
    return Rates(gpu, got[("floor", None)] * memory, {cls: got[(cls, "flops")] * compute for cls in BY_FLOPS},
                 {term: got[(term, "bytes")] * memory for term in TERMS}, got[(ATTENTION, "scores")] * compute)


REFERENCE_GPU = "h100"


def fit(records: List[Record], launches: Dict[Key, List[Launch]]) -> Dict[str, Rates]:
    """Every GPU's rates, from one non-negative least-squares fit over every (record, class), each row weighed by
    its forward's total time. The reference GPU's rates are fitted; another GPU's are the reference's times two
    scales of its own, one for the compute terms (FLOPs, attention's pairs) and one for the memory terms (bytes, the
    floor), so a model profiled on one GPU alone still informs the other's rates. The two steps alternate
    (rates with the scales fixed, then the scales with the rates fixed) three times. The floor per kernel is shared by
    every class: within one class, kernels of a model all scale together, so its own rows cannot tell its floor
    from its rate."""
    import numpy as np
    from scipy.optimize import nnls

    gpus = sorted({r.gpu for r in records})
    scale = {gpu: (1.0, 1.0) for gpu in gpus}
    coef = None
    for _ in range(3):
        rows, ys = _rows(records, launches, scale)
        coef, _ = nnls(np.array(rows), np.array(ys))
        for gpu in gpus:
            if gpu == REFERENCE_GPU:
                continue
            base = _rates(gpu, coef, 1.0, 1.0)
            parts, targets = [], []
            for r in records:
                if r.gpu != gpu or (r.settings, r.label) not in launches:
                    continue
                compute = sum(base.compute_ms(l) for l in launches[(r.settings, r.label)])
                memory = sum(base.kernel_ms(l) for l in launches[(r.settings, r.label)]) - compute
                parts.append([compute / r.total_ms, memory / r.total_ms])
                targets.append(1.0)
            if parts:
                found, _ = nnls(np.array(parts), np.array(targets))
                scale[gpu] = (float(found[0]) or 1.0, float(found[1]) or 1.0)
    return {gpu: _rates(gpu, coef, *scale[gpu]) for gpu in gpus}


def ratio_errors(records: List[Record], launches: Dict[Key, List[Launch]], rates: Rates) -> List[Dict[str, Any]]:
    """Each traced configuration of `records` (one GPU) against its run's baseline: measured and predicted
    device-time ratios and the relative error, and per class the predicted minus measured time, as a share of the
    measured forward."""
    rows = []
    baselines = {r.path: r for r in records if r.label == "baseline"}
    for r in records:
        base = baselines.get(r.path)
        if r.label == "baseline" or base is None or (r.settings, r.label) not in launches \
                or (base.settings, "baseline") not in launches:
            continue
        mine, theirs = predict(launches[(r.settings, r.label)], rates), predict(launches[(base.settings, "baseline")], rates)
        measured, predicted = base.total_ms / r.total_ms, theirs.total_ms / mine.total_ms
        rows.append({"run": r.path, "gpu": r.gpu, "model": r.model, "configuration": r.label,
                     "measured_ms": r.total_ms, "predicted_ms": mine.total_ms,
                     "baseline_measured_ms": base.total_ms, "baseline_predicted_ms": theirs.total_ms,
                     "measured_ratio": measured, "predicted_ratio": predicted, "error": predicted / measured - 1,
                     "code_divergence": r.code_divergence(launches[(r.settings, r.label)]),
                     "class_error": {cls: (mine.by_class[cls] - dict(r.by_class)[cls]) / r.total_ms for cls in CLASSES}})
    return rows


def validate(records: List[Record], launches: Dict[Key, List[Launch]]) -> List[Dict[str, Any]]:
    """Leave one model out: the held-out model's ratios on every GPU, predicted from a fit on the other models."""
    rows = []
    for model in sorted({r.model for r in records}):
        rates = fit([r for r in records if r.model != model], launches)
        for gpu, mine in rates.items():
            rows += ratio_errors([r for r in records if r.model == model and r.gpu == gpu], launches, mine)
    return rows


# A record whose kernels differ from today's code's by more than this share was profiled on code since changed.
STALE = 0.3


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The validation's errors over the rows of today's code (code_divergence <= STALE), and over all of them."""
    def errors(which: List[Dict[str, Any]]) -> Dict[str, Any]:
        e = [abs(r["error"]) for r in which]
        return {"configurations": len(which), "mean_abs_ratio_error": statistics.mean(e) if e else None,
                "max_abs_ratio_error": max(e) if e else None,
                "mean_abs_class_error_share": {cls: statistics.mean(abs(r["class_error"][cls]) for r in which)
                                               for cls in CLASSES} if which else {}}

    current = [r for r in rows if r["code_divergence"] <= STALE]
    return {**errors(current), "all_rows": errors(rows),
            "stale_rows": [f"{r['run']}: {r['configuration']}" for r in rows if r["code_divergence"] > STALE]}


def main(root: str = "docs/gpu", rates_path: Optional[str] = None, report: str = "docs/device-model") -> int:
    from .model import RATES_PATH

    records = load(root)
    launches, refused = traced(records)
    rows = validate(records, launches)
    table = {"fitted_on": sorted({r.path for r in records}),
             "gpus": {gpu: rates.as_dict() for gpu, rates in fit(records, launches).items()},
             "validation": summary(rows)}
    with open(rates_path or RATES_PATH, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    with open(report + ".json", "w") as f:
        json.dump({"validation": rows, "summary": table["validation"], "refused": [
            {"settings": dict(k[0]), "configuration": k[1], "why": why} for k, why in refused.items()]}, f, indent=1)
    text = _markdown(records, rows, refused, table)
    with open(report + ".md", "w") as f:
        f.write(_HEADER + text + "\n")
    print(text)
    return 0


_HEADER = """# The device-time model: validation

Written by `python -m tomesd.devicetime fit` (the fit and this report; rates in `tomesd/devicetime/rates.json`).
How the model works and what it assumes: [device-time.md](device-time.md). Each row: one profiled configuration,
its device-time ratio against the same run's baseline as measured (torch.profiler, docs/gpu/) and as predicted
by a fit that left the row's model (architecture and size) out on every GPU. The last column compares the kernels
the profile lists with those today's code launches: past 30%, the row was profiled on code since changed, and it
is left out of the first error figure.

"""


def _markdown(records: List[Record], rows: List[Dict[str, Any]], refused: Dict[Key, str], table: Dict[str, Any]) -> str:
    s = table["validation"]
    every = s["all_rows"]
    untraced = sum(1 for r in records if (r.settings, r.label) in refused)
    lines = [f"{len(records)} profiled configurations in {len({r.path for r in records})} runs; {untraced} of them "
             f"not traceable on the meta device; {every['configurations']} ratios against their run's baseline "
             f"validated, {s['configurations']} of them on the kernels today's code launches.",
             f"Leave-one-model-out device-time ratio error, today's code: mean {100 * s['mean_abs_ratio_error']:.1f}%, "
             f"worst {100 * s['max_abs_ratio_error']:.1f}%; every row: mean {100 * every['mean_abs_ratio_error']:.1f}%, "
             f"worst {100 * every['max_abs_ratio_error']:.1f}%.", "",
             "| GPU | run | configuration | measured ratio | predicted | error | kernels unlike today's |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpu']} | {r['run']} | {r['configuration']} | {r['measured_ratio']:.3f}x | "
                     f"{r['predicted_ratio']:.3f}x | {100 * r['error']:+.1f}% | {100 * r['code_divergence']:.0f}% |")
    lines += ["", "Per class, the mean absolute error of its predicted time, as a share of the measured forward:", "",
              "| class | " + " | ".join(CLASSES) + " |", "|---" * (len(CLASSES) + 1) + "|",
              "| error | " + " | ".join(f"{100 * s['mean_abs_class_error_share'][c]:.1f}%" for c in CLASSES) + " |"]
    lines += ["", "Not traceable on the meta device:", ""] + [f"- {k[1]} ({dict(k[0])['config']}): {why}"
                                                               for k, why in refused.items()]
    return "\n".join(lines)
