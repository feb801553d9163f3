"""Run an exercise's checker: `python -m tutorials.check N` (your file) or `python -m tutorials.check N --solution`.

Exit status 0 when every check passes, 1 when one fails or the exercise is not written yet.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import importlib

import torch

from tutorials.exercises.checkers import CHECKS

EXERCISES = Path(__file__).resolve().parent / "exercises"


def exercise_module(n: int, solution: bool):
    """Import tutorials/exercises/exN_*.py, or its reference solution."""
    (path,) = EXERCISES.glob(f"ex{n}_*.py")
    package = "tutorials.exercises.solutions" if solution else "tutorials.exercises"
    return importlib.import_module(f"{package}.{path.stem}"), path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tutorials.check", description=__doc__.splitlines()[0])
    p.add_argument("n", type=int, choices=sorted(CHECKS), help="exercise number")
    p.add_argument("--solution", action="store_true", help="check the reference solution instead of your file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)     # the checks use tiny tensors: extra threads only add overhead
    module, path = exercise_module(args.n, args.solution)
    print(f"exercise {args.n}: checking {'the reference solution' if args.solution else path.name}")
    try:
        CHECKS[args.n](module)
    except NotImplementedError as e:
        print(f"not written yet ({e}): replace the body of the function in {path}")
        return 1
    except AssertionError as e:
        print(f"  FAILED  {e}")
        return 1
    print(f"exercise {args.n}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
