"""More keras-io hand-written training loops, watched with `lab.watch`.

Each loop below (keras-team/keras-io) is re-expressed small, its gym
environment replaced by `DriftWorld`, a tiny deterministic numpy environment:

- examples/rl/deep_q_network_breakout.py: an eager loop over frames;
  epsilon-greedy actions drawn with numpy's global random numbers, a replay
  history of lists trimmed to its maximum length, a target network read with
  `predict` and copied from the model with `set_weights` every N frames, a
  `one_hot` action mask, the Huber loss, Adam with `clipnorm` (0.5 here, 1.0 there), and an
  update only every 4th frame once the history holds a batch. `run.step`
  closes every frame (loss NaN where the frame trained nothing); watched with
  and without `weights=True`, and with the update as a `tf.function` traced
  in the block (`DQNTraced`), called on the training frames only.
- examples/rl/ppo_cartpole.py: an actor and a critic, each with its own Adam
  (held as attributes of one model, which names them), trained by separate
  `tf.function`s for several iterations per epoch, the policy's stopped early
  on the KL divergence; actions sampled in a third `tf.function` by
  `tf.random.categorical` (unseeded, as in the example: the global seed makes
  it repeat); GAE-lambda advantages. `run.step` closes each training call
  (one optimizer's update per row) or, in `PPOStepPerEpoch`, each epoch
  (several updates of both optimizers per row).
- examples/rl/ddpg_pendulum.py: an actor and a critic (BatchNormalization in
  both) with target networks updated by a soft `assign` of
  `tau * w + (1 - tau) * w_target` in a `tf.function` (all variables, the
  BatchNormalization statistics too), one `tf.function` update applying two
  optimizers, watched by keyword, a numpy replay buffer and
  Ornstein-Uhlenbeck noise. `run.step` closes each environment step. Watched
  through a model holding the actor and critic, and through one holding the
  target networks too (found optimizers by attribute).

The example's step functions return their losses (and here also the norms
of the gradients they apply) so that the bare loop has values to compare
the rows with; nothing else is changed in what they compute.

Each loop is run twice from identical seeds: a twin bare throughout, and one
whose first phase is inside `lab.watch(...)`; both then go on bare. Checked:
every weight (the target networks' too) and every optimizer variable after
the watched phase are bit for bit the bare twin's, and so are the losses; the
rows (one per `run.step`, its loss, `updated`, a `grad_norm/<path>` column for
every variable a watched optimizer updates: the norm of the gradient the
update used, NaN on the steps where no watched optimizer updated it, with
the learning rate NaN there too); the block's events; and the later bare
phase ends exactly as the never-watched twin's, with nothing of the lab left
on the models or optimizers.

Recorded as the lab records them: on DQN's frames without an update, `updated`
is 0 and every gradient norm, weight norm, update ratio and the learning rate
are NaN (a target copy by `set_weights` is no update and is not told); the
norms are those of the gradients after `clipnorm`; a row holding several
applies has each variable's norm of all its gradients in the row.

Changed from the examples, for Keras 3 and numpy 2 (not the lab): DDPG's
`update_target` is given the models, not `model.variables` (Keras 3 variables
reach a `tf.function` as tensors, with no `assign`); PPO's buffer stores the
1-element tensors' scalars. Finding: a watched model's trainable variables
that no optimizer updates in the whole block (DDPG's targets, when the
watched agent holds them) had all-NaN columns and no word in the run, where
fit() tells `lab.backend.tensorflow.probes.NO_UPDATE_NOTE`; the block's end names them now
(`lab.backend.tensorflow.watch.NEVER_UPDATED_MESSAGE`).
"""

import collections
import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import lab

# keras-io's programs are written for the newest Keras: they run on the newest stack, not on the
# oldest one (docs/testing.md, "What the oldest stack runs").
pytestmark = pytest.mark.newest_only

SEED = 1234


# ---- helpers -----------------------------------------------------------------


class DriftWorld:
    """A 4-number state pushed by the action (0/1, or a float in [-2, 2]);
    the reward is larger near the origin; the episode ends when the state
    leaves [-1, 1] or after `limit` steps."""

    PUSH = np.array([0.15, -0.05, 0.1, 0.02], "float32")

    def __init__(self, limit=10):
        self.limit = limit

    def reset(self, seed):
        self.t, self.state = 0, np.random.default_rng(seed).uniform(-0.2, 0.2, 4).astype("float32")
        return self.state

    def step(self, action):
        self.t += 1
        push = (1.0 if action else -1.0) if isinstance(action, (int, np.integer)) else float(np.squeeze(action))
        self.state = (self.state * 1.05 + self.PUSH * push).astype("float32")
        reward = float(1.0 - np.abs(self.state).mean())
        done = bool(np.abs(self.state).max() > 1) or self.t >= self.limit
        return self.state, reward, done


class Agent(keras.Model):
    """Holds the networks (and optimizers) a loop trains together, for `lab.watch`."""

    def __init__(self, **parts):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)


