"""A GAN trained by `fit()` on Keras' JAX backend, written as people write one
there: keras-io's DCGAN ("GAN overriding `Model.train_step`") turned into a
stateless `train_step(self, state, data)`, with two optimizers of its own.

Keras' JAX `fit()` carries only `model.optimizer`'s variables in the state it
threads through the step, so a model with two optimizers overrides the two
trainer methods that make and sync that state (`_get_jax_state`,
`jax_state_sync`) to carry both optimizers' variables, and its step slices
them apart again (the pattern of JAX GAN libraries built on Keras 3).
"""

import jax
import keras
from keras import ops


def make_generator(latent_dim=8):
    return keras.Sequential([keras.Input((latent_dim,)), keras.layers.Dense(16), keras.layers.LeakyReLU(0.2),
                             keras.layers.Dense(12, activation="sigmoid")], name="generator")


def make_discriminator():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16), keras.layers.LeakyReLU(0.2),
                             keras.layers.Dense(1)], name="discriminator")


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def build(self, input_shape=None):
        self.d_optimizer.build(self.discriminator.trainable_variables)
        self.g_optimizer.build(self.generator.trainable_variables)
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    # -- the state fit() threads through the step: both optimizers' variables --

    def _optimizers_variables(self):
        return list(self.d_optimizer.variables) + list(self.g_optimizer.variables)

    def _get_jax_state(self, trainable_variables=False, non_trainable_variables=False,
                       optimizer_variables=False, metrics_variables=False, purge_model_variables=False):
        state = []
        if trainable_variables:
            state.append([v.value for v in self.trainable_variables])
        if non_trainable_variables:
            state.append([v.value for v in self.non_trainable_variables])
        if optimizer_variables:
            state.append([v.value for v in self._optimizers_variables()])
        if metrics_variables:
            state.append([v.value for v in self.metrics_variables])
        return tuple(state)

    def jax_state_sync(self):
        if not getattr(self, "_jax_state", None) or self._jax_state_synced:
            return
        groups = [(self.trainable_variables, "trainable_variables"),
                  (self.non_trainable_variables, "non_trainable_variables"),
                  (self._optimizers_variables(), "optimizer_variables"),
                  (self.metrics_variables, "metrics_variables")]
        for variables, key in groups:
            for variable, value in zip(variables, self._jax_state.get(key) or []):
                variable.assign(value)
        self._jax_state_synced = True

    # -- the step ---------------------------------------------------------------

    def _split(self, values, first):
        return list(values[:len(first)]), list(values[len(first):])

    def _d_loss(self, d_trainable, d_non_trainable, images, labels):
        predictions, d_non_trainable = self.discriminator.stateless_call(
            d_trainable, d_non_trainable, images, training=True)
        return self.loss_fn(labels, predictions), d_non_trainable

    def train_step(self, state, data):
        real_images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        trainable, non_trainable, optimizer_values, metric_values = state
        # The model tracks the discriminator first, then the generator, then
        # its own seed generator's state (a non-trainable variable).
        d_trainable, g_trainable = self._split(trainable, self.discriminator.trainable_variables)
        d_non_trainable, rest = self._split(non_trainable, self.discriminator.non_trainable_variables)
        g_non_trainable, seed_state = self._split(rest, self.generator.non_trainable_variables)
        d_opt_values, g_opt_values = self._split(optimizer_values, self.d_optimizer.variables)
        batch_size = ops.shape(real_images)[0]
        with keras.StatelessScope(state_mapping=list(zip([self.seed_generator.state], seed_state))) as scope:
            d_latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            g_latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            noise = keras.random.uniform((2 * batch_size, 1), seed=self.seed_generator)
        seed_state = [scope.get_current_value(self.seed_generator.state)]

        # Train the discriminator on generated and real images.
        fakes, g_non_trainable = self.generator.stateless_call(g_trainable, g_non_trainable, d_latent)
        images = ops.concatenate([fakes, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * noise  # noise in the labels, as keras-io's DCGAN adds
        (d_loss, d_non_trainable), d_grads = jax.value_and_grad(self._d_loss, has_aux=True)(
            d_trainable, d_non_trainable, images, labels)
        d_trainable, d_opt_values = self.d_optimizer.stateless_apply(d_opt_values, d_grads, d_trainable)

        # Train the generator through the discriminator.
        misleading = ops.zeros((batch_size, 1))

        def g_loss_fn(g_trainable):
            generated, _ = self.generator.stateless_call(g_trainable, g_non_trainable, g_latent)
            predictions, _ = self.discriminator.stateless_call(d_trainable, d_non_trainable, generated)
            return self.loss_fn(misleading, predictions)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(g_trainable)
        g_trainable, g_opt_values = self.g_optimizer.stateless_apply(g_opt_values, g_grads, g_trainable)

        metric_values = list(metric_values)
        d_vars, g_vars = self._split(metric_values, self.d_loss_tracker.variables)
        d_vars = self.d_loss_tracker.stateless_update_state(d_vars, d_loss)
        g_vars = self.g_loss_tracker.stateless_update_state(g_vars, g_loss)
        logs = {"d_loss": self.d_loss_tracker.stateless_result(d_vars),
                "g_loss": self.g_loss_tracker.stateless_result(g_vars)}
        state = (d_trainable + g_trainable, d_non_trainable + g_non_trainable + seed_state,
                 d_opt_values + g_opt_values, list(d_vars) + list(g_vars))
        return logs, state


def make_gan(seed=0, latent_dim=8):
    keras.utils.set_random_seed(seed)
    gan = GAN(make_discriminator(), make_generator(latent_dim), latent_dim)
    gan.compile(d_optimizer=keras.optimizers.Adam(3e-3), g_optimizer=keras.optimizers.Adam(3e-3),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    gan.build()
    return gan
