"""BatchInFlight: keep each batch of a fit() and the state before it, to step it later.

A Python breakpoint sees a batch's row only after that batch's update. To
open a stepper on that batch with the model as it was before it, the batch
and the state must be kept while breakpoints are armed. The cost, per batch:
one host copy of the model's training state (weights, optimizer slots,
metric totals) and a one-batch call of the train function; it needs
`steps_per_execution=1` (otherwise nothing is kept).
"""

import collections

import keras
import tensorflow as tf

from lab.backend.tensorflow.state import read_state, write_state
from lab.hooks import hooks_for
from lab.pause import NO_BATCH_KEPT


class BatchInFlight(keras.callbacks.Callback):
    """Keeps the batch in flight and the model's state before it.

    Its wrapper sits inside a Recorder's failure guard on the train function
    (the instrumentation layer's order), wherever it is in the callbacks.

    Args:
        armed: callable `armed() -> bool`, or a bool; batches are kept only
            while armed (default: always).

    Example:

    ```python
    keep = lab.in_flight.BatchInFlight()
    rec = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["loss"] > 5)])
    model.fit(x, y, callbacks=[keep, rec])
    stepper = keep.stepper(run=rec.run)  # on the batch that hit, state as before it
    ```
    """

    def __init__(self, armed=True):
        super().__init__()
        self.armed = armed
        self.data = None
        self.before = None
        self.spec = None  # what fit()'s iterator declares its batches as, where it says
        self.position = (0, 0)
        self._epoch = 0
        self._again = None  # (element_spec, pending batches, iterator over them)

    def is_armed(self):
        armed = self.armed() if callable(self.armed) else bool(self.armed)
        return armed and int(self.model.steps_per_execution) == 1

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_begin(self, logs=None):
        hooks_for(self.model).wrap_train_function(self, self._keeper, role="keep_batch")

    def on_train_batch_begin(self, batch, logs=None):
        self.data = self.before = None
        self.position = (self._epoch, batch)
        hooks_for(self.model).sync_train_function()

    def _keeper(self, function):
        keeper = self

        def keep_batch(iterator):
            if not keeper.is_armed():
                return function(iterator)
            data = next(iter(iterator))
            keeper.data, keeper.before = data, read_state(keeper.model)
            keeper.spec = iterator.element_spec if isinstance(iterator, tf.data.Iterator) else None
            return function(keeper._once_more(data))

        return keep_batch

    def _once_more(self, data):
        """An iterator that yields `data` next, declared as fit()'s iterator
        declares its elements (`spec`), so that Keras runs the step it traced for the data.

        Keras' train function takes a plain iterable too, but traces its step
        again for it, on this batch's own shapes (Keras before 3.6 at every
        batch): where fit() leaves the batch size unknown (a dataset, a
        generator, arrays ending in a partial batch), a step traced on a known
        one is free to fold it in, and a CycleGAN's loss means ended an ulp
        away from bare fit()'s. So the batch goes back through a tf.data
        iterator with the same `element_spec`, made once per spec: the
        Python generator behind it yields each batch as it is handed over.
        Elsewhere (a strategy's distributed iterator), the plain iterable.
        """
        spec = self.spec
        if spec is None:
            # Keras' train function runs a plain iterable of batches one by one;
            # Keras before 3.6 calls next() on it, so it is an iterator too.
            return iter([data])
        if self._again is None or self._again[0] != spec:
            pending = collections.deque()

            def handed_over():
                while True:
                    yield pending.popleft()

            options = tf.data.Options()
            options.autotune.enabled = False  # no read ahead: a batch is there only once handed over
            options.experimental_optimization.inject_prefetch = False
            try:
                again = tf.data.Dataset.from_generator(handed_over, output_signature=spec).with_options(options)
                self._again = (spec, pending, iter(again))
            except (TypeError, ValueError):  # elements from_generator cannot declare
                return iter([data])
        _, pending, again = self._again
        pending.clear()  # a batch handed over to a step that never ran (an interrupt) is not the next
        pending.append(data)
        return again

    def on_train_end(self, logs=None):
        # Leave no trace: the next fit() gets Keras' own function back.
        hooks_for(self.model).release(self)
        self._again = None

    def release_hooks(self):
        if self.model is not None:
            hooks_for(self.model).release(self)

    def stepper(self, **kwargs):
        """A `lab.Stepper` on the kept batch, with the model put back to before it.

        With a `run`, the run's `next_step` goes back to the kept batch's step
        too: the next step taken, by the stepper or a later `fit()`, is that one.

        Its data is that one batch, declared with the shapes fit() traced its
        step with (a graph Stepper then traces the same step): stepping past
        it replays it as a new epoch.

        Args:
            **kwargs: passed to `lab.Stepper` (`run`, `start_step`, `mode`, ...);
                with a `run`, `start_step` defaults to the step of its last
                row, the kept batch's.

        Raises:
            ValueError: when no batch is kept (not armed, or no batch ran).
        """
        from lab.backend.tensorflow.stepper import Stepper

        if self.data is None:
            raise ValueError(NO_BATCH_KEPT)
        write_state(self.before)
        if kwargs.get("run") is not None:
            kwargs.setdefault("start_step", kwargs["run"].next_step - 1)
        kwargs.setdefault("mode", "eager")
        kwargs.setdefault("start_batch", self.position)
        # The model is as before the kept batch: the Stepper sets the run's count of steps back too.
        return Stepper(self.model, self._kept_dataset(), shuffle=False, **kwargs)

    def _kept_dataset(self):
        """The kept batch as a one-batch dataset declared as fit()'s iterator
        declared it, so that a graph Stepper traces the step with fit()'s
        shapes (the batch size unknown), not the batch's own (see `_once_more`)."""
        data, spec = self.data, self.spec
        if spec is not None:
            try:
                # Its one batch declared (assert_cardinality): a dataset of
                # unknown length is one fit() would end with an empty call.
                return tf.data.Dataset.from_generator(lambda: iter([data]), output_signature=spec).apply(
                    tf.data.experimental.assert_cardinality(1))
            except (TypeError, ValueError):  # elements from_generator cannot declare
                pass
        return tf.data.Dataset.from_tensors(data)