def arrays(*holders):
    """Every variable of the models or optimizers, as numpy arrays."""
    return [np.array(v.numpy()) for h in holders for v in h.variables]


def assert_same_arrays(got, expected, what):
    assert len(got) == len(expected), f"{what}: {len(got)} arrays, expected {len(expected)}"
    bad = [(i, float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))))
           for i, (a, b) in enumerate(zip(got, expected)) if not np.array_equal(a, b)]
    assert not bad, f"{what}: {len(bad)} of {len(got)} arrays differ, (index, max abs diff): {bad[:6]}"


def variable_keys(variables):
    """`variable.path`, with `#2`, `#3`, ... for repeated paths (as the lab names columns)."""
    seen, keys = collections.Counter(), []
    for v in variables:
        seen[v.path] += 1
        keys.append(v.path if seen[v.path] == 1 else f"{v.path}#{seen[v.path]}")
    return keys


def lab_traces(*holders):
    """Attributes the lab may have left on models or optimizers."""
    left = []
    for obj in holders:
        left += [f"{obj.name}.{n}" for n in vars(obj) if n.startswith("_lab")]
        left += [f"{obj.name}.{n} (instance patch)" for n in ("train_step", "apply", "apply_gradients",
                                                              "_backend_update_step") if n in vars(obj)]
    return left


def warnings_of(run):
    events = run.events()
    return list(events[events["kind"].isin(["warning", "error"])]["detail"]) if len(events) else []


def twin_runs(make, watched_steps, later_steps, watch):
    """A bare twin and a watched run of the loop `make()` builds: snapshots
    after the first phase (bare or watched) and after a later bare phase."""
    results = {}
    for watched in (False, True):
        loop = make()
        block = watch(loop) if watched else contextlib.nullcontext()
        with block as run:
            first = loop.train(watched_steps, run)
        middle = (arrays(*loop.models), arrays(*loop.optimizers))
        later = loop.train(later_steps, None)
        end = (arrays(*loop.models), arrays(*loop.optimizers))
        results[watched] = as_twin(loop=loop, run=run, first=first, later=later, middle=middle, end=end)
    return results[False], results[True]


def as_twin(**kwargs):
    return collections.namedtuple("Twin", kwargs)(**kwargs)


def check_twins(bare, got):
    assert_same_arrays(got.middle[0], bare.middle[0], "weights (target networks too) after the watched phase")
    assert_same_arrays(got.middle[1], bare.middle[1], "optimizer variables after the watched phase")
    np.testing.assert_array_equal(got.first["loss"], bare.first["loss"])
    assert_same_arrays(got.end[0], bare.end[0], "weights after a later bare phase, against the never-watched twin")
    assert_same_arrays(got.end[1], bare.end[1], "optimizer variables after a later bare phase")
    np.testing.assert_array_equal(got.later["loss"], bare.later["loss"])
    assert lab_traces(*got.loop.models, *got.loop.optimizers) == []


def check_gradient_columns(rows, keys, updated, norms):
    """A grad_norm/<key> column per key: the norms the step computed where
    `updated` (a boolean per row), NaN elsewhere; grad_norm their root sum of squares."""
    missing = [k for k in keys if f"grad_norm/{k}" not in rows.columns]
    assert not missing, f"no gradient column for {missing}"
    values = rows[[f"grad_norm/{k}" for k in keys]].to_numpy(np.float64)
    assert np.isfinite(values[updated]).all() and (values[updated] > 0).all()
    assert np.isnan(values[~updated]).all(), "a gradient norm on a step where the variable was not updated"
    np.testing.assert_allclose(values[updated], norms, rtol=1e-5, err_msg="grad_norm/<path> against the step's norms")


# ==================================================================================
# examples/rl/deep_q_network_breakout.py
# ==================================================================================


