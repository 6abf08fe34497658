"""What the read-time image check costs: every image of a data file decoded before any model
loads (`common.data.check_record_images`), against the header-only check it replaced.

    python -m eval.tools.bench_image_check --dir /tmp/photos --n 1000 --rounds 3

Makes `--n` photo-sized JPEGs (640 x 480, noise over colour gradients, quality 90: they
compress like photos, unlike flat test images) in `--dir` if they are not there, writes a
LLaVA JSON over them, then times in interleaved rounds: (a) the header only (`Image.open`,
the old check), (b) full decoding on one thread, (c) full decoding on the default workers
(the usable cores, at most 16). Prints wall and process CPU seconds per pass and per image
(median over rounds) and the wall ratios to (a); on a machine shared with other jobs the CPU
time is the better estimate of what an idle machine takes.
"""
import json
import os
import statistics
import time

import numpy as np
from PIL import Image

from common import data
from common.cli import entry_parser, number


def make_photos(folder, n, seed=0):
    """`n` 640 x 480 JPEGs in `folder` (photo_0000.jpg, ...); existing ones are kept."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:480, 0:640]
    for i in range(n):
        p = os.path.join(folder, f"photo_{i:04d}.jpg")
        if os.path.exists(p):
            continue
        c = rng.uniform(0, 1, (3, 3))
        base = np.stack([255 * (c[k, 0] * x / 640 + c[k, 1] * y / 480 + c[k, 2]) / (1 + c[k].sum()) for k in range(3)], -1)
        img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(p, quality=90)
    return [os.path.join(folder, f"photo_{i:04d}.jpg") for i in range(n)]


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--dir", default="/tmp/bench_photos", help="folder of the generated JPEGs (made if missing)")
    p.add_argument("--n", type=number(min=1), default=1000, help="number of images")
    p.add_argument("--rounds", type=number(min=1), default=3, help="interleaved rounds")
    a = p.parse_args(argv)
    files = make_photos(a.dir, a.n)
    path = os.path.join(a.dir, "photos.json")
    with open(path, "w") as f:
        json.dump([{"id": f"p{i}", "image": os.path.basename(fp), "conversations": [
            {"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "noise"}]}
            for i, fp in enumerate(files)], f)
    recs = data.read_llava_json(path, check_images=False)

    def header():
        for fp in files:
            Image.open(fp).close()

    arms = {"header only (old check)": header,
            "decoded, 1 thread": lambda: data.check_record_images(recs, path, workers=1, progress=False),
            f"decoded, {min(16, len(os.sched_getaffinity(0)))} workers": lambda: data.check_record_images(recs, path, progress=False)}
    times, cpu = {k: [] for k in arms}, {k: [] for k in arms}
    for _ in range(a.rounds):
        for k, fn in arms.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    ref = statistics.median(times["header only (old check)"])
    print(f"{a.n} JPEGs 640x480 ({sum(map(os.path.getsize, files)) / a.n / 1e3:.0f} kB each), median of {a.rounds} "
          f"interleaved rounds, {len(os.sched_getaffinity(0))} usable cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    for k, ts in times.items():
        m, c = statistics.median(ts), statistics.median(cpu[k])
        print(f"  {k:28s} wall {m:7.2f} s = {1e3 * m / a.n:6.2f} ms/image (x{m / ref:5.1f} the header check); "
              f"CPU {c:6.2f} s = {1e3 * c / a.n:5.2f} ms/image")


if __name__ == "__main__":
    main()
