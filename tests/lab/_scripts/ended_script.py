"""A plain script whose recorded fit() ends it, as a user's script would.

    python ended_script.py PATH HOW

Trains with `lab.Recorder(path=PATH)` (nothing read or saved on a timer) and
lets fit() end the script by HOW:

- `interrupt-in-keras`: a KeyboardInterrupt in fit()'s own code after the
  first epoch's steps, before its callbacks' epoch end (where no guard of the
  lab is: Keras' `_should_eval`);
- `error-in-keras`: a RuntimeError there;
- `interrupt-in-generator`: a KeyboardInterrupt inside the data generator at
  batch 5, which TensorFlow raises as UnknownError.

Before fit() it prints one JSON line: the rows the run should end with.
"""

import json
import sys

import keras
import numpy as np

import lab

path, how = sys.argv[1], sys.argv[2]
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((48, 4), "float32"), np.ones((48, 1), "float32")
recorder = lab.Recorder(gradients=True, path=path, flush_every=3600, save_every=3600)

if how == "interrupt-in-generator":
    def batches():
        for i in range(100):
            if i == 5:
                raise KeyboardInterrupt
            yield x[:8], y[:8]

    print(json.dumps({"rows": 5}), flush=True)
    model.fit(batches(), epochs=1, steps_per_epoch=10, verbose=0, callbacks=[recorder])
else:
    error = KeyboardInterrupt() if how == "interrupt-in-keras" else RuntimeError("Keras failed between steps")

    def should_eval(epoch, validation_freq):
        raise error

    model._should_eval = should_eval
    print(json.dumps({"rows": 6}), flush=True)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y), callbacks=[recorder])
