"""Run a job in several threads at once, surfacing any thread's exception."""
import threading


def run_in_threads(job, count: int = 4) -> dict:
    """{i: job(i)} for i in range(count), all threads started before any is joined."""
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = job(i)
        except Exception as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results
