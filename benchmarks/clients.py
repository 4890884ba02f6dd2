"""Time per forward of a real client: all-MiniLM-L6-v2 on CPU, unpatched against fused.

    python benchmarks/clients.py                      # batches 1x16 and 32x128, 200 repeats
    python benchmarks/clients.py --shapes 8x64 --repeats 500 --backend numba --threads 1

The fused model is the one tests/fused/test_fused_clients.py checks: each ``BertSelfOutput`` and
``BertOutput`` computes ``LayerNorm(dropout(dense(h)) + input)`` as one
``normlab.add_layer_norm(..., return_residual=False)``
(``tests.support.transformer_models.fuse_bert_outputs``). Both models run under
``torch.inference_mode`` on the same token ids; each repeat times one forward of each, in
alternating order (interleaved, so drifts in machine load hit both alike), after untimed warm-up
forwards. Reported: the median and interquartile range per forward, and the ratio of the medians,
with the load average before and after (a shared machine's numbers are only as good as its load).
Needs the ``models`` extra.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import torch

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the patch the tests check: tests/support/transformer_models.py

from tests.support.transformer_models import fuse_bert_outputs, load_minilm  # noqa: E402

DEFAULT_SHAPES: Final = ((1, 16), (32, 128))
WARMUP: Final = 5


def token_batch(model: Any, batch: int, seq: int) -> dict[str, Any]:
    """Random token ids (seeded) of ``batch`` x ``seq`` with a full attention mask."""
    generator = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(1000, model.config.vocab_size, (batch, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def time_interleaved(
    models: dict[str, Any], inputs: dict[str, Any], repeats: int
) -> dict[str, list[float]]:
    """Seconds per forward of each model, ``repeats`` times, the order alternating per repeat."""
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for _ in range(WARMUP):
            for name in names:
                models[name](**inputs)
        for repeat in range(repeats):
            for name in names if repeat % 2 == 0 else reversed(names):
                start = time.perf_counter()
                models[name](**inputs)
                times[name].append(time.perf_counter() - start)
    return times


def summary(seconds: list[float]) -> tuple[float, float]:
    """Median and interquartile range."""
    q1, median, q3 = statistics.quantiles(seconds, n=4)
    return median, q3 - q1


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, load both models, print a line per batch shape (as it is done)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=[f"{b}x{s}" for b, s in DEFAULT_SHAPES])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--backend", default=None, help="normlab backend (default: its choice)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: its)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as hf_home:
        model, _ = load_minilm(Path(hf_home))
    fused = copy.deepcopy(model)
    fuse_bert_outputs(fused, args.backend)
    models = {"unpatched": model, "fused": fused}
    print(f"all-MiniLM-L6-v2 forward on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, normlab backend {args.backend or 'its choice'}; "
          f"load average before: {os.getloadavg()}")  # fmt: skip
    print(f"{'batch':>10} {'unpatched ms':>14} {'fused ms':>14} {'speed-up':>9}  max |diff|",
          flush=True)  # fmt: skip
    for shape in args.shapes:
        batch, seq = (int(n) for n in shape.split("x"))
        inputs = token_batch(model, batch, seq)
        with torch.inference_mode():
            diff = (model(**inputs).last_hidden_state - fused(**inputs).last_hidden_state).abs()
        times = time_interleaved(models, inputs, args.repeats)
        (base, base_iqr), (ours, ours_iqr) = (summary(times[name]) for name in models)
        print(f"{shape:>10} {base * 1e3:8.3f} ±{base_iqr * 1e3:5.3f} "
              f"{ours * 1e3:8.3f} ±{ours_iqr * 1e3:5.3f} {base / ours:8.3f}×  "
              f"{float(diff.max()):.2e}", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()} (± is the interquartile range; "
          f"{args.repeats} interleaved repeats per model)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
