"""The gating fuzz run: the committed corpus, then a seeded search of fixed length.

libFuzzer's search is steered by coverage, and a little of normlab's coverage depends on memory
addresses (hashes of types and objects), so two runs with one seed drift apart after a few
hundred inputs. This run takes no feedback: it replays every input of the corpus folders, then
runs ``--runs`` inputs made from them by seeded mutations (byte changes, inserts, erasures,
splices of two inputs, fresh random tails). The inputs depend on the corpus and ``--seed``
alone, so one commit always gets one verdict. Each input goes through the harness of
``fuzz_validation.py``; the first failure is written to ``--artifacts`` as ``crash-<sha1>``
with the call it decodes to, and the exit status is 1. An input still running after
``--timeout`` seconds (a hang) ends the run with every thread's traceback.

    python fuzz/replay.py --seed 20261201 --runs 60000 --artifacts DIR fuzz/corpus
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def corpus_inputs(folders: list[Path]) -> list[bytes]:
    """Every file below ``folders``, in name order (the order is part of the verdict)."""
    files = sorted(p for folder in folders for p in folder.rglob("*") if p.is_file())
    return [p.read_bytes() for p in files]


def mutate(rng: random.Random, corpus: list[bytes]) -> bytes:
    """One input made from the corpus by one to four seeded mutations."""
    data = bytearray(rng.choice(corpus))
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(5)
        if kind == 0 and data:  # change a byte
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        elif kind == 1:  # insert random bytes
            at = rng.randint(0, len(data))
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif kind == 2 and len(data) > 1:  # erase a range
            at = rng.randrange(len(data))
            del data[at : at + rng.randint(1, 8)]
        elif kind == 3:  # splice: the head of this input, the tail of another
            other = rng.choice(corpus)
            data = data[: rng.randint(0, len(data))] + other[rng.randint(0, len(other)) :]
        else:  # a fresh random tail: new choices where the decoder reads from the end
            data += rng.randbytes(rng.randint(1, 16))
    return bytes(data)


def run(
    corpus: list[bytes],
    seed: int,
    runs: int,
    one_input: Callable[[bytes], None],
    timeout: float = 120.0,
) -> tuple[int, bytes | None, str]:
    """Replay ``corpus`` then ``runs`` mutations; stops at the first input that raises.

    Returns (inputs run, the failing input or None, its traceback).
    """
    rng = random.Random(seed)
    count = 0
    for data in [*corpus, *(mutate(rng, corpus) for _ in range(runs))]:
        count += 1
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            one_input(data)
        except Exception:
            return count, data, traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
    return count, None, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", nargs="+", type=Path, help="folders of inputs to replay")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True, help="mutated inputs after replay")
    parser.add_argument("--artifacts", type=Path, required=True, help="where a crash is written")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per input")
    args = parser.parse_args()
    corpus = corpus_inputs(args.corpus)
    if not corpus:
        print(f"no inputs in {', '.join(map(str, args.corpus))}", file=sys.stderr)
        return 2
    import fuzz_validation  # the harness: atheris and the instrumented normlab

    start = time.perf_counter()
    count, failing, trace = run(
        corpus, args.seed, args.runs, fuzz_validation.test_one_input, args.timeout
    )
    seconds = time.perf_counter() - start
    if failing is None:
        print(
            f"fuzz: {count} inputs ({len(corpus)} replayed), seed {args.seed}: no finding "
            f"({seconds:.0f} s)"
        )
        return 0
    args.artifacts.mkdir(parents=True, exist_ok=True)
    path = args.artifacts / f"crash-{hashlib.sha1(failing).hexdigest()}"
    path.write_bytes(failing)
    print(trace, file=sys.stderr)
    print(f"fuzz: input {count} (seed {args.seed}) failed; written to {path}", file=sys.stderr)
    print(
        f"rerun it: NORMLAB_FUZZ_VERBOSE=1 python fuzz/fuzz_validation.py {path}", file=sys.stderr
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