class DQN:
    num_actions, batch_size, gamma = 2, 8, 0.99
    epsilon_min, epsilon_max, epsilon_random_frames, epsilon_greedy_frames = 0.1, 1.0, 6, 30.0
    max_memory_length, update_after_actions, update_target_network = 24, 4, 10
    # The example's clipnorm is 1.0; this small loop's gradients are smaller, some above 0.5.
    clipnorm = 0.5

    def __init__(self):
        keras.utils.set_random_seed(SEED)
        self.model, self.model_target = self.create_q_model(), self.create_q_model()
        self.optimizer = keras.optimizers.Adam(learning_rate=0.01, clipnorm=self.clipnorm)
        self.loss_function = keras.losses.Huber()
        self.models, self.optimizers = (self.model, self.model_target), (self.optimizer,)
        self.env, self.episode = DriftWorld(), 0
        self.state = np.array(self.env.reset(seed=self.episode))
        self.epsilon, self.frame_count = 1.0, 0
        self.action_history, self.state_history, self.state_next_history = [], [], []
        self.rewards_history, self.done_history = [], []

    def create_q_model(self):
        inputs = layers.Input(shape=(4,))
        hidden = layers.Dense(16, activation="relu")(inputs)
        return keras.Model(inputs=inputs, outputs=layers.Dense(self.num_actions, activation="linear")(hidden))

    def learn(self, state_sample, updated_q_values, masks):
        with tf.GradientTape() as tape:
            q_values = self.model(state_sample)
            q_action = keras.ops.sum(keras.ops.multiply(q_values, masks), axis=1)
            loss = self.loss_function(updated_q_values, q_action)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss, grads

    def train(self, frames, run):
        out = {"loss": [], "trained": [], "norms": [], "raw_norms": [], "copied": []}
        epsilon_interval = self.epsilon_max - self.epsilon_min
        for _ in range(frames):
            self.frame_count += 1
            if self.frame_count < self.epsilon_random_frames or self.epsilon > np.random.rand(1)[0]:
                action = np.random.choice(self.num_actions)
            else:
                state_tensor = keras.ops.expand_dims(keras.ops.convert_to_tensor(self.state), 0)
                action_probs = self.model(state_tensor, training=False)
                action = keras.ops.argmax(action_probs[0]).numpy()
            self.epsilon = max(self.epsilon - epsilon_interval / self.epsilon_greedy_frames, self.epsilon_min)
            state_next, reward, done = self.env.step(action)
            state_next = np.array(state_next)
            self.action_history.append(action)
            self.state_history.append(self.state)
            self.state_next_history.append(state_next)
            self.done_history.append(done)
            self.rewards_history.append(reward)
            self.state = state_next

            loss, trained = np.float32(np.nan), False
            if self.frame_count % self.update_after_actions == 0 and len(self.done_history) > self.batch_size:
                indices = np.random.choice(range(len(self.done_history)), size=self.batch_size)
                state_sample = np.array([self.state_history[i] for i in indices])
                state_next_sample = np.array([self.state_next_history[i] for i in indices])
                rewards_sample = [self.rewards_history[i] for i in indices]
                action_sample = [self.action_history[i] for i in indices]
                done_sample = keras.ops.convert_to_tensor([float(self.done_history[i]) for i in indices])
                future_rewards = self.model_target.predict(state_next_sample, verbose=0)
                updated_q_values = rewards_sample + self.gamma * keras.ops.amax(future_rewards, axis=1)
                updated_q_values = updated_q_values * (1 - done_sample) - done_sample
                masks = keras.ops.one_hot(action_sample, self.num_actions)
                loss, grads = self.learn(state_sample, updated_q_values, masks)
                trained = True
                # clipnorm clips each gradient to that norm: the update's gradients' norms.
                raw = [float(np.linalg.norm(g.numpy())) for g in grads]
                out["raw_norms"].append(raw)
                out["norms"].append([min(n, self.clipnorm) for n in raw])
            copied = self.frame_count % self.update_target_network == 0
            if copied:
                self.model_target.set_weights(self.model.get_weights())
            if len(self.rewards_history) > self.max_memory_length:
                for history in (self.rewards_history, self.state_history, self.state_next_history,
                                self.action_history, self.done_history):
                    del history[:1]
            if done:
                self.episode += 1
                self.state = np.array(self.env.reset(seed=self.episode))
            if run is not None:
                run.step(loss=loss, epsilon=self.epsilon)
            out["loss"].append(float(loss))
            out["trained"].append(trained)
            out["copied"].append(copied)
        return out


class DQNTraced(DQN):
    """The example's eager update as a `tf.function`, called on the training frames only."""

    def __init__(self):
        super().__init__()
        self.learn = tf.function(self.learn)


@pytest.fixture(scope="module", params=[(DQN, False), (DQN, True), (DQNTraced, False)],
                ids=["eager", "eager_weights", "traced"])
def dqn(request):
    make, weights = request.param
    bare, got = twin_runs(make, 40, 12, lambda loop: lab.watch(loop.model, loop.optimizer, weights=weights))
    return bare, got, weights


def test_dqn_watched_frames_train_as_the_bare_frames_and_a_later_bare_phase_as_the_twins(dqn):
    bare, got, _ = dqn
    assert sum(bare.first["trained"]) >= 6 and sum(bare.first["copied"]) >= 3
    assert not all(bare.first["trained"]), "the loop updates only every 4th frame"
    raw = np.array(bare.first["raw_norms"])
    assert (raw > DQN.clipnorm).any() and (raw < DQN.clipnorm).any(), "clipnorm should clip some gradients"
    check_twins(bare, got)


