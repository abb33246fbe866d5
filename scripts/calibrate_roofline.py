"""Fits the roofline's efficiencies (engine/cost/roofline.py, `Efficiency`) to the measured GPU
tables (engine/cost/gpus/), one set for every GPU, and prints how far the fitted kernels are from
each table: worst relative error in step time and in the price of drafts (a step's time over
the same requests' 1-token step), from 8 requests up, rows whose attention the tables' note calls
slower than a serving engine's left out. Also prints the same for the datasheet roofline (before
calibration), the efficiencies in force and the measured profiles themselves (the tables fitted
by the one fitting routine).

Minimises the largest error (a soft maximum), from a least-squares start; physical bounds: no
efficiency above the datasheet. Needs scipy (not a dependency of agentaccel).

    python scripts/calibrate_roofline.py
"""

from __future__ import annotations

from dataclasses import astuple, fields

import numpy as np
from scipy.optimize import least_squares, minimize

from agentaccel.engine.cost import measured, parse, roofline

NAMES = [f.name for f in fields(roofline.Efficiency)]
SCALE = {"layer_latency": 1e-6, "request_latency": 1e-6}  # fitted in microseconds
LOWER = {"layer_latency": 0, "weights": 0.1, "compute": 0.1, "hidden": 0.0, "knee": 1.0, "kv": 0.1,
         "attention": 0.05, "request_latency": 0.0}
UPPER = {"layer_latency": 200, "weights": 1.0, "compute": 1.0, "hidden": 1.0, "knee": 50.0, "kv": 1.0,
         "attention": 1.0, "request_latency": 10.0}


# The roofline before calibration: 80 % of HBM bandwidth and 60 % of tensor FLOP/s, each part at
# the slower of memory and compute (a knee this sharp is a max to within 1.4 %), no latency terms.
DATASHEET = roofline.Efficiency(layer_latency=0.0, weights=0.8, compute=0.6, hidden=1.0, knee=50.0, kv=0.8,
                                attention=0.6, request_latency=0.0)


def tables() -> dict[str, list[tuple[int, int, int, float]]]:
    return {name: measured.rows_of(measured.load(measured.FOLDER / f"{name}.json")) for name in measured.bundled()}


def errors(model_of, data) -> list[tuple[float, str]]:
    """(log error, what) of every kept row's time and draft price."""
    out = []
    for name, rows in data.items():
        model = model_of(name)

        def step(b, ctx, q, model=model):
            return float(model.seconds(b * q, b * ctx, b * q * ctx, b))

        plain = {(b, c): s for b, c, q, s in rows if q == 1}
        for b, ctx, q, seconds in rows:
            if b < 8 or not measured.like_a_serving_engine(b, ctx):
                continue
            out.append((np.log(step(b, ctx, q) / seconds), f"{name} time B={b} L={ctx} q={q}"))
            if q > 1 and (b, ctx) in plain:
                price = step(b, ctx, q) / step(b, ctx, 1)
                out.append((np.log(price / (seconds / plain[(b, ctx)])), f"{name} price B={b} L={ctx} q={q}"))
    return out


def efficiency(theta) -> roofline.Efficiency:
    return roofline.Efficiency(**{n: v * SCALE.get(n, 1.0) for n, v in zip(NAMES, theta, strict=True)})


def kernels(eff: roofline.Efficiency):
    return lambda name: roofline.Roofline(roofline.profile(name).model, roofline.profile(name).gpu, eff).kernel_model()


def report(title: str, errs) -> None:
    worst = sorted(errs, key=lambda e: -abs(e[0]))[:3]
    times = max(abs(e) for e, what in errs if " time " in what)
    prices = max(abs(e) for e, what in errs if " price " in what)
    print(f"{title}: worst step time off by {np.expm1(times):.1%}, worst draft price by {np.expm1(prices):.1%}; "
          + "; ".join(f"{what} {np.expm1(e):+.1%}" for e, what in worst))


def main() -> None:
    data = tables()
    lo = [LOWER[n] for n in NAMES]
    hi = [UPPER[n] for n in NAMES]
    start = [v / SCALE.get(n, 1.0) for n, v in zip(NAMES, astuple(roofline.CALIBRATED), strict=True)]
    residuals = lambda theta: np.asarray([e for e, _ in errors(kernels(efficiency(theta)), data)])  # noqa: E731
    fit = least_squares(residuals, start, bounds=(lo, hi))
    soft_max = lambda theta: np.log(np.sum(np.exp(60 * np.abs(residuals(np.clip(theta, lo, hi)))))) / 60  # noqa: E731
    best = np.clip(minimize(soft_max, fit.x, method="Nelder-Mead",
                            options={"maxiter": 20000, "xatol": 1e-7, "fatol": 1e-10}).x, lo, hi)
    print("fitted:", ", ".join(f"{n}={v * SCALE.get(n, 1.0):.4g}" for n, v in zip(NAMES, best, strict=True)))
    report("fitted", errors(kernels(efficiency(best)), data))
    report("datasheet (before calibration)", errors(kernels(DATASHEET), data))
    report("in force (roofline.CALIBRATED)", errors(kernels(roofline.CALIBRATED), data))
    report("measured profiles (the tables fitted, host work left out)",
           errors(lambda name: parse(name).model.with_overhead(-parse(name).overhead), data))


if __name__ == "__main__":
    main()
