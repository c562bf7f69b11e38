"""Each Keras difference lab.compat decides by version, checked against what Keras does.

These run at both ends of the supported range (`make test` runs tests/lab
again on TensorFlow 2.16 / Keras 3.5), so a flag that is wrong for either end
fails here rather than as a wrong row somewhere else.
"""

import collections
import importlib

import keras
import numpy as np
import pytest

from lab.backend.tensorflow import compat


def tiny(steps_per_execution=1):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return model


def test_the_version_is_read_from_keras():
    assert compat.KERAS_VERSION[:2] == tuple(int(p) for p in keras.__version__.split(".")[:2])
    assert compat._version("3.10.0rc1") == (3, 10, 0)


def test_batch_end_step_matches_what_fit_passes():
    seen = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    x, y = np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32")
    tiny(steps_per_execution=2).fit(x, y, batch_size=2, verbose=0, callbacks=[Steps()])
    last_steps, first_steps = [1, 3], [0, 2]
    assert seen == (last_steps if compat.BATCH_END_REPORTS_LAST_STEP else first_steps)


def test_loss_scaling_by_replicas_matches_the_installed_losses_module():
    losses = importlib.import_module("keras.src.losses.loss")
    assert hasattr(losses, "scale_loss_for_distribution") == compat.SCALES_LOSS_BY_REPLICAS
    value = np.float32(3.0)
    assert float(compat.unscale_loss_for_distribution(value)) == 3.0  # no strategy: nothing to undo


def test_train_step_binding_matches_make_train_function():
    model = tiny()
    model.make_train_function()
    called = []
    original = model.train_step

    def counting(data):
        called.append(1)
        return original(data)

    object.__setattr__(model, "train_step", counting)  # after the function was built
    try:
        x, y = np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32")
        model.train_function(iter([(x, y)]))
    finally:
        object.__delattr__(model, "train_step")
    assert bool(called) == (not compat.TRAIN_STEP_BOUND_AT_BUILD)


def test_the_calling_callback_list_is_found_from_set_model():
    found = []

    class Finder(keras.callbacks.Callback):
        def set_model(self, model):
            super().set_model(model)
            found.append(compat.calling_callback_list())

    x, y = np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32")
    tiny().fit(x, y, verbose=0, callbacks=[Finder()])
    assert isinstance(found[0], keras.callbacks.CallbackList)
    assert compat.calling_callback_list() is None  # called from anywhere else


@pytest.mark.parametrize("where", ["eager", "graph", "loop", "branch", "xla"])
def test_rarely_runs_its_branch_only_where_the_condition_holds(where):
    # The branch reads element `index` of a tensor, out of range (an error
    # when it runs) where the condition does not hold: in a graph the side
    # not taken must not run (its one Switch makes the branch dead), also
    # inside a loop and a cond; both sides give their values.
    import tensorflow as tf

    def branch(inputs):
        values, index = inputs
        return tf.stack([tf.gather(values, index), tf.reduce_sum(values)])

    def once(flag):
        values = tf.constant([3.0, 4.0])
        index = tf.where(flag, 1, 100)
        return compat.rarely(lambda: tf.constant([-1.0, -1.0]), tf.logical_not(flag), branch, [values, index])

    def run(flag):
        if where == "loop":
            return tf.while_loop(lambda i, _: i < 3, lambda i, _: (i + 1, once(flag)),
                                 (tf.constant(0), tf.zeros([2])))[1]
        if where == "branch":
            return tf.cond(tf.constant(True), lambda: once(flag), lambda: tf.zeros([2]))
        return once(flag)

    call = run if where == "eager" else tf.function(run, jit_compile=where == "xla")
    assert call(tf.constant(False)).numpy().tolist() == [-1.0, -1.0]
    assert call(tf.constant(True)).numpy().tolist() == [4.0, 7.0]
    assert call(tf.constant(False)).numpy().tolist() == [-1.0, -1.0]


def test_rarely_is_one_if_node_in_a_graph_without_control_flow_and_a_switch_inside_a_loop():
    # Where the graph has no control flow, rarely() is an If that is not
    # lowered to Switch and Merge (it cost a training step less than the
    # Switch form, see its docstring); inside a loop (Switches already
    # there) it is one Switch, its branch a dead call.
    import tensorflow as tf

    def once(flag):
        return compat.rarely(lambda: tf.constant(1.0), flag, lambda inputs: inputs[0] * 2.0, [tf.constant(3.0)])

    def kinds(graph):
        return collections.Counter(op.type for op in graph.get_operations())

    flag = tf.TensorSpec([], tf.bool)
    plain = tf.function(once).get_concrete_function(flag).graph
    ifs = [op for op in plain.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(ifs) == 1 and not ifs[0].get_attr("_lower_using_switch_merge")
    assert kinds(plain)["Switch"] == kinds(plain)["Merge"] == 0
    looped = tf.function(lambda flag: tf.while_loop(lambda i, _: i < 2, lambda i, _: (i + 1, once(flag)),
                                                    (0, 0.0))[1]).get_concrete_function(flag).graph
    body = [f.graph for f in looped._functions.values() if hasattr(f, "graph") and "body" in f.graph.name][0]
    assert kinds(body)["Switch"] == 1 and kinds(body)["If"] + kinds(body)["StatelessIf"] == 0


def test_rarely_refuses_a_branch_with_side_effects():
    # A branch not taken is dead, and so would be every op ordered after
    # its side effects: such a branch needs tf.cond.
    import tensorflow as tf

    count = tf.Variable(0)

    @tf.function
    def step(flag):
        return compat.rarely(lambda: tf.constant(0), flag, lambda inputs: count.assign_add(1), [])

    with pytest.raises(ValueError, match=r"rarely\(\) takes a branch without side effects.*tf.cond"):
        step(tf.constant(False))


@pytest.mark.skipif(not compat.SCALES_LOSS_BY_REPLICAS, reason="Keras before 3.8 scales no loss")
def test_the_loss_scaling_window_counts_on_its_own_thread_only_and_puts_keras_functions_back():
    import threading

    import tensorflow as tf
    from keras.src.losses import loss as loss_module

    own = (loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution)
    seen, inner = compat.LossScalingSeen(), compat.LossScalingSeen()
    with pytest.raises(RuntimeError, match="the step failed"):
        with compat.watch_loss_scaling(seen):
            assert loss_module.unscale_loss_for_distribution is not own[1]
            loss_module.unscale_loss_for_distribution(tf.constant(1.0))
            other = threading.Thread(target=lambda: loss_module.unscale_loss_for_distribution(tf.constant(2.0)))
            other.start()
            other.join()
            with compat.watch_loss_scaling(inner):
                loss_module.unscale_loss_for_distribution(tf.constant(1.0))
            loss_module.unscale_loss_for_distribution(tf.constant(1.0))
            # One replica: nothing is scaled, so nothing is counted as scaled.
            value = tf.constant(3.0)
            assert loss_module.scale_loss_for_distribution(value) is value
            raise RuntimeError("the step failed")
    assert (seen.unscaled, inner.unscaled, seen.scaled) == (2, 1, [])
    assert (loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution) == own


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_the_mode_a_train_function_was_made_in_is_read_from_the_function(mode):
    model = tiny()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=mode == "eager", jit_compile=mode == "xla")
    model.make_train_function()
    model.run_eagerly, model.jit_compile = mode != "eager", False  # set by hand: Keras keeps the function
    assert compat.function_mode(model.train_function) == mode
    assert compat.function_mode(lambda iterator: None) is None  # not Keras' own: cannot be told