def test_dqn_rows_have_an_update_on_the_training_frames_only(dqn):
    _, got, weights = dqn
    rows = got.run.batches()
    trained = np.array(got.first["trained"])
    assert list(rows["step"]) == list(range(40))
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), np.float32(got.first["loss"]))
    np.testing.assert_array_equal(rows["updated"].to_numpy(), trained.astype(np.float32))
    keys = variable_keys(got.loop.model.trainable_variables)
    # The gradients Adam used, each clipped to norm `clipnorm`: not the tape's.
    check_gradient_columns(rows, keys, trained, got.first["norms"])
    assert (rows[[f"grad_norm/{k}" for k in keys]].to_numpy()[trained] <= DQN.clipnorm * (1 + 1e-6)).all()
    # Frames with no update: no gradient norm in total, no learning rate.
    assert rows["grad_norm"][~trained].isna().all() and np.isfinite(rows["grad_norm"][trained]).all()
    assert rows["learning_rate"][~trained].isna().all()
    # With weights=True, weight norms and update ratios are those of the updates: none between them.
    for kind in ("weight_norm", "update_ratio"):
        columns = [c for c in rows.columns if c.startswith(f"{kind}/")]
        if weights:
            assert sorted(columns) == sorted(f"{kind}/{k}" for k in keys)
            values = rows[columns].to_numpy()
            assert np.isfinite(values[trained]).all() and (values[trained] > 0).all()
            assert np.isnan(values[~trained]).all()
        else:
            assert columns == []
    np.testing.assert_allclose(rows["learning_rate"][trained], 0.01, rtol=1e-7)
    # The target network is no variable of the watched model: no column of its own.
    target_keys = set(variable_keys(got.loop.model_target.trainable_variables)) - set(keys)
    assert not [c for c in rows.columns if c.partition("/")[2] in target_keys]
    assert warnings_of(got.run) == []


# ==================================================================================
# examples/rl/ppo_cartpole.py
# ==================================================================================


def discounted_cumulative_sums(x, discount):
    """scipy.signal.lfilter([1], [1, -discount], x[::-1])[::-1], in numpy."""
    out, running = np.zeros(len(x)), 0.0
    for i in range(len(x) - 1, -1, -1):
        running = x[i] + discount * running
        out[i] = running
    return out


class PPOBuffer:
    def __init__(self, observation_dimensions, size, gamma=0.99, lam=0.95):
        self.observation_buffer = np.zeros((size, observation_dimensions), dtype=np.float32)
        self.action_buffer = np.zeros(size, dtype=np.int32)
        self.advantage_buffer = np.zeros(size, dtype=np.float32)
        self.reward_buffer = np.zeros(size, dtype=np.float32)
        self.return_buffer = np.zeros(size, dtype=np.float32)
        self.value_buffer = np.zeros(size, dtype=np.float32)
        self.logprobability_buffer = np.zeros(size, dtype=np.float32)
        self.gamma, self.lam = gamma, lam
        self.pointer, self.trajectory_start_index = 0, 0

    def store(self, observation, action, reward, value, logprobability):
        self.observation_buffer[self.pointer] = observation
        self.action_buffer[self.pointer] = action
        self.reward_buffer[self.pointer] = reward
        self.value_buffer[self.pointer] = value
        self.logprobability_buffer[self.pointer] = logprobability
        self.pointer += 1

    def finish_trajectory(self, last_value=0):
        path_slice = slice(self.trajectory_start_index, self.pointer)
        rewards = np.append(self.reward_buffer[path_slice], last_value)
        values = np.append(self.value_buffer[path_slice], last_value)
        deltas = rewards[:-1] + self.gamma * values[1:] - values[:-1]
        self.advantage_buffer[path_slice] = discounted_cumulative_sums(deltas, self.gamma * self.lam)
        self.return_buffer[path_slice] = discounted_cumulative_sums(rewards, self.gamma)[:-1]
        self.trajectory_start_index = self.pointer

    def get(self):
        self.pointer, self.trajectory_start_index = 0, 0
        advantage_mean, advantage_std = np.mean(self.advantage_buffer), np.std(self.advantage_buffer)
        self.advantage_buffer = (self.advantage_buffer - advantage_mean) / advantage_std
        return (self.observation_buffer, self.action_buffer, self.advantage_buffer, self.return_buffer,
                self.logprobability_buffer)


