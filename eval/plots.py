"""Pillow-only figures for the toys: bar charts with confidence intervals and line plots.

    bar_ci_png([("MoD", 0.21, 0.19, 0.23), ...], "out/x.png", title="...", ylabel="error")
    line_png({"switch rate": [(1, 0.8), (4, 0.3)]}, "out/y.png", xlabel="W", ylabel="rate", logx=True)

Files are written atomically (`common.data.atomic_target`). No matplotlib: nothing beyond the
repository's run-time dependencies.
"""
import math

from PIL import Image, ImageDraw

from common.data import atomic_target

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def _save(img, path):
    with atomic_target(path) as tmp:
        img.save(tmp, format="PNG")
    return path


def _ticks(lo, hi, n=5):
    """About n round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (m * step) <= n:
            step *= m
            break
    t = math.floor(lo / step) * step
    out = []
    while t <= hi + 1e-12:
        out.append(round(t, 10))
        t += step
    return out


def bar_ci_png(bars, path, title="", ylabel="", width=640, height=360, ymin=None):
    """Bar chart with error bars. bars: [(label, value, ci_low, ci_high)] (CI may be None).
    Writes `path` (PNG) and returns it."""
    lo = min([0.0] + [b[2] if b[2] is not None else b[1] for b in bars]) if ymin is None else ymin
    hi = max(b[3] if b[3] is not None else b[1] for b in bars) * 1.1 or 1.0
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 60, 10, 30, 70
    ph, pw = height - top - bottom, width - left - right
    y = lambda v: top + ph * (1 - (v - lo) / (hi - lo))
    d.text((left, 8), title, fill="black")
    d.text((4, top - 14), ylabel, fill="black")
    for t in _ticks(lo, hi):
        d.line([left - 4, y(t), width - right, y(t)], fill=(225, 225, 225))
        d.text((4, y(t) - 6), f"{t:g}", fill="black")
    d.line([left, top, left, top + ph], fill="black")
    slot = pw / max(1, len(bars))
    for i, (label, v, cl, ch) in enumerate(bars):
        x0, x1 = left + i * slot + slot * 0.15, left + (i + 1) * slot - slot * 0.15
        d.rectangle([x0, y(v), x1, y(max(lo, 0.0))], fill=COLOURS[i % len(COLOURS)])
        if cl is not None and ch is not None:
            xm = (x0 + x1) / 2
            d.line([xm, y(cl), xm, y(ch)], fill="black", width=2)
            d.line([xm - 5, y(cl), xm + 5, y(cl)], fill="black", width=2)
            d.line([xm - 5, y(ch), xm + 5, y(ch)], fill="black", width=2)
        d.text((x0, y(v) - 12), f"{v:.3f}", fill="black")
        for k, part in enumerate(label.split("\n")):
            d.text((x0, top + ph + 6 + 12 * k), part, fill="black")
    return _save(img, path)


def line_png(series, path, title="", xlabel="", ylabel="", logx=False, width=640, height=360, points=None):
    """Line plot. series: {name: [(x, y)] or [(x, y, ci_low, ci_high)]}; points: optional
    {name: (x, y)} drawn as single markers (e.g. a variant that is not on the swept axis).
    Writes `path` (PNG) and returns it."""
    allp = [p for s in series.values() for p in s] + list((points or {}).values())
    fx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    xs = [fx(p[0]) for p in allp]
    ys = [p[1] for p in allp] + [p[3] for p in allp if len(p) > 3 and p[3] is not None]
    xlo, xhi = min(xs), max(xs)
    xhi = xhi if xhi > xlo else xlo + 1
    ylo, yhi = min(0.0, min(ys)), max(ys) * 1.1 or 1.0
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 60, 150, 30, 40
    ph, pw = height - top - bottom, width - left - right
    X = lambda v: left + pw * (fx(v) - xlo) / (xhi - xlo)
    Y = lambda v: top + ph * (1 - (v - ylo) / (yhi - ylo))
    d.text((left, 8), title, fill="black")
    d.text((4, top - 14), ylabel, fill="black")
    d.text((left + pw // 2 - 20, height - 16), xlabel, fill="black")
    for t in _ticks(ylo, yhi):
        d.line([left - 4, Y(t), left + pw, Y(t)], fill=(225, 225, 225))
        d.text((4, Y(t) - 6), f"{t:g}", fill="black")
    for v in sorted({p[0] for p in allp}):
        d.text((X(v) - 6, top + ph + 6), f"{v:g}", fill="black")
    d.line([left, top, left, top + ph, left + pw, top + ph], fill="black")
    for i, (name, pts) in enumerate(list(series.items()) + [(k, [v]) for k, v in (points or {}).items()]):
        c = COLOURS[i % len(COLOURS)]
        pts = sorted(pts)
        if len(pts) > 1:
            d.line([(X(p[0]), Y(p[1])) for p in pts], fill=c, width=2)
        for p in pts:
            d.ellipse([X(p[0]) - 4, Y(p[1]) - 4, X(p[0]) + 4, Y(p[1]) + 4], fill=c)
            if len(p) > 3 and p[2] is not None:
                d.line([X(p[0]), Y(p[2]), X(p[0]), Y(p[3])], fill=c, width=1)
        d.rectangle([left + pw + 10, top + 16 * i + 2, left + pw + 20, top + 16 * i + 12], fill=c)
        d.text((left + pw + 24, top + 16 * i), name, fill="black")
    return _save(img, path)
