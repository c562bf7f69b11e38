"""The tf.distribute guide's custom loop (`strategy.run` + `strategy.reduce`
in a `tf.function`) on two virtual CPUs, bare and under `lab.watch`, from
the same seed. Prints one JSON line: whether the states match, the rows'
gradient norms and those of the gradients the update applied, the hit."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import lab  # noqa: E402

lab.virtual_cpus(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, WATCHED, LATER, BAD = 16, 4, 2, 2
strategy = lab.strategy("mirrored")
(x, y), _ = lab.datasets.digits()
x, y = x[:GLOBAL_BATCH * (WATCHED + LATER)], y[:GLOBAL_BATCH * (WATCHED + LATER)]


class Loop:
    def __init__(self):
        with strategy.scope():
            keras.utils.set_random_seed(11)
            self.model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8, activation="tanh", name="body"),
                                           keras.layers.Dense(10, name="head")], name="net")
            self.optimizer = keras.optimizers.Adam(1e-2)
            # Built in the scope: Adam's slots made lazily in the replicas' step fail (bare Keras 3).
            self.optimizer.build(self.model.trainable_variables)
        self.loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        self.train_step = tf.function(self.distributed_step)

    def step_fn(self, batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(self.loss_object(labels, self.model(features, training=True)),
                                              global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss, grads

    def distributed_step(self, batch):
        loss, grads = strategy.run(self.step_fn, args=(batch,))
        # What the update applied: the replicas' gradients summed.
        return strategy.reduce("SUM", loss, axis=None), [strategy.reduce("SUM", g, axis=None) for g in grads]

    def state(self):
        return [v.numpy() for v in self.model.variables] + [v.numpy() for v in self.optimizer.variables]

    def train(self, features, labels, run=None):
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((features, labels)).batch(GLOBAL_BATCH))
        losses, norms, states = [], [], []
        for batch in dataset:
            loss, grads = self.train_step(batch)
            if run is not None:
                run.step(loss=loss)
            losses.append(float(loss))
            norms.append([float(np.linalg.norm(g.numpy().astype(np.float64))) for g in grads])
            states.append(self.state())
        return losses, norms, states


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


out = {}
bare = Loop()
bare_losses, bare_norms, bare_states = bare.train(x, y)

watched = Loop()
with lab.watch(watched.model, watched.optimizer, gradients=True, weights=True) as run:
    losses, _, states = watched.train(x[:GLOBAL_BATCH * WATCHED], y[:GLOBAL_BATCH * WATCHED], run)
frame = run.batches()
keys = [v.path for v in watched.model.trainable_variables]
out["steps"] = frame["step"].tolist()
out["updated"] = frame["updated"].tolist()
out["rows"] = frame[[f"grad_norm/{k}" for k in keys]].to_numpy().tolist()
out["applied"] = bare_norms[:WATCHED]
out["warnings"] = run.events()["detail"].tolist() if len(run.events()) else []
out["same_losses"] = losses == bare_losses[:WATCHED]
out["same_after_block"] = same(states[-1], bare_states[WATCHED - 1])
later = watched.train(x[GLOBAL_BATCH * WATCHED:], y[GLOBAL_BATCH * WATCHED:])
out["same_later_losses"] = later[0] == bare_losses[WATCHED:]
out["same_after_later_bare_phase"] = same(later[2][-1], bare_states[-1])
out["traces"] = [n for o in (watched.model, watched.optimizer) for n in vars(o)
                 if n.startswith("_lab") or n in ("apply", "apply_gradients", "_backend_update_step")]

stopped = Loop()
bad = x[:GLOBAL_BATCH * WATCHED].copy()
bad[GLOBAL_BATCH * BAD + 12, 5] = np.nan  # the second replica's half of batch 2
out["hit"] = None
try:
    with lab.watch(stopped.model, stopped.optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        stopped.train(bad, y[:GLOBAL_BATCH * WATCHED], run)
except lab.BreakpointHit as hit:
    out["hit"] = [hit.step, hit.skipped]
out["same_as_bare_stopped_before_the_nan"] = same(stopped.state(), bare_states[BAD - 1])
print(json.dumps(out))