class PPO:
    steps_per_epoch, train_policy_iterations, train_value_iterations = 24, 5, 4
    clip_ratio, target_kl, num_actions = 0.2, 0.01, 2
    # run.step after each training call; else once per epoch, after all of its calls.
    step_per_call = True

    def __init__(self):
        keras.utils.set_random_seed(SEED)
        observation_input = keras.Input(shape=(4,), dtype="float32")
        logits = self.mlp(observation_input, [16, self.num_actions])
        self.actor = keras.Model(inputs=observation_input, outputs=logits)
        value = keras.ops.squeeze(self.mlp(observation_input, [16, 1]), axis=1)
        self.critic = keras.Model(inputs=observation_input, outputs=value)
        self.policy_optimizer = keras.optimizers.Adam(learning_rate=3e-2)
        self.value_optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        # One model holding both networks and their optimizers, for lab.watch.
        self.agent = Agent(actor=self.actor, critic=self.critic, policy_optimizer=self.policy_optimizer,
                           value_optimizer=self.value_optimizer)
        self.models, self.optimizers = (self.actor, self.critic), (self.policy_optimizer, self.value_optimizer)
        self.buffer = PPOBuffer(4, self.steps_per_epoch)
        self.env, self.episode = DriftWorld(), 0
        self.observation = self.env.reset(seed=0)
        self.sample_action = tf.function(self._sample_action)
        self.train_policy = tf.function(self._train_policy)
        self.train_value_function = tf.function(self._train_value_function)

    @staticmethod
    def mlp(x, sizes, activation=tf.tanh, output_activation=None):
        for size in sizes[:-1]:
            x = layers.Dense(units=size, activation=activation)(x)
        return layers.Dense(units=sizes[-1], activation=output_activation)(x)

    def logprobabilities(self, logits, a):
        logprobabilities_all = tf.nn.log_softmax(logits)
        return tf.reduce_sum(tf.one_hot(a, self.num_actions) * logprobabilities_all, axis=1)

    def _sample_action(self, observation):
        logits = self.actor(observation)
        action = tf.squeeze(tf.random.categorical(logits, 1), axis=1)
        return logits, action

    def _train_policy(self, observation_buffer, action_buffer, logprobability_buffer, advantage_buffer):
        with tf.GradientTape() as tape:
            ratio = tf.exp(self.logprobabilities(self.actor(observation_buffer), action_buffer)
                           - logprobability_buffer)
            min_advantage = tf.where(advantage_buffer > 0, (1 + self.clip_ratio) * advantage_buffer,
                                     (1 - self.clip_ratio) * advantage_buffer)
            policy_loss = -tf.reduce_mean(tf.minimum(ratio * advantage_buffer, min_advantage))
        policy_grads = tape.gradient(policy_loss, self.actor.trainable_variables)
        self.policy_optimizer.apply_gradients(zip(policy_grads, self.actor.trainable_variables))
        kl = tf.reduce_mean(logprobability_buffer
                            - self.logprobabilities(self.actor(observation_buffer), action_buffer))
        return tf.reduce_sum(kl), policy_loss, [tf.norm(g) for g in policy_grads]

    def _train_value_function(self, observation_buffer, return_buffer):
        with tf.GradientTape() as tape:
            value_loss = tf.reduce_mean((return_buffer - self.critic(observation_buffer)) ** 2)
        value_grads = tape.gradient(value_loss, self.critic.trainable_variables)
        self.value_optimizer.apply_gradients(zip(value_grads, self.critic.trainable_variables))
        return value_loss, [tf.norm(g) for g in value_grads]

    def train(self, epochs, run):
        out = {"loss": [], "kl": [], "policy": [], "norms": [], "epoch": [], "stopped_early": 0, "epoch_loss": []}
        for epoch in range(epochs):
            for t in range(self.steps_per_epoch):
                observation = self.observation.reshape(1, -1)
                logits, action = self.sample_action(observation)
                observation_new, reward, done = self.env.step(int(action[0].numpy()))
                value_t = self.critic(observation)
                logprobability_t = self.logprobabilities(logits, action)
                # (numpy 2 sets no scalar from a 1-element array: the example's tensors as scalars)
                self.buffer.store(observation, action.numpy()[0], reward, value_t.numpy()[0],
                                  logprobability_t.numpy()[0])
                self.observation = observation_new
                if done or t == self.steps_per_epoch - 1:
                    last_value = 0 if done else self.critic(self.observation.reshape(1, -1))
                    self.buffer.finish_trajectory(last_value)
                    if done:
                        self.episode += 1
                        self.observation = self.env.reset(seed=self.episode)
            observation_buffer, action_buffer, advantage_buffer, return_buffer, logprobability_buffer = (
                self.buffer.get())
            for _ in range(self.train_policy_iterations):
                kl, loss, norms = self.train_policy(observation_buffer, action_buffer, logprobability_buffer,
                                                    advantage_buffer)
                if run is not None and self.step_per_call:
                    run.step(loss=loss, kl=kl)
                out["epoch"].append(epoch)
                out["loss"].append(float(loss))
                out["kl"].append(float(kl))
                out["policy"].append(True)
                out["norms"].append([float(n) for n in norms])
                if kl > 1.5 * self.target_kl:
                    out["stopped_early"] += 1
                    break
            for _ in range(self.train_value_iterations):
                loss, norms = self.train_value_function(observation_buffer, return_buffer)
                if run is not None and self.step_per_call:
                    run.step(loss=loss, kl=np.nan)
                out["epoch"].append(epoch)
                out["loss"].append(float(loss))
                out["kl"].append(np.nan)
                out["policy"].append(False)
                out["norms"].append([float(n) for n in norms])
            if run is not None and not self.step_per_call:
                run.step(loss=loss)
            out["epoch_loss"].append(float(loss))
        return out


