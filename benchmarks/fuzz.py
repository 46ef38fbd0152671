"""The differential fuzzer's long run: draw setups, train each with pipekernel and with one
process (tests/fuzzing.py), print what was covered and every failure with its reproducer.

    python benchmarks/fuzz.py --setups 200 --seed 1         # a run
    python benchmarks/fuzz.py --replay '{"stages": 2, ...}' # one setup again (its JSON)

The same ``--setups`` and ``--seed`` draw the same setups. The first failure is shrunk by
hypothesis to a minimal setup (each smaller candidate is a run of its own: at most
``--shrink-budget``); see docs/fuzzing.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzzing  # noqa: E402  (tests/fuzzing.py, after the path above)


def _report(setup: dict, verdict: tuple[str, str]) -> str:
    return (f"--- {verdict[0]}\nreproducer: python benchmarks/fuzz.py --replay "
            f"'{fuzzing.key(setup)}'\n{verdict[1].rstrip()}\n")


def run(count: int, seed: int, batch: int, shrink_budget: int) -> int:
    start = time.time()
    setups = fuzzing.draw_setups(seed, count)
    print(f"seed {seed}: {len(setups)} distinct setups of {count} drawn", flush=True)
    verdicts: dict[str, tuple[str, str]] = {}
    for first in range(0, len(setups), batch):
        part = setups[first:first + batch]
        outcomes = fuzzing.run_setups(part)
        for setup in part:
            verdicts[fuzzing.key(setup)] = fuzzing.judge(setup, outcomes[fuzzing.key(setup)])
        done = first + len(part)
        bad = sum(v[0] in ("mismatch", "error") for v in verdicts.values())
        print(f"  {done}/{len(setups)} run, {bad} failing, {time.time() - start:.0f} s",
              flush=True)
    failures = [s for s in setups if verdicts[fuzzing.key(s)][0] in ("mismatch", "error")]
    print(fuzzing.summary(setups, verdicts))
    for setup in failures:
        print(_report(setup, verdicts[fuzzing.key(setup)]))
    if failures and shrink_budget:
        found = fuzzing.minimise(seed, count, verdicts, shrink_budget)
        if found is not None:
            print("minimal failing setup (hypothesis shrink):")
            print(_report(*found))
    print(f"{len(setups)} setups, {len(failures)} failing, {time.time() - start:.0f} s")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", type=int, default=50, help="setups to draw")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the draw")
    parser.add_argument("--batch", type=int, default=20,
                        help="setups per round of process worlds (progress is printed after each)")
    parser.add_argument("--shrink-budget", type=int, default=40,
                        help="most candidate setups run while shrinking a failure (0: none)")
    parser.add_argument("--replay", metavar="JSON", help="run this one setup and print its verdict")
    args = parser.parse_args()
    if args.replay:
        setup = json.loads(args.replay)
        verdict = fuzzing.judge(setup, fuzzing.run_setups([setup])[fuzzing.key(setup)])
        print(_report(setup, verdict))
        return 0 if verdict[0] in ("ok", "refused") else 1
    return run(args.setups, args.seed, args.batch, args.shrink_budget)


if __name__ == "__main__":
    sys.exit(main())
