"""Wall-clock timing shared by the CPU benchmark scripts in this folder."""
import time


def ms(fn, reps=5):
    """Mean milliseconds of `fn()` over `reps` calls, after one call to warm up."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3