class PPOStepPerEpoch(PPO):
    step_per_call = False


@pytest.fixture(scope="module")
def ppo():
    return twin_runs(PPO, 3, 1, lambda loop: lab.watch(loop.agent, loop.policy_optimizer, loop.value_optimizer))


def test_ppo_watched_epochs_with_two_optimizers_train_as_bare_and_a_later_bare_epoch_as_the_twins(ppo):
    bare, got = ppo
    assert bare.first["stopped_early"] >= 1, "the policy's iterations never stopped early on the KL divergence"
    check_twins(bare, got)
    np.testing.assert_array_equal(got.first["kl"], bare.first["kl"])


def test_ppo_rows_give_each_optimizer_its_own_steps_columns_and_learning_rate(ppo):
    _, got = ppo
    rows = got.run.batches()
    policy = np.array(got.first["policy"])
    assert len(rows) == len(policy) and policy.any() and (~policy).any()
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), np.float32(got.first["loss"]))
    np.testing.assert_array_equal(rows["kl"].to_numpy(np.float32), np.float32(got.first["kl"]))
    assert (rows["updated"] == 1).all()
    actor_keys = variable_keys(got.loop.actor.trainable_variables)
    critic_keys = variable_keys(got.loop.critic.trainable_variables)
    norms = got.first["norms"]
    check_gradient_columns(rows, actor_keys, policy, [n for n, p in zip(norms, policy) if p])
    check_gradient_columns(rows, critic_keys, ~policy, [n for n, p in zip(norms, policy) if not p])
    assert np.isfinite(rows["grad_norm"]).all()
    # Named by the model attributes that hold the optimizers; each rate on its own steps.
    np.testing.assert_allclose(rows["learning_rate/policy_optimizer"][policy], 3e-2, rtol=1e-7)
    np.testing.assert_allclose(rows["learning_rate/value_optimizer"][~policy], 1e-2, rtol=1e-7)
    assert rows["learning_rate/policy_optimizer"][~policy].isna().all()
    assert rows["learning_rate/value_optimizer"][policy].isna().all()
    assert warnings_of(got.run) == []


# ==================================================================================
# examples/rl/ddpg_pendulum.py
# ==================================================================================


class OUActionNoise:
    def __init__(self, mean, std_deviation, theta=0.15, dt=1e-2, x_initial=None):
        self.theta, self.mean, self.std_dev, self.dt, self.x_initial = theta, mean, std_deviation, dt, x_initial
        self.reset()

    def __call__(self):
        x = (self.x_prev + self.theta * (self.mean - self.x_prev) * self.dt
             + self.std_dev * np.sqrt(self.dt) * np.random.normal(size=self.mean.shape))
        self.x_prev = x
        return x

    def reset(self):
        self.x_prev = self.x_initial if self.x_initial is not None else np.zeros_like(self.mean)


