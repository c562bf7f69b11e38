"""What the overhead benchmarks share: fits that take turns, one CPU, and the verdict on a target.

Used by `overhead.py` (TensorFlow) and `overhead_jax.py` (JAX); it imports
neither backend, so that the JAX environment, which has no TensorFlow, runs
it too.
"""

import os
import threading
import time

import keras
import numpy as np

# Steps a fit runs before it passes the turn on: few enough that load changes
# fall on every configuration, as many as the watch benchmark's blocks.
TURN_STEPS = 8


class Turns:
    """Fits that take turns, each in a thread of its own: one runs at a
    time, and passes the turn on every `every` batch ends (its callback
    from `callback(name)`), to the others in a shuffled order each cycle.

    A configuration's seconds and CPU seconds add up its turns, from
    getting the turn to passing it on, its fit's start and end included:
    a burst of load from another tenant falls on every configuration
    alike, as the watch benchmark's blocks of steps (whole fits in turn, a
    copy of bare fit against bare fit came out at 0.75-1.37).

    `hook`: the callback method that passes the turn. TensorFlow's fits pass
    it at a batch's end. Keras on JAX runs batch-end callbacks on a thread
    pool unless one of them overrides the batch end, so a callback that did
    would change the fit it measures: JAX's fits pass it at a batch's begin
    (`settle`), which Keras calls in the fit's own thread either way.
    `settle(model)`, where given, is called before a fit passes the turn:
    it waits for the work that fit has put on the device, so that none of
    it runs in the next fit's turn.
    """

    def __init__(self, names, every, shuffle, hook="on_train_batch_end"):
        self.seconds = dict.fromkeys(names, 0.0)
        self.cpu = dict.fromkeys(names, 0.0)
        self._every = every
        self._shuffle = shuffle
        self._hook = hook
        self._changed = threading.Condition()
        self._turn = None
        self._queue = []
        self._left = set()
        self._started = None

    def callback(self, name, settle=None):
        """The keras callback with which `name`'s fit passes the turn on."""
        turns = self

        class PassTurn(keras.callbacks.Callback):
            calls = 0

            def passes(self, batch, logs=None):
                self.calls += 1
                if self.calls % turns._every == 0:
                    if settle is not None:
                        settle(self.model)
                    turns._pass(name, done=False)

        setattr(PassTurn, self._hook, PassTurn.passes)
        return PassTurn()

    def run(self, fits):
        """Runs `fits` (name -> callable running one fit) taking turns; returns when all ended."""
        errors = []
        self._left = set(fits)
        # Daemons: Ctrl-C in join() ends the benchmark without waiting for fits that wait for a turn.
        threads = [threading.Thread(target=self._run_one, args=(name, fit, errors), name=f"fit {name}", daemon=True)
                   for name, fit in fits.items()]
        for thread in threads:
            thread.start()
        with self._changed:
            self._give_next()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _run_one(self, name, fit, errors):
        self._wait(name)
        try:
            fit()
        except BaseException as error:  # reported by run(), in the main thread
            errors.append(error)
        finally:
            self._pass(name, done=True)

    def _wait(self, name):
        with self._changed:
            self._changed.wait_for(lambda: self._turn == name)
        self._started = (time.perf_counter(), time.process_time())

    def _pass(self, name, done):
        wall, cpu = self._started
        self.seconds[name] += time.perf_counter() - wall
        self.cpu[name] += time.process_time() - cpu
        with self._changed:
            if done:
                self._left.discard(name)
            self._give_next()
        if not done:
            self._wait(name)

    def _give_next(self):
        self._queue = [name for name in self._queue if name in self._left]
        if not self._queue and self._left:
            self._queue = sorted(self._left)
            self._shuffle(self._queue)
            if len(self._queue) > 1 and self._queue[0] == self._turn:
                self._queue.append(self._queue.pop(0))  # no two turns in a row
        self._turn = self._queue.pop(0) if self._queue else None
        self._changed.notify_all()


def pin(cpu):
    """Runs this process on one CPU: every thread it has (the backend's
    thread pools start later, and inherit the mask). On a shared 2-core machine a
    pinned run's fits vary far less; it is a second measurement, not the
    fit a user runs (their fit may use every core)."""
    if cpu is None:
        return
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), {cpu})


def verdict(seconds, bare_seconds, limit, draws=4000, seed=0):
    """Whether median(seconds) / median(bare_seconds) is at most `limit`, as
    far as these rounds can tell: (verdict, low, high), with (low, high) the
    ratio's 90% bootstrap interval and the verdict "met" (high <= limit),
    "not met" (low > limit) or "noise".

    Round i of `seconds` and of `bare_seconds` ran in the same round, under
    the same load, so rounds are drawn whole: a slow round slows both, and
    the interval holds only the noise that does not cancel. Lists of other
    lengths are drawn each on its own."""
    draw = np.random.default_rng(seed)
    watched, bare = np.asarray(seconds, float), np.asarray(bare_seconds, float)
    if len(watched) == len(bare):
        picks = draw.integers(0, len(bare), (draws, len(bare)))
        ratios = np.median(watched[picks], axis=1) / np.median(bare[picks], axis=1)
    else:
        ratios = (np.median(draw.choice(watched, (draws, len(watched))), axis=1)
                  / np.median(draw.choice(bare, (draws, len(bare))), axis=1))
    low, high = np.quantile(ratios, [0.05, 0.95])
    found = "met" if high <= limit else "not met" if low > limit else "noise"
    return found, float(low), float(high)
