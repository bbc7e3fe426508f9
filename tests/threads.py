"""Run a job in several threads at once, in lockstep, surfacing any thread's exception."""
import threading


def run_in_threads(job, count: int = 4, timeout: float = 600.0) -> dict:
    """{i: job(i, sync)} for i in range(count), every thread started before any is joined.

    `sync()` waits until every thread has reached it: a job calls it before each step, so the
    threads' calls really overlap (without it, one thread could finish its loop while the next is
    still starting, and "concurrent" runs would be serial ones). A thread that fails breaks the
    barrier, so the others stop waiting and fail too; the first error is re-raised here.
    """
    barrier = threading.Barrier(count)
    results, errors = {}, []

    def sync() -> None:
        barrier.wait(timeout)

    def worker(i):
        try:
            results[i] = job(i, sync)
        except threading.BrokenBarrierError as exc:
            errors.append(exc)
        except Exception as exc:  # re-raised below, in the test's thread
            errors.insert(0, exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


class Overlap:
    """Counts how many threads are inside `module`'s forward at once (torch modules): a test of
    concurrency asserts `most > 1`, so runs that happened one after the other cannot pass for it."""

    def __init__(self, module):
        self._lock, self._inside, self.most = threading.Lock(), 0, 0
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, *_):
        with self._lock:
            self._inside += 1
            self.most = max(self.most, self._inside)

    def _exit(self, *_):
        with self._lock:
            self._inside -= 1

    def remove(self):
        for handle in self._handles:
            handle.remove()


def concurrent_calls(module, call, jobs, rounds: int = 3, count: int = 4) -> dict:
    """Thread i makes `call(jobs[i % len(jobs)])` `rounds` times, every thread in lockstep; returns
    {i: [outputs]} once it is checked that calls into `module` really overlapped."""
    overlap = Overlap(module)

    def job(i, sync):
        outs = []
        for _ in range(rounds):
            sync()  # every thread's call starts together
            outs.append(call(jobs[i % len(jobs)]))
        return outs

    try:
        results = run_in_threads(job, count)
    finally:
        overlap.remove()
    assert overlap.most > 1, "the calls never ran at the same time"
    return results