class DDPG:
    num_states, num_actions, upper_bound, lower_bound = 4, 1, 2.0, -2.0
    critic_lr, actor_lr, gamma, tau = 0.002, 0.001, 0.99, 0.05
    buffer_capacity, batch_size = 16, 8

    def __init__(self):
        keras.utils.set_random_seed(SEED)
        self.actor_model, self.critic_model = self.get_actor(), self.get_critic()
        self.target_actor, self.target_critic = self.get_actor(), self.get_critic()
        self.target_actor.set_weights(self.actor_model.get_weights())
        self.target_critic.set_weights(self.critic_model.get_weights())
        self.critic_optimizer = keras.optimizers.Adam(self.critic_lr)
        self.actor_optimizer = keras.optimizers.Adam(self.actor_lr)
        self.agent = Agent(actor=self.actor_model, critic=self.critic_model)
        self.models = (self.actor_model, self.critic_model, self.target_actor, self.target_critic)
        self.optimizers = (self.critic_optimizer, self.actor_optimizer)
        self.ou_noise = OUActionNoise(mean=np.zeros(1), std_deviation=0.2 * np.ones(1))
        self.env, self.episode = DriftWorld(limit=8), 0
        self.prev_state = self.env.reset(seed=0)
        self.buffer_counter = 0
        self.state_buffer = np.zeros((self.buffer_capacity, self.num_states))
        self.action_buffer = np.zeros((self.buffer_capacity, self.num_actions))
        self.reward_buffer = np.zeros((self.buffer_capacity, 1))
        self.next_state_buffer = np.zeros((self.buffer_capacity, self.num_states))
        self.update = tf.function(self._update)
        self.update_target = tf.function(self._update_target)

    def get_actor(self):
        last_init = keras.initializers.RandomUniform(minval=-0.003, maxval=0.003)
        inputs = layers.Input(shape=(self.num_states,))
        out = layers.Dense(16, activation="relu")(inputs)
        out = layers.BatchNormalization()(out)
        outputs = layers.Dense(1, activation="tanh", kernel_initializer=last_init)(out)
        return keras.Model(inputs, outputs * self.upper_bound)

    def get_critic(self):
        state_input = layers.Input(shape=(self.num_states,))
        state_out = layers.BatchNormalization()(layers.Dense(8, activation="relu")(state_input))
        action_input = layers.Input(shape=(self.num_actions,))
        action_out = layers.Dense(8, activation="relu")(action_input)
        concat = layers.Concatenate()([state_out, action_out])
        out = layers.Dense(16, activation="relu")(concat)
        return keras.Model([state_input, action_input], layers.Dense(1)(out))

    def record(self, obs_tuple):
        index = self.buffer_counter % self.buffer_capacity
        self.state_buffer[index] = obs_tuple[0]
        self.action_buffer[index] = obs_tuple[1]
        self.reward_buffer[index] = obs_tuple[2]
        self.next_state_buffer[index] = obs_tuple[3]
        self.buffer_counter += 1

    def _update(self, state_batch, action_batch, reward_batch, next_state_batch):
        with tf.GradientTape() as tape:
            target_actions = self.target_actor(next_state_batch)
            y = reward_batch + self.gamma * self.target_critic([next_state_batch, target_actions])
            critic_value = self.critic_model([state_batch, action_batch])
            critic_loss = tf.math.reduce_mean(tf.math.square(y - critic_value))
        critic_grad = tape.gradient(critic_loss, self.critic_model.trainable_variables)
        self.critic_optimizer.apply_gradients(zip(critic_grad, self.critic_model.trainable_variables))
        with tf.GradientTape() as tape:
            actions = self.actor_model(state_batch)
            critic_value = self.critic_model([state_batch, actions])
            actor_loss = -tf.math.reduce_mean(critic_value)
        actor_grad = tape.gradient(actor_loss, self.actor_model.trainable_variables)
        self.actor_optimizer.apply_gradients(zip(actor_grad, self.actor_model.trainable_variables))
        return critic_loss, actor_loss, [tf.norm(g) for g in actor_grad + critic_grad]

    def learn(self):
        record_range = min(self.buffer_counter, self.buffer_capacity)
        batch_indices = np.random.choice(record_range, self.batch_size)
        state_batch = tf.convert_to_tensor(self.state_buffer[batch_indices])
        action_batch = tf.convert_to_tensor(self.action_buffer[batch_indices])
        reward_batch = tf.cast(tf.convert_to_tensor(self.reward_buffer[batch_indices]), dtype=tf.float32)
        next_state_batch = tf.convert_to_tensor(self.next_state_buffer[batch_indices])
        return self.update(state_batch, action_batch, reward_batch, next_state_batch)

    @staticmethod
    def _update_target(target, model, tau):
        # The example passes `target.variables` to the tf.function; Keras 3's
        # variables arrive there as tensors (no `assign`): the models are passed.
        for (a, b) in zip(target.variables, model.variables):
            a.assign(b * tau + a * (1 - tau))

    def policy(self, state):
        sampled_actions = tf.squeeze(self.actor_model(state)).numpy() + self.ou_noise()
        return [np.squeeze(np.clip(sampled_actions, self.lower_bound, self.upper_bound))]

    def train(self, steps, run):
        out = {"loss": [], "actor_loss": [], "norms": []}
        for _ in range(steps):
            tf_prev_state = tf.expand_dims(tf.convert_to_tensor(self.prev_state), 0)
            action = self.policy(tf_prev_state)
            state, reward, done = self.env.step(action)
            self.record((self.prev_state, action, reward, state))
            critic_loss, actor_loss, norms = self.learn()
            self.update_target(self.target_actor, self.actor_model, self.tau)
            self.update_target(self.target_critic, self.critic_model, self.tau)
            if run is not None:
                run.step(loss=critic_loss, actor_loss=actor_loss)
            out["loss"].append(float(critic_loss))
            out["actor_loss"].append(float(actor_loss))
            out["norms"].append([float(n) for n in norms])
            self.prev_state = state
            if done:
                self.episode += 1
                self.prev_state = self.env.reset(seed=self.episode)
        return out


@pytest.fixture(scope="module")
def ddpg():
    return twin_runs(DDPG, 20, 6, lambda loop: lab.watch(loop.agent, critic=loop.critic_optimizer,
                                                         actor=loop.actor_optimizer))


def test_ddpg_watched_steps_with_soft_target_updates_train_as_bare_and_a_later_bare_phase_as_the_twins(ddpg):
    bare, got = ddpg
    check_twins(bare, got)
    np.testing.assert_array_equal(got.first["actor_loss"], bare.first["actor_loss"])
    # The soft updates moved the targets away from the networks they follow (and the BatchNormalization statistics).
    loop = got.loop
    assert not np.array_equal(loop.target_actor.get_weights()[0], loop.actor_model.get_weights()[0])


def test_ddpg_rows_hold_both_optimizers_updates_and_nothing_of_the_target_networks(ddpg):
    _, got = ddpg
    rows = got.run.batches()
    loop = got.loop
    assert list(rows["step"]) == list(range(20)) and (rows["updated"] == 1).all()
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), np.float32(got.first["loss"]))
    np.testing.assert_array_equal(rows["actor_loss"].to_numpy(np.float32), np.float32(got.first["actor_loss"]))
    keys = variable_keys(loop.actor_model.trainable_variables + loop.critic_model.trainable_variables)
    check_gradient_columns(rows, keys, np.ones(len(rows), bool), got.first["norms"])
    np.testing.assert_allclose(rows["learning_rate/critic"], 0.002, rtol=1e-7)
    np.testing.assert_allclose(rows["learning_rate/actor"], 0.001, rtol=1e-7)
    # The BatchNormalization statistics and the target networks get no gradient column.
    grad_columns = {c.partition("/")[2] for c in rows.columns if c.startswith("grad_norm/")}
    assert grad_columns == set(keys), sorted(grad_columns ^ set(keys))
    assert warnings_of(got.run) == []


@pytest.fixture(scope="module")
def ppo_per_epoch():
    return twin_runs(PPOStepPerEpoch, 3, 1,
                     lambda loop: lab.watch(loop.agent, loop.policy_optimizer, loop.value_optimizer))


def test_ppo_closed_once_per_epoch_trains_as_bare_and_its_rows_hold_the_norm_of_all_the_epochs_updates(
        ppo_per_epoch):
    # Several applies of both optimizers in one row: each variable's column is
    # the norm of all the gradients applied to it in the row (of their
    # concatenation), `updated` is 1 and each learning rate is there.
    bare, got = ppo_per_epoch
    check_twins(bare, got)
    rows = got.run.batches()
    assert len(rows) == 3 and (rows["updated"] == 1).all()
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), np.float32(got.first["epoch_loss"]))
    epoch, policy = np.array(got.first["epoch"]), np.array(got.first["policy"])
    norms = got.first["norms"]
    for keys, which in ((variable_keys(got.loop.actor.trainable_variables), policy),
                        (variable_keys(got.loop.critic.trainable_variables), ~policy)):
        expected = [np.sqrt(np.sum([np.square(norms[i]) for i in np.flatnonzero(which & (epoch == e))], axis=0))
                    for e in range(3)]
        np.testing.assert_allclose(rows[[f"grad_norm/{k}" for k in keys]].to_numpy(np.float64), expected, rtol=1e-5)
    np.testing.assert_allclose(rows["learning_rate/policy_optimizer"], 3e-2, rtol=1e-7)
    np.testing.assert_allclose(rows["learning_rate/value_optimizer"], 1e-2, rtol=1e-7)
    assert warnings_of(got.run) == []


@pytest.fixture(scope="module")
def ddpg_with_targets():
    """The DDPG loop watched through one model that holds all four networks
    (what a user may pass: the agent), both optimizers found on it."""
    loop = DDPG()
    agent = Agent(actor=loop.actor_model, critic=loop.critic_model, target_actor=loop.target_actor,
                  target_critic=loop.target_critic, critic_optimizer=loop.critic_optimizer,
                  actor_optimizer=loop.actor_optimizer)
    with lab.watch(agent) as run:
        first = loop.train(20, run)
    return loop, run, first


def test_ddpg_watched_with_its_target_networks_trains_as_bare_and_leaves_their_columns_nan(ddpg, ddpg_with_targets):
    bare, _ = ddpg
    loop, run, first = ddpg_with_targets
    assert_same_arrays(arrays(*loop.models), bare.middle[0], "weights, the agent with its targets watched")
    assert_same_arrays(arrays(*loop.optimizers), bare.middle[1], "optimizer variables")
    np.testing.assert_array_equal(first["loss"], bare.first["loss"])
    rows = run.batches()
    trained = variable_keys(loop.actor_model.trainable_variables + loop.critic_model.trainable_variables)
    targets = variable_keys(loop.target_actor.trainable_variables + loop.target_critic.trainable_variables)
    check_gradient_columns(rows, trained, np.ones(len(rows), bool), first["norms"])
    # No optimizer updates the targets (a soft assign does): their columns are NaN throughout.
    assert rows[[f"grad_norm/{k}" for k in targets]].isna().all().all()
    np.testing.assert_allclose(rows["learning_rate/critic_optimizer"], 0.002, rtol=1e-7)


def test_ddpg_watched_with_its_target_networks_says_that_no_optimizer_updates_them(ddpg_with_targets):
    loop, run, _ = ddpg_with_targets
    targets = variable_keys(loop.target_actor.trainable_variables + loop.target_critic.trainable_variables)
    told = " ".join(run.events().query("kind == 'warning'")["detail"])
    assert "no watched optimizer updated in this block" in told and any(k in told for k in targets), \
        f"no event names the never-updated variables: {run.events()}"
