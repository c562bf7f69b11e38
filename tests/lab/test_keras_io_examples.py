"""More keras-io examples' training paths, with the lab attached.

As in test_keras_io_guides.py (whose harness these tests use: `fit_three`
and the guide checks), each example below (keras-team/keras-io) is
re-expressed in small, on generated data or sklearn's 8x8 digits instead of
its download:

- examples/generative/ddim.py: a DiffusionModel whose train_step draws noises
  and diffusion times (`tf.random`), trains a small U-Net with sinusoidal
  embeddings through its own tape and AdamW, and updates an EMA copy of the
  network with `assign` (weights changed outside the optimizer); a
  Normalization layer adapted before fit(); a test_step that samples by
  reverse diffusion with the EMA network and feeds a KID metric (its
  InceptionV3 encoder replaced by a small fixed convolution, see `KID`);
- examples/vision/semisupervised_simclr.py: a ContrastiveModel with its own
  compile(contrastive_optimizer, probe_optimizer), a zip of an unlabelled and
  a labelled dataset, augmenters of RandomFlip, RandomTranslation, RandomZoom
  and a RandomColorAffine of its own (all drawing from Keras SeedGenerators),
  the NT-Xent contrastive loss, a linear probe on the encoder, four trackers;
- examples/vision/gradient_centralization.py (its Keras 3 version): a
  Sequential convnet trained with a GCRMSprop that centralizes gradients by
  overriding `get_gradients`; and, beside it, the centralization done where a
  Keras 3 optimizer does call it: in `apply()` and in `update_step()`;
- examples/nlp/masked_language_modeling.py: a BERT-like encoder fit on
  (masked tokens, tokens, sample weights) whose weights keep only the masked
  tokens, an unreduced SparseCategoricalCrossentropy and a Mean tracker of
  the model's own; in its Keras 3 version through overrides of compute_loss
  (returning the weighted token losses' sum) and compute_metrics, and in its
  tf.keras version through a train_step of its own that unpacks the three;
- examples/vision/supervised-contrastive-learning.py: an encoder
  (augmentation with an adapted Normalization, BatchNormalization) pretrained
  under a projection head on a SupervisedContrastiveLoss overriding
  `__call__` (tfa's npairs_loss re-expressed in tf ops), then every layer of
  it frozen under a classifier with Dropouts, compiled and fit again;
- examples/nlp/lstm_seq2seq.py: an encoder-decoder of two inputs, the
  encoder LSTM's states the decoder LSTM's `initial_state`, the decoder
  teacher-forced, fit with `validation_split`;
- examples/generative/real_nvp.py: a RealNVP of affine coupling models (l2
  kernel regularizers its loss leaves out) with its own train_step and
  test_step on the negative log-likelihood (tfp's MultivariateNormalDiag
  log_prob re-expressed in tf ops), `validation_split`;
- examples/vision/adamatch.py: a trainer around a Wide-ResNet whose
  train_step takes a zip of two zips (source and target, weakly and strongly
  augmented), runs the network twice (BatchNormalization training, then in
  inference mode), interpolates logits with an unseeded `tf.random.uniform`,
  masks pseudo-labels behind `tf.stop_gradient` and weights the target loss
  by a warm-up that reads a `tf.Variable` step counter the step counts up;
  Adam on a CosineDecay.

Each is trained bare, with the oracle and with `lab.Recorder(gradients=True)`
(`fit_three`) and checked: weights (the EMA network's too), every optimizer's
state and Keras' History equal the bare fit()'s exactly; the rows hold each
batch's own tracker values; a gradient column for every variable an
optimizer updated; the graph Stepper steps to fit()'s weights and rewinds
exactly; no trace is left. And per example: the EMA network is what fit()
averaged and a rewind puts it back; the SimCLR columns are the contrastive
loss's gradients for the encoder and the probe loss's for the probe; the
gradient-centralization columns hold the gradients the update used, and
where they cannot (a centralizing `update_step`) the run says so; the masked
language model's columns are the gradients of its summed token losses and
its tf.keras version's rows the masked tokens' mean loss; the supervised
contrastive phases, a Recorder each, train as bare, the frozen encoder keeps
its weights and has no gradient column, and one Recorder for both phases
refuses the second model before any step and leaves it to train as bare;
seq2seq's rows are the training split's batches and its epochs hold the
validation; Real NVP's rows hold the loss without the l2 penalties, and its
test_step's val_loss is the held-out points'; AdaMatch's step counter
(outside the weights) counts as bare and a rewind puts it back.

Before a lab run is compared with the bare one, bare fit() is checked
reproducible: the oracle run (a bare fit() whose callback only resets the
trackers) ends with the bare run's weights and optimizer states.

Findings: the Keras 3 version of the gradient-centralization example
centralizes nothing (Keras 3's optimizers never call `get_gradients`; its
GCRMSprop trains bit for bit as RMSprop): the run's columns rightly hold the
uncentralized gradients it applies, and the run names the override that
never runs (`lab.backend.tensorflow.probes.UNCALLED_NOTE`). DDIM's unseeded `tf.random` draws
make a later plain fit() after the lab's differ (RETRACE_AFTER_FIT, xfail).
The Keras 3 masked language model logs a tracker of its own as its "loss"
(the tokens' mean, where compute_loss returns their sum): the run's column
held compute_loss's sum until the lab took such a tracker's batch value.
Real NVP's lab fit() once parted from its bare one by an ulp in a few
biases, after the examples before it in this file: the harness named the lab's
model after the bare one's, and Grappler sums a gradient's parts in the order
of their layers' names (`test_keras_io_guides.named_alike`).
"""

import math
import pathlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

# keras-io's programs are written for the newest Keras: they run on the newest stack, not on the
# oldest one (docs/testing.md, "What the oldest stack runs").
pytestmark = pytest.mark.newest_only

# pytest imports test files with --import-mode=importlib (pyproject.toml),
# which puts no test folder on sys.path: the guides' harness is imported from here.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_keras_io_guides import (RETRACE_AFTER_FIT, SEED, Guide, assert_same_arrays, assert_same_optimizer_state,
                                  check_batch_values, check_gradient_columns, check_history, check_no_trace,
                                  check_optimizer, check_stepper, check_weights, fit_three, lab_traces, name_counters,
                                  named_alike, optimizer_state, rng, stepped, variable_keys, weights)

import lab
from lab.backend.tensorflow.probes import RANDOM_NOTE, UPDATE_STEP_NOTE


def digits(n, offset=0):
    from sklearn.datasets import load_digits
    data = load_digits()
    return data.images[offset:offset + n] / 16.0, data.target[offset:offset + n]


def coloured(images, scale):
    """8x8 grey digits as `scale` times larger RGB images, each channel tinted."""
    big = np.kron(images, np.ones((scale, scale)))[..., None]
    return (big * np.array([1.0, 0.8, 0.6])).astype("float32")


def keys_of(t, variables):
    """The lab model's keys of `variables` (twins matched by position)."""
    ids = {id(v) for v in variables}
    return [k for k, v in zip(variable_keys(t.lab.trainable_variables), t.lab.trainable_variables) if id(v) in ids]


def check_columns_for(t, with_gradient, without_gradient=()):
    """A grad_norm/<key> column for each of `with_gradient` (all finite, not
    all zero); for `without_gradient`, no value (no column, or NaN: "no
    value" in a row); `grad_norm` the norm of the row's columns."""
    rows = t.rows
    columns = [f"grad_norm/{k}" for k in with_gradient]
    missing = [c for c in columns if c not in rows.columns]
    assert not missing, f"no gradient column for {missing}"
    values = rows[columns].to_numpy(np.float64)
    assert np.isfinite(values).all() and (values > 0).any(axis=0).all()
    extra = [k for k in without_gradient if f"grad_norm/{k}" in rows.columns and rows[f"grad_norm/{k}"].notna().any()]
    assert not extra, f"gradient norms for variables no gradient reaches: {extra}"
    every = [c for c in rows.columns if c.startswith("grad_norm/")]
    np.testing.assert_allclose(rows["grad_norm"].to_numpy(np.float64),
                               np.sqrt(np.nansum(rows[every].to_numpy(np.float64) ** 2, axis=1)), rtol=1e-5)


# =================================================================================
# Path of keras-io's examples/generative/ddim.py: a DiffusionModel with a
# Normalization layer adapted to the training images before fit(), a U-Net
# (residual blocks, skips, a sinusoidal embedding of the noise variance in a
# Lambda layer, BatchNormalization without center and scale, a last
# convolution initialized to zeros) and its EMA copy made by clone_model; a
# train_step that draws noises and diffusion times with `tf.random`, mixes
# them by the cosine schedule, applies the noise loss's gradient (mean
# absolute error) with AdamW and then assigns the EMA weights; a test_step
# that also samples images by reverse diffusion with the EMA network for KID.
# In small: 8x8 RGB digits, widths (8, 16), one block per level, batches of 8,
# two sampling steps for KID.
# =================================================================================

DDIM_SIZE = 8
DDIM_BATCH = 8
DDIM_EMBEDDING_DIMS = 8
DDIM_EMBEDDING_MAX_FREQUENCY = 1000.0
DDIM_MIN_SIGNAL_RATE, DDIM_MAX_SIGNAL_RATE = 0.02, 0.95
DDIM_EMA = 0.999
DDIM_KID_STEPS = 2


class KID(keras.metrics.Metric):
    """The example's KID, its estimate of the squared maximum mean discrepancy
    of polynomial kernels averaged over batches, on features of a small fixed
    random convolution instead of ImageNet's InceptionV3 (a download, and too
    heavy here); the rescaling to 0-255 is kept, the resizing to 75x75 is not."""

    def __init__(self, name="kid", **kwargs):
        super().__init__(name=name, **kwargs)
        self.kid_tracker = keras.metrics.Mean()
        self.encoder = keras.Sequential([
            keras.Input(shape=(DDIM_SIZE, DDIM_SIZE, 3)),
            layers.Rescaling(255.0),
            layers.Conv2D(8, 3, activation="relu", trainable=False),
            layers.GlobalAveragePooling2D(),
        ], name="kid_encoder")

    def polynomial_kernel(self, features_1, features_2):
        feature_dimensions = tf.cast(tf.shape(features_1)[1], dtype=tf.float32)
        return (features_1 @ tf.transpose(features_2) / feature_dimensions + 1.0) ** 3.0

    def update_state(self, real_images, generated_images, sample_weight=None):
        real_features = self.encoder(real_images, training=False)
        generated_features = self.encoder(generated_images, training=False)
        kernel_real = self.polynomial_kernel(real_features, real_features)
        kernel_generated = self.polynomial_kernel(generated_features, generated_features)
        kernel_cross = self.polynomial_kernel(real_features, generated_features)
        batch_size = tf.shape(real_features)[0]
        batch_size_f = tf.cast(batch_size, dtype=tf.float32)
        mean_kernel_real = tf.reduce_sum(kernel_real * (1.0 - tf.eye(batch_size))) / (
            batch_size_f * (batch_size_f - 1.0))
        mean_kernel_generated = tf.reduce_sum(kernel_generated * (1.0 - tf.eye(batch_size))) / (
            batch_size_f * (batch_size_f - 1.0))
        mean_kernel_cross = tf.reduce_mean(kernel_cross)
        self.kid_tracker.update_state(mean_kernel_real + mean_kernel_generated - 2.0 * mean_kernel_cross)

    def result(self):
        return self.kid_tracker.result()

    def reset_state(self):
        self.kid_tracker.reset_state()


@keras.saving.register_keras_serializable(package="keras_io_examples")
def sinusoidal_embedding(x):
    frequencies = tf.exp(tf.linspace(tf.math.log(1.0), tf.math.log(DDIM_EMBEDDING_MAX_FREQUENCY),
                                     DDIM_EMBEDDING_DIMS // 2))
    angular_speeds = 2.0 * math.pi * frequencies
    return tf.concat([tf.sin(angular_speeds * x), tf.cos(angular_speeds * x)], axis=3)


def residual_block(width):
    def apply(x):
        residual = x if x.shape[3] == width else layers.Conv2D(width, kernel_size=1)(x)
        x = layers.BatchNormalization(center=False, scale=False)(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same", activation=keras.activations.swish)(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same")(x)
        return layers.Add()([x, residual])
    return apply


def get_network(image_size, widths, block_depth):
    noisy_images = keras.Input(shape=(image_size, image_size, 3))
    noise_variances = keras.Input(shape=(1, 1, 1))
    e = layers.Lambda(sinusoidal_embedding, output_shape=(1, 1, DDIM_EMBEDDING_DIMS))(noise_variances)
    e = layers.UpSampling2D(size=image_size, interpolation="nearest")(e)
    x = layers.Conv2D(widths[0], kernel_size=1)(noisy_images)
    x = layers.Concatenate()([x, e])
    skips = []
    for width in widths[:-1]:  # DownBlock
        for _ in range(block_depth):
            x = residual_block(width)(x)
            skips.append(x)
        x = layers.AveragePooling2D(pool_size=2)(x)
    for _ in range(block_depth):
        x = residual_block(widths[-1])(x)
    for width in reversed(widths[:-1]):  # UpBlock
        x = layers.UpSampling2D(size=2, interpolation="bilinear")(x)
        for _ in range(block_depth):
            x = layers.Concatenate()([x, skips.pop()])
            x = residual_block(width)(x)
    x = layers.Conv2D(3, kernel_size=1, kernel_initializer="zeros")(x)
    return keras.Model([noisy_images, noise_variances], x, name="residual_unet")


class DiffusionModel(keras.Model):
    def __init__(self, image_size, widths, block_depth):
        super().__init__()
        self.normalizer = layers.Normalization()
        self.network = get_network(image_size, widths, block_depth)
        self.ema_network = keras.models.clone_model(self.network)

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")
        self.image_loss_tracker = keras.metrics.Mean(name="i_loss")
        self.kid = KID(name="kid")

    @property
    def metrics(self):
        return [self.noise_loss_tracker, self.image_loss_tracker, self.kid]

    def denormalize(self, images):
        images = self.normalizer.mean + images * self.normalizer.variance ** 0.5
        return tf.clip_by_value(images, 0.0, 1.0)

    def diffusion_schedule(self, diffusion_times):
        start_angle = tf.acos(DDIM_MAX_SIGNAL_RATE)
        end_angle = tf.acos(DDIM_MIN_SIGNAL_RATE)
        diffusion_angles = start_angle + diffusion_times * (end_angle - start_angle)
        return tf.sin(diffusion_angles), tf.cos(diffusion_angles)

    def denoise(self, noisy_images, noise_rates, signal_rates, training):
        network = self.network if training else self.ema_network
        pred_noises = network([noisy_images, noise_rates ** 2], training=training)
        pred_images = (noisy_images - noise_rates * pred_noises) / signal_rates
        return pred_noises, pred_images

    def reverse_diffusion(self, initial_noise, diffusion_steps):
        num_images = initial_noise.shape[0]
        step_size = 1.0 / diffusion_steps
        next_noisy_images = initial_noise
        for step in range(diffusion_steps):
            noisy_images = next_noisy_images
            diffusion_times = tf.ones((num_images, 1, 1, 1)) - step * step_size
            noise_rates, signal_rates = self.diffusion_schedule(diffusion_times)
            pred_noises, pred_images = self.denoise(noisy_images, noise_rates, signal_rates, training=False)
            next_noise_rates, next_signal_rates = self.diffusion_schedule(diffusion_times - step_size)
            next_noisy_images = next_signal_rates * pred_images + next_noise_rates * pred_noises
        return pred_images

    def generate(self, num_images, diffusion_steps):
        initial_noise = tf.random.normal(shape=(num_images, DDIM_SIZE, DDIM_SIZE, 3))
        return self.denormalize(self.reverse_diffusion(initial_noise, diffusion_steps))

    def _noisy(self, images, training):
        images = self.normalizer(images, training=training)
        noises = tf.random.normal(shape=(DDIM_BATCH, DDIM_SIZE, DDIM_SIZE, 3))
        diffusion_times = tf.random.uniform(shape=(DDIM_BATCH, 1, 1, 1), minval=0.0, maxval=1.0)
        noise_rates, signal_rates = self.diffusion_schedule(diffusion_times)
        return images, noises, signal_rates * images + noise_rates * noises, noise_rates, signal_rates

    def train_step(self, images):
        images, noises, noisy_images, noise_rates, signal_rates = self._noisy(images, True)
        with tf.GradientTape() as tape:
            pred_noises, pred_images = self.denoise(noisy_images, noise_rates, signal_rates, training=True)
            noise_loss = self.loss(noises, pred_noises)  # used for training
            image_loss = self.loss(images, pred_images)  # only used as metric
        gradients = tape.gradient(noise_loss, self.network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))
        self.noise_loss_tracker.update_state(noise_loss)
        self.image_loss_tracker.update_state(image_loss)
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(DDIM_EMA * ema_weight + (1 - DDIM_EMA) * weight)
        return {m.name: m.result() for m in self.metrics[:-1]}

    def test_step(self, images):
        images, noises, noisy_images, noise_rates, signal_rates = self._noisy(images, False)
        pred_noises, pred_images = self.denoise(noisy_images, noise_rates, signal_rates, training=False)
        self.image_loss_tracker.update_state(self.loss(images, pred_images))
        self.noise_loss_tracker.update_state(self.loss(noises, pred_noises))
        images = self.denormalize(images)
        generated_images = self.generate(num_images=DDIM_BATCH, diffusion_steps=DDIM_KID_STEPS)
        self.kid.update_state(images, generated_images)
        return {m.name: m.result() for m in self.metrics}


def ddim_images(n=32, offset=0):
    return coloured(digits(n, offset)[0], 1)


def make_ddim():
    keras.utils.set_random_seed(SEED)
    model = DiffusionModel(DDIM_SIZE, widths=(8, 16), block_depth=1)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
                  loss=keras.losses.mean_absolute_error)
    model.normalizer.adapt(ddim_images())
    return model


def _ddim():
    x, validation = ddim_images(), ddim_images(16, offset=32)
    return ((x,), {"batch_size": DDIM_BATCH, "epochs": 2, "validation_data": validation},
            x, DDIM_BATCH, 8)


# =================================================================================
# Path of keras-io's examples/vision/semisupervised_simclr.py (Keras 3): a
# ContrastiveModel whose compile() takes a contrastive and a probe optimizer
# (Keras' own `optimizer` left at its default, unused); a train_step on a zip
# of unlabelled and labelled batches that augments the images twice, trains
# encoder and projection head on the NT-Xent loss with one optimizer, then a
# linear probe on the frozen encoder's features of weakly augmented labelled
# images with the other; c_loss, c_acc, p_loss, p_acc trackers; a test_step
# for the probe. In small: 32x32 RGB digits (0-255), width 16, batches of 8
# unlabelled and 4 labelled images.
# =================================================================================

SIMCLR_WIDTH = 16
SIMCLR_IMAGE = 32
SIMCLR_TEMPERATURE = 0.1
CONTRASTIVE_AUGMENTATION = {"min_area": 0.25, "brightness": 0.6, "jitter": 0.2}
CLASSIFICATION_AUGMENTATION = {"min_area": 0.75, "brightness": 0.3, "jitter": 0.1}


class RandomColorAffine(layers.Layer):
    def __init__(self, brightness=0, jitter=0, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.brightness = brightness
        self.jitter = jitter

    def call(self, images, training=True):
        if training:
            batch_size = ops.shape(images)[0]
            brightness_scales = 1 + keras.random.uniform((batch_size, 1, 1, 1), minval=-self.brightness,
                                                         maxval=self.brightness, seed=self.seed_generator)
            jitter_matrices = keras.random.uniform((batch_size, 1, 3, 3), minval=-self.jitter, maxval=self.jitter,
                                                   seed=self.seed_generator)
            color_transforms = (ops.tile(ops.expand_dims(ops.eye(3), axis=0), (batch_size, 1, 1, 1))
                                * brightness_scales + jitter_matrices)
            images = ops.clip(ops.matmul(images, color_transforms), 0, 1)
        return images


def get_augmenter(min_area, brightness, jitter):
    zoom_factor = 1.0 - math.sqrt(min_area)
    return keras.Sequential([
        layers.Rescaling(1 / 255),
        layers.RandomFlip("horizontal"),
        layers.RandomTranslation(zoom_factor / 2, zoom_factor / 2),
        layers.RandomZoom((-zoom_factor, 0.0), (-zoom_factor, 0.0)),
        RandomColorAffine(brightness, jitter),
    ])


def get_encoder():
    return keras.Sequential([
        layers.Conv2D(SIMCLR_WIDTH, kernel_size=3, strides=2, activation="relu"),
        layers.Conv2D(SIMCLR_WIDTH, kernel_size=3, strides=2, activation="relu"),
        layers.Conv2D(SIMCLR_WIDTH, kernel_size=3, strides=2, activation="relu"),
        layers.Conv2D(SIMCLR_WIDTH, kernel_size=3, strides=2, activation="relu"),
        layers.Flatten(),
        layers.Dense(SIMCLR_WIDTH, activation="relu"),
    ], name="encoder")


class ContrastiveModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.temperature = SIMCLR_TEMPERATURE
        self.contrastive_augmenter = get_augmenter(**CONTRASTIVE_AUGMENTATION)
        self.classification_augmenter = get_augmenter(**CLASSIFICATION_AUGMENTATION)
        self.encoder = get_encoder()
        self.projection_head = keras.Sequential([
            keras.Input(shape=(SIMCLR_WIDTH,)),
            layers.Dense(SIMCLR_WIDTH, activation="relu"),
            layers.Dense(SIMCLR_WIDTH),
        ], name="projection_head")
        self.linear_probe = keras.Sequential([layers.Input(shape=(SIMCLR_WIDTH,)), layers.Dense(10)],
                                             name="linear_probe")

    def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
        super().compile(**kwargs)
        self.contrastive_optimizer = contrastive_optimizer
        self.probe_optimizer = probe_optimizer
        self.probe_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
        self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")
        self.probe_loss_tracker = keras.metrics.Mean(name="p_loss")
        self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

    @property
    def metrics(self):
        return [self.contrastive_loss_tracker, self.contrastive_accuracy, self.probe_loss_tracker,
                self.probe_accuracy]

    def contrastive_loss(self, projections_1, projections_2):
        projections_1 = ops.normalize(projections_1, axis=1)
        projections_2 = ops.normalize(projections_2, axis=1)
        similarities = ops.matmul(projections_1, ops.transpose(projections_2)) / self.temperature
        batch_size = ops.shape(projections_1)[0]
        contrastive_labels = ops.arange(batch_size)
        self.contrastive_accuracy.update_state(contrastive_labels, similarities)
        self.contrastive_accuracy.update_state(contrastive_labels, ops.transpose(similarities))
        loss_1_2 = keras.losses.sparse_categorical_crossentropy(contrastive_labels, similarities, from_logits=True)
        loss_2_1 = keras.losses.sparse_categorical_crossentropy(contrastive_labels, ops.transpose(similarities),
                                                                from_logits=True)
        return (loss_1_2 + loss_2_1) / 2

    def contrastive_views(self, unlabeled_images, labeled_images):
        images = ops.concatenate((unlabeled_images, labeled_images), axis=0)
        return self.contrastive_augmenter(images, training=True), self.contrastive_augmenter(images, training=True)

    def train_step(self, data):
        (unlabeled_images, _), (labeled_images, labels) = data
        augmented_images_1, augmented_images_2 = self.contrastive_views(unlabeled_images, labeled_images)
        with tf.GradientTape() as tape:
            features_1 = self.encoder(augmented_images_1, training=True)
            features_2 = self.encoder(augmented_images_2, training=True)
            projections_1 = self.projection_head(features_1, training=True)
            projections_2 = self.projection_head(features_2, training=True)
            contrastive_loss = self.contrastive_loss(projections_1, projections_2)
        gradients = tape.gradient(contrastive_loss,
                                  self.encoder.trainable_weights + self.projection_head.trainable_weights)
        self.contrastive_optimizer.apply_gradients(
            zip(gradients, self.encoder.trainable_weights + self.projection_head.trainable_weights))
        self.contrastive_loss_tracker.update_state(contrastive_loss)

        preprocessed_images = self.classification_augmenter(labeled_images, training=True)
        with tf.GradientTape() as tape:
            features = self.encoder(preprocessed_images, training=False)
            class_logits = self.linear_probe(features, training=True)
            probe_loss = self.probe_loss(labels, class_logits)
        gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
        self.probe_optimizer.apply_gradients(zip(gradients, self.linear_probe.trainable_weights))
        self.probe_loss_tracker.update_state(probe_loss)
        self.probe_accuracy.update_state(labels, class_logits)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        labeled_images, labels = data
        preprocessed_images = self.classification_augmenter(labeled_images, training=False)
        features = self.encoder(preprocessed_images, training=False)
        class_logits = self.linear_probe(features, training=False)
        probe_loss = self.probe_loss(labels, class_logits)
        self.probe_loss_tracker.update_state(probe_loss)
        self.probe_accuracy.update_state(labels, class_logits)
        return {m.name: m.result() for m in self.metrics[2:]}


def make_contrastive_model():
    keras.utils.set_random_seed(SEED)
    model = ContrastiveModel()
    model.compile(contrastive_optimizer=keras.optimizers.Adam(), probe_optimizer=keras.optimizers.Adam())
    # The example's encoder and augmenters have no Input: its first step
    # builds them. Built here, so that the weights compared are there from the start.
    for part in (model.contrastive_augmenter, model.classification_augmenter, model.encoder):
        part.build((None, SIMCLR_IMAGE, SIMCLR_IMAGE, 3))
    return model


def simclr_images(n, offset):
    images, labels = digits(n, offset)
    return (coloured(images, 4) * 255.0).astype("float32"), labels.astype("int32")


def _simclr():
    unlabeled, _ = simclr_images(24, 0)
    labeled, labels = simclr_images(12, 100)
    test, test_labels = simclr_images(12, 200)
    train = tf.data.Dataset.zip((
        tf.data.Dataset.from_tensor_slices((unlabeled, np.full(24, -1, "int32"))).batch(8),
        tf.data.Dataset.from_tensor_slices((labeled, labels)).batch(4)))
    validation = tf.data.Dataset.from_tensor_slices((test, test_labels)).batch(6)
    return (train,), {"epochs": 2, "validation_data": validation}, train, None, 6


# =================================================================================
# Path of keras-io's examples/vision/gradient_centralization.py (its Keras 3
# version, `ops.mean`): a Sequential convnet (Conv2D, MaxPooling2D, Dropout,
# Flatten, Dense, a sigmoid output) on binary labels with binary
# cross-entropy and accuracy, trained with `GCRMSprop(RMSprop)`, which
# centralizes gradients in an override of `get_gradients`, the method
# tf.keras' optimizers called. Keras 3's optimizers call no `get_gradients`:
# the example's GCRMSprop trains as RMSprop does (checked below). Beside it,
# the same centralization in the two places a Keras 3 optimizer runs it:
# `apply()` (the gradients then applied are centralized, and so are the
# columns) and `update_step()` (the lab reads the gradients before, and the
# run says so, `lab.backend.tensorflow.probes.UPDATE_STEP_NOTE`). The example's augmentation
# (RandomFlip, RandomRotation, RandomZoom) runs in its tf.data pipeline, not
# in the training step: here it is applied once, seeded, to the data. In
# small: 16x16 RGB digits, "is it 5 or more?", batches of 16.
# =================================================================================


def centralized(grad):
    if grad is not None and len(grad.shape) > 1:
        grad = grad - ops.mean(grad, axis=list(range(len(grad.shape) - 1)), keepdims=True)
    return grad


class GCRMSprop(keras.optimizers.RMSprop):
    """The example's optimizer: `get_gradients`, as the example has it."""

    calls = 0

    def get_gradients(self, loss, params):
        GCRMSprop.calls += 1
        grads = []
        gradients = super().get_gradients()
        for grad in gradients:
            grad_len = len(grad.shape)
            if grad_len > 1:
                axis = list(range(grad_len - 1))
                grad -= ops.mean(grad, axis=axis, keepdims=True)
            grads.append(grad)
        return grads


class ApplyCentralizedRMSprop(keras.optimizers.RMSprop):
    def apply(self, grads, trainable_variables=None):
        return super().apply([centralized(g) for g in grads], trainable_variables)


class UpdateStepCentralizedRMSprop(keras.optimizers.RMSprop):
    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(centralized(gradient), variable, learning_rate)


GC_OPTIMIZERS = {"get_gradients": GCRMSprop, "apply": ApplyCentralizedRMSprop,
                 "update_step": UpdateStepCentralizedRMSprop, "RMSprop": keras.optimizers.RMSprop}


def make_gc_convnet(optimizer):
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([
        keras.Input(shape=(16, 16, 3)),
        layers.Conv2D(4, (3, 3), activation="relu"),
        layers.MaxPooling2D(2, 2),
        layers.Conv2D(8, (3, 3), activation="relu"),
        layers.Dropout(0.5),
        layers.MaxPooling2D(2, 2),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(16, activation="relu"),
        layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(loss="binary_crossentropy", optimizer=GC_OPTIMIZERS[optimizer](learning_rate=1e-3),
                  metrics=["accuracy"])
    return model


def gc_maker(optimizer):
    def make():
        return make_gc_convnet(optimizer)
    make.__name__ = f"make_gc_convnet_{optimizer}"
    return make


_GC_DATA = []


def gc_data():
    """64 digits rescaled to [0, 1] and augmented once, as the example's pipeline does per epoch."""
    if not _GC_DATA:
        images, labels = digits(64, 300)
        keras.utils.set_random_seed(SEED + 3)
        augmentation = keras.Sequential([layers.RandomFlip("horizontal_and_vertical"), layers.RandomRotation(0.3),
                                         layers.RandomZoom(0.2)])
        x = np.asarray(augmentation(coloured(images, 2), training=True), "float32")
        _GC_DATA.append((x, (labels >= 5).astype("float32")[:, None]))
    return _GC_DATA[0]


def _gc():
    x, y = gc_data()
    return (x, y), {"batch_size": 16, "epochs": 2}, (x, y), 16, 8


# =================================================================================
# Path of keras-io's examples/nlp/masked_language_modeling.py: a BERT-like
# encoder (Embedding plus a learned position embedding, MultiHeadAttention,
# Dropouts, LayerNormalizations, a feed-forward Sequential) with a softmax
# over the vocabulary at each position, compiled with Adam and no loss, fit
# on a dataset of (masked tokens, tokens, sample weights): the sample weights
# are 1 on the 15% of tokens masked (90% of those replaced by the mask id, a
# ninth of these by a random token) and 0 elsewhere. Its two versions:
#
# - the Keras 3 one (`MaskedLanguageModel`): Keras' own train_step, with
#   `compute_loss` overridden to return the sum of an unreduced
#   SparseCategoricalCrossentropy's weighted token losses and update a Mean
#   tracker with them (weighted), and `compute_metrics` returning the tracker;
# - the tf.keras one (`MaskedLanguageModelStep`): its own train_step that
#   unpacks (features, labels, sample_weight), takes the gradient of the
#   unreduced (batch, length) loss tensor (a gradient of its sum) and updates
#   the tracker with the weighted tokens.
#
# The example's loss object and tracker are module globals, shared by every
# model built in the process; here each model holds its own (a test builds
# several). keras_hub's PositionEmbedding is re-expressed as its training path:
# a learned (length, width) table added by position. In small: 24 token ids
# (0 the padding, 1-2 special, 23 the mask), 8 tokens, width 8, batches of 8;
# the tokens generated, not vectorized from IMDB reviews.
# =================================================================================

MLM_VOCAB = 24
MLM_MASK_ID = MLM_VOCAB - 1
MLM_LENGTH = 8
MLM_WIDTH = 8
MLM_HEADS = 2
MLM_BATCH = 8


class PositionEmbedding(layers.Layer):
    def __init__(self, sequence_length, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length

    def build(self, input_shape):
        self.position_embeddings = self.add_weight(name="embeddings", shape=(self.sequence_length, input_shape[-1]),
                                                   initializer="glorot_uniform")

    def call(self, inputs):
        shape = ops.shape(inputs)
        positions = ops.slice(ops.convert_to_tensor(self.position_embeddings), (0, 0), (shape[-2], shape[-1]))
        return ops.broadcast_to(positions, shape)


def bert_module(query, key, value, i):
    attention_output = layers.MultiHeadAttention(num_heads=MLM_HEADS, key_dim=MLM_WIDTH // MLM_HEADS,
                                                 name=f"encoder_{i}_multiheadattention")(query, key, value)
    attention_output = layers.Dropout(0.1, name=f"encoder_{i}_att_dropout")(attention_output)
    attention_output = layers.LayerNormalization(epsilon=1e-6, name=f"encoder_{i}_att_layernormalization")(
        query + attention_output)
    ffn = keras.Sequential([layers.Dense(MLM_WIDTH, activation="relu"), layers.Dense(MLM_WIDTH)],
                           name=f"encoder_{i}_ffn")
    ffn_output = layers.Dropout(0.1, name=f"encoder_{i}_ffn_dropout")(ffn(attention_output))
    return layers.LayerNormalization(epsilon=1e-6, name=f"encoder_{i}_ffn_layernormalization")(
        attention_output + ffn_output)


class MaskedLanguageModel(keras.Model):
    """The Keras 3 version: compute_loss and compute_metrics overridden."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        loss = self.loss_fn(y, y_pred, sample_weight)
        self.loss_tracker.update_state(loss, sample_weight=sample_weight)
        return ops.sum(loss)

    def compute_metrics(self, x, y, y_pred, sample_weight):
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


class MaskedLanguageModelStep(MaskedLanguageModel):
    """The tf.keras version: a train_step of its own over (features, labels, sample_weight)."""

    def train_step(self, inputs):
        if len(inputs) == 3:
            features, labels, sample_weight = inputs
        else:
            features, labels = inputs
            sample_weight = None
        with tf.GradientTape() as tape:
            predictions = self(features, training=True)
            loss = self.loss_fn(labels, predictions, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        self.loss_tracker.update_state(loss, sample_weight=sample_weight)
        return {"loss": self.loss_tracker.result()}


def make_masked_language_model(cls=MaskedLanguageModel):
    keras.utils.set_random_seed(SEED)
    inputs = layers.Input((MLM_LENGTH,), dtype="int64")
    word_embeddings = layers.Embedding(MLM_VOCAB, MLM_WIDTH, name="word_embedding")(inputs)
    embeddings = word_embeddings + PositionEmbedding(sequence_length=MLM_LENGTH)(word_embeddings)
    encoder_output = bert_module(embeddings, embeddings, embeddings, 0)
    mlm_output = layers.Dense(MLM_VOCAB, name="mlm_cls", activation="softmax")(encoder_output)
    model = cls(inputs, mlm_output, name="masked_bert_model")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3))
    return model


def make_masked_language_model_step():
    return make_masked_language_model(MaskedLanguageModelStep)


def masked_tokens(n=48):
    """The example's get_masked_input_and_labels on generated token ids
    (3 to 22, padded with 0 after 4 to 8 tokens), its numpy draws seeded."""
    r = rng(20)
    encoded_texts = r.integers(3, MLM_MASK_ID, size=(n, MLM_LENGTH))
    for row, length in zip(encoded_texts, r.integers(4, MLM_LENGTH + 1, n)):
        row[length:] = 0
    inp_mask = r.random(encoded_texts.shape) < 0.15
    inp_mask[encoded_texts <= 2] = False
    labels = -1 * np.ones(encoded_texts.shape, dtype=int)
    labels[inp_mask] = encoded_texts[inp_mask]
    encoded_texts_masked = np.copy(encoded_texts)
    inp_mask_2mask = inp_mask & (r.random(encoded_texts.shape) < 0.90)
    encoded_texts_masked[inp_mask_2mask] = MLM_MASK_ID
    inp_mask_2random = inp_mask_2mask & (r.random(encoded_texts.shape) < 1 / 9)
    encoded_texts_masked[inp_mask_2random] = r.integers(3, MLM_MASK_ID, inp_mask_2random.sum())
    sample_weights = np.ones(labels.shape)
    sample_weights[labels == -1] = 0
    return encoded_texts_masked, np.copy(encoded_texts), sample_weights


def _masked_language_model():
    dataset = tf.data.Dataset.from_tensor_slices(masked_tokens()).batch(MLM_BATCH)
    return (dataset,), {"epochs": 2}, dataset, None, 12


# The Keras 3 version's "loss" (test_rows_hold_each_batch_own_values, xfail):
# scratch/mlm_loss_column.py shows it.
# =================================================================================
# Path of keras-io's examples/vision/supervised-contrastive-learning.py: an
# encoder (augmentation: a Normalization adapted to the training images,
# RandomFlip, RandomRotation and, for the tf.keras RandomWidth and
# RandomHeight Keras 3 lacks, a RandomZoom that stretches height and width
# apart; then a network with BatchNormalization ending in average pooling)
# under a ReLU projection head, compiled with Adam and a
# SupervisedContrastiveLoss (its `__call__` overridden: the l2-normalized
# features' similarities over a temperature, into tensorflow_addons'
# `npairs_loss`, re-expressed here with tf ops as tfa has it) and fit on the
# labels; then `create_classifier(encoder, trainable=False)`: every layer of
# the pretrained encoder frozen, Dropout, a ReLU Dense and a softmax Dense,
# compiled with Adam, SparseCategoricalCrossentropy and
# SparseCategoricalAccuracy, and fit again. ResNet50V2 on CIFAR-10 is replaced
# by two convolutions on 8x8 RGB digits; batches of 16.
# =================================================================================

SUPCON_SHAPE = (8, 8, 3)
SUPCON_TEMPERATURE = 0.05


class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=1, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        feature_vectors_normalized = tf.math.l2_normalize(feature_vectors, axis=1)
        logits = tf.divide(tf.matmul(feature_vectors_normalized, tf.transpose(feature_vectors_normalized)),
                           self.temperature)
        return npairs_loss(tf.squeeze(labels), logits)


def npairs_loss(y_true, y_pred):
    """tensorflow_addons' `tfa.losses.npairs_loss`."""
    y_pred = tf.convert_to_tensor(y_pred)
    y_true = tf.cast(y_true, y_pred.dtype)
    y_true = tf.expand_dims(y_true, -1)
    y_true = tf.cast(tf.equal(y_true, tf.transpose(y_true)), y_pred.dtype)
    y_true /= tf.math.reduce_sum(y_true, 1, keepdims=True)
    loss = tf.nn.softmax_cross_entropy_with_logits(logits=y_pred, labels=y_true)
    return tf.math.reduce_mean(loss)


def supcon_digits(n=48, offset=400):
    images, labels = digits(n, offset)
    return coloured(images, 1), labels.astype("int32")[:, None]


def create_encoder():
    data_augmentation = keras.Sequential([
        layers.Normalization(),
        layers.RandomFlip("horizontal"),
        layers.RandomRotation(0.02),
        layers.RandomZoom(height_factor=0.2, width_factor=0.2),
    ], name="data_augmentation")
    data_augmentation.layers[0].adapt(supcon_digits()[0])
    resnet = keras.Sequential([
        keras.Input(SUPCON_SHAPE),
        layers.Conv2D(8, 3, padding="same"), layers.BatchNormalization(), layers.Activation("relu"),
        layers.Conv2D(8, 3, padding="same"), layers.BatchNormalization(), layers.Activation("relu"),
        layers.GlobalAveragePooling2D(),
    ], name="resnet")
    inputs = keras.Input(shape=SUPCON_SHAPE)
    outputs = resnet(data_augmentation(inputs))
    return keras.Model(inputs=inputs, outputs=outputs, name="encoder")


def add_projection_head(encoder):
    inputs = keras.Input(shape=SUPCON_SHAPE)
    outputs = layers.Dense(8, activation="relu")(encoder(inputs))
    return keras.Model(inputs=inputs, outputs=outputs, name="encoder_with_projection_head")


def create_classifier(encoder, trainable=True):
    for layer in encoder.layers:
        layer.trainable = trainable
    inputs = keras.Input(shape=SUPCON_SHAPE)
    features = layers.Dropout(0.5)(encoder(inputs))
    features = layers.Dense(16, activation="relu")(features)
    features = layers.Dropout(0.5)(features)
    outputs = layers.Dense(10, activation="softmax")(features)
    model = keras.Model(inputs=inputs, outputs=outputs, name="classifier")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def make_supcon_pretraining():
    keras.utils.set_random_seed(SEED)
    encoder_with_projection_head = add_projection_head(create_encoder())
    encoder_with_projection_head.compile(optimizer=keras.optimizers.Adam(1e-3),
                                         loss=SupervisedContrastiveLoss(SUPCON_TEMPERATURE))
    return encoder_with_projection_head


_PRETRAINED = []


def pretrained_encoder_weights():
    """The encoder's weights after the first phase, bare (computed once)."""
    if not _PRETRAINED:
        model = make_supcon_pretraining()
        (x, y), kwargs, _, _, _ = _supcon_pretraining()
        keras.utils.set_random_seed(SEED + 1)
        model.fit(x, y, verbose=0, shuffle=False, **kwargs)
        _PRETRAINED.append(model.get_layer("encoder").get_weights())
    return _PRETRAINED[0]


def make_supcon_classifier():
    pretrained = pretrained_encoder_weights()
    keras.utils.set_random_seed(SEED)
    encoder = create_encoder()
    encoder.set_weights(pretrained)
    return create_classifier(encoder, trainable=False)


def _supcon_pretraining():
    x, y = supcon_digits()
    return (x, y), {"batch_size": 16, "epochs": 2}, (x, y), 16, 6


def _supcon_classifier():
    x, y = supcon_digits()
    return (x, y), {"batch_size": 16, "epochs": 2, "validation_data": supcon_digits(16, 500)}, (x, y), 16, 6


# =================================================================================
# Path of keras-io's examples/nlp/lstm_seq2seq.py: a character-level
# encoder-decoder on one-hot sequences; the encoder LSTM returns its states,
# which are the decoder LSTM's `initial_state`; the decoder is fed the target
# sequence one step behind (teacher forcing) and returns sequences into a
# softmax Dense; a model of two inputs, compiled with "rmsprop",
# categorical_crossentropy and accuracy, fit with `validation_split=0.2`. In
# small: the English-French pairs replaced by generated "sentences" of 2 to 4
# letters of 4 whose translation is the letters reversed, one-hot encoded as
# the example encodes its texts (space-padded, tab and newline as the start
# and end of a target); latent width 8, batches of 8.
# =================================================================================

S2S_LATENT = 8


def seq2seq_data(n=40):
    r = rng(30)
    input_texts = ["".join(r.choice(list("abcd"), size=r.integers(2, 5))) for _ in range(n)]
    target_texts = ["\t" + text[::-1].upper() + "\n" for text in input_texts]
    input_characters = sorted(set("".join(input_texts)) | {" "})
    target_characters = sorted(set("".join(target_texts)) | {" "})
    input_token_index = {char: i for i, char in enumerate(input_characters)}
    target_token_index = {char: i for i, char in enumerate(target_characters)}
    max_encoder_seq_length = max(len(txt) for txt in input_texts)
    max_decoder_seq_length = max(len(txt) for txt in target_texts)
    encoder_input_data = np.zeros((n, max_encoder_seq_length, len(input_characters)), dtype="float32")
    decoder_input_data = np.zeros((n, max_decoder_seq_length, len(target_characters)), dtype="float32")
    decoder_target_data = np.zeros((n, max_decoder_seq_length, len(target_characters)), dtype="float32")
    for i, (input_text, target_text) in enumerate(zip(input_texts, target_texts)):
        for t, char in enumerate(input_text):
            encoder_input_data[i, t, input_token_index[char]] = 1.0
        encoder_input_data[i, t + 1:, input_token_index[" "]] = 1.0
        for t, char in enumerate(target_text):
            decoder_input_data[i, t, target_token_index[char]] = 1.0
            if t > 0:
                decoder_target_data[i, t - 1, target_token_index[char]] = 1.0
        decoder_input_data[i, t + 1:, target_token_index[" "]] = 1.0
        decoder_target_data[i, t:, target_token_index[" "]] = 1.0
    return encoder_input_data, decoder_input_data, decoder_target_data


def make_seq2seq():
    keras.utils.set_random_seed(SEED)
    encoder_input_data, decoder_input_data, _ = seq2seq_data()
    encoder_inputs = keras.Input(shape=(None, encoder_input_data.shape[-1]))
    encoder = keras.layers.LSTM(S2S_LATENT, return_state=True)
    encoder_outputs, state_h, state_c = encoder(encoder_inputs)
    encoder_states = [state_h, state_c]
    decoder_inputs = keras.Input(shape=(None, decoder_input_data.shape[-1]))
    decoder_lstm = keras.layers.LSTM(S2S_LATENT, return_sequences=True, return_state=True)
    decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
    decoder_outputs = keras.layers.Dense(decoder_input_data.shape[-1], activation="softmax")(decoder_outputs)
    model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def _seq2seq():
    encoder_input_data, decoder_input_data, decoder_target_data = seq2seq_data()
    train = 32  # validation_split=0.2 holds out the last 8
    return (([encoder_input_data, decoder_input_data], decoder_target_data),
            {"batch_size": 8, "epochs": 2, "validation_split": 0.2},
            ((encoder_input_data[:train], decoder_input_data[:train]), decoder_target_data[:train]), 8, 8)


# =================================================================================
# Path of keras-io's examples/generative/real_nvp.py: a RealNVP model of
# affine coupling layers (each a functional model of two five-layer Dense
# stacks, s with a tanh output and t with a linear one, every kernel under an
# l2 regularizer that the step's loss never adds), alternating masks held as
# a numpy array, a call() that runs the couplings backwards when training;
# its own train_step and test_step on the negative log-likelihood (the latent
# distribution's log-density plus the log-determinant of the Jacobian) with a
# Mean tracker; Adam(1e-4), `validation_split=0.2`. The latent distribution,
# tensorflow_probability's MultivariateNormalDiag(loc=[0, 0], scale_diag=[1,
# 1]) (tfp is not installed), is re-expressed as its log_prob in tf ops. In
# small: 80 points of sklearn's make_moons (generated, not downloaded),
# normalized by an adapted Normalization as in the example; width 8 instead
# of 256, two coupling layers instead of six, batches of 16.
# =================================================================================

NVP_WIDTH = 8
NVP_REG = 0.01


def Coupling(input_shape):
    regularizer = keras.regularizers.l2(NVP_REG)
    input = keras.layers.Input(shape=(input_shape,))
    t = input
    for _ in range(4):
        t = keras.layers.Dense(NVP_WIDTH, activation="relu", kernel_regularizer=regularizer)(t)
    t = keras.layers.Dense(input_shape, activation="linear", kernel_regularizer=regularizer)(t)
    s = input
    for _ in range(4):
        s = keras.layers.Dense(NVP_WIDTH, activation="relu", kernel_regularizer=regularizer)(s)
    s = keras.layers.Dense(input_shape, activation="tanh", kernel_regularizer=regularizer)(s)
    return keras.Model(inputs=input, outputs=[s, t])


class StandardNormalDiag:
    """tfp.distributions.MultivariateNormalDiag(loc=[0., 0.], scale_diag=[1., 1.])'s log_prob."""

    def log_prob(self, y):
        return tf.reduce_sum(-0.5 * tf.square(y) - 0.5 * math.log(2.0 * math.pi), axis=-1)


class RealNVP(keras.Model):
    def __init__(self, num_coupling_layers):
        super().__init__()
        self.num_coupling_layers = num_coupling_layers
        self.distribution = StandardNormalDiag()
        self.masks = np.array([[0, 1], [1, 0]] * (num_coupling_layers // 2), dtype="float32")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.layers_list = [Coupling(2) for i in range(num_coupling_layers)]

    @property
    def metrics(self):
        return [self.loss_tracker]

    def call(self, x, training=True):
        log_det_inv = 0
        direction = 1
        if training:
            direction = -1
        for i in range(self.num_coupling_layers)[::direction]:
            x_masked = x * self.masks[i]
            reversed_mask = 1 - self.masks[i]
            s, t = self.layers_list[i](x_masked)
            s *= reversed_mask
            t *= reversed_mask
            gate = (direction - 1) / 2
            x = reversed_mask * (x * tf.exp(direction * s) + direction * t * tf.exp(gate * s)) + x_masked
            log_det_inv += gate * tf.reduce_sum(s, [1])
        return x, log_det_inv

    def log_loss(self, x):
        y, logdet = self(x)
        log_likelihood = self.distribution.log_prob(y) + logdet
        return -tf.reduce_mean(log_likelihood)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = self.log_loss(data)
        g = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(g, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        loss = self.log_loss(data)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def moons(n=80):
    from sklearn.datasets import make_moons
    data = make_moons(n, noise=0.05, random_state=SEED)[0].astype("float32")
    norm = layers.Normalization()
    norm.adapt(data)
    return np.asarray(norm(data))


def make_real_nvp():
    keras.utils.set_random_seed(SEED)
    model = RealNVP(num_coupling_layers=2)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-4))
    model.build((None, 2))
    return model


def _real_nvp():
    x = moons()
    return (x,), {"batch_size": 16, "epochs": 2, "validation_split": 0.2}, x[:64], 16, 8


# =================================================================================
# Path of keras-io's examples/vision/adamatch.py: an AdaMatch trainer model
# wrapping a Wide-ResNet (Rescaling, BatchNormalization before each
# convolution, l2 kernel regularizers its loss leaves out) whose train_step
# takes a zip of a source dataset (a zip of weakly and strongly augmented
# labelled batches) and a target dataset three times larger (the same,
# unlabelled); two forward passes, one over every image with BatchNormalization
# training and one over the source images in inference mode; random logit
# interpolation with an unseeded `tf.random.uniform`; distribution alignment;
# relative confidence thresholding (a mask on the target's pseudo-labels,
# behind `tf.stop_gradient`); the target loss weighted by a warm-up that reads
# the trainer's step counter, a `tf.Variable` the step `assign_add`s; Adam on
# a CosineDecay schedule; a Mean tracker. In small: MNIST is the 8x8 digits
# and SVHN those digits tinted, inverted and shifted; the augmentations (the
# example's run in its tf.data pipeline: a flip and a crop for the weak one,
# RandAugment from tf-models, not installed, for the strong one) are applied
# once, seeded, to the data (a flip; a flip and a brightness and contrast
# change); a Wide-ResNet of two stages of one block each (8 and 16 filters)
# instead of three of four (32 to 128); batches of 8 source and 24 target
# images.
# =================================================================================

ADAMATCH_SIZE = 8
ADAMATCH_SOURCE_BATCH = 8
ADAMATCH_TARGET_BATCH = 3 * ADAMATCH_SOURCE_BATCH
ADAMATCH_EPOCHS = 2
ADAMATCH_STEPS_PER_EPOCH = 4
ADAMATCH_TOTAL_STEPS = ADAMATCH_EPOCHS * ADAMATCH_STEPS_PER_EPOCH
ADAMATCH_WEIGHT_DECAY = 0.0005
ADAMATCH_INIT = "he_normal"


def compute_loss_source(source_labels, logits_source_w, logits_source_s):
    loss_func = keras.losses.CategoricalCrossentropy(from_logits=True)
    w_loss = loss_func(source_labels, logits_source_w)
    s_loss = loss_func(source_labels, logits_source_s)
    return w_loss + s_loss


def compute_loss_target(target_pseudo_labels_w, logits_target_s, mask):
    loss_func = keras.losses.CategoricalCrossentropy(from_logits=True, reduction="none")
    target_pseudo_labels_w = tf.stop_gradient(target_pseudo_labels_w)
    target_loss = loss_func(target_pseudo_labels_w, logits_target_s)
    mask = tf.cast(mask, target_loss.dtype)
    target_loss *= mask
    return tf.reduce_mean(target_loss, 0)


class AdaMatch(keras.Model):
    def __init__(self, model, tau=0.9):
        super().__init__()
        self.model = model
        self.tau = tau
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.total_steps = ADAMATCH_TOTAL_STEPS
        self.current_step = tf.Variable(0, dtype="int64")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def compute_mu(self):
        pi = tf.constant(np.pi, dtype="float32")
        step = tf.cast(self.current_step, dtype="float32")
        return 0.5 - tf.cos(tf.math.minimum(pi, (2 * pi * step) / self.total_steps)) / 2

    def train_step(self, data):
        source_ds, target_ds = data
        (source_w, source_labels), (source_s, _) = source_ds
        (target_w, _), (target_s, _) = target_ds
        combined_images = tf.concat([source_w, source_s, target_w, target_s], 0)
        combined_source = tf.concat([source_w, source_s], 0)
        total_source = tf.shape(combined_source)[0]
        with tf.GradientTape() as tape:
            combined_logits = self.model(combined_images, training=True)
            z_d_prime_source = self.model(combined_source, training=False)
            z_prime_source = combined_logits[:total_source]
            lambd = tf.random.uniform((total_source, 10), 0, 1)
            final_source_logits = (lambd * z_prime_source) + ((1 - lambd) * z_d_prime_source)
            y_hat_source_w = tf.nn.softmax(final_source_logits[: tf.shape(source_w)[0]])
            logits_target = combined_logits[total_source:]
            logits_target_w = logits_target[: tf.shape(target_w)[0]]
            y_hat_target_w = tf.nn.softmax(logits_target_w)
            expectation_ratio = tf.reduce_mean(y_hat_source_w) / tf.reduce_mean(y_hat_target_w)
            y_tilde_target_w = tf.math.l2_normalize(y_hat_target_w * expectation_ratio, 1)
            row_wise_max = tf.reduce_max(y_hat_source_w, axis=-1)
            final_sum = tf.reduce_mean(row_wise_max, 0)
            c_tau = self.tau * final_sum
            mask = tf.reduce_max(y_tilde_target_w, axis=-1) >= c_tau
            source_loss = compute_loss_source(source_labels, final_source_logits[: tf.shape(source_w)[0]],
                                              final_source_logits[tf.shape(source_w)[0]:])
            target_loss = compute_loss_target(y_tilde_target_w, logits_target[tf.shape(target_w)[0]:], mask)
            t = self.compute_mu()
            total_loss = source_loss + (t * target_loss)
            self.current_step.assign_add(1)
        gradients = tape.gradient(total_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        self.loss_tracker.update_state(total_loss)
        return {"loss": self.loss_tracker.result()}


def adamatch_conv(filters, kernel, strides=1):
    return layers.Conv2D(filters, kernel, strides=strides, padding="same", kernel_initializer=ADAMATCH_INIT,
                         kernel_regularizer=keras.regularizers.l2(ADAMATCH_WEIGHT_DECAY), use_bias=False)


def wide_basic(n_input_plane, n_output_plane, stride):
    def f(net):
        if n_input_plane != n_output_plane:
            net = layers.Activation("relu")(layers.BatchNormalization()(net))
            convs = net
        else:
            convs = layers.Activation("relu")(layers.BatchNormalization()(net))
        convs = adamatch_conv(n_output_plane, 3, stride)(convs)
        convs = layers.Activation("relu")(layers.BatchNormalization()(convs))
        convs = adamatch_conv(n_output_plane, 3)(convs)
        shortcut = adamatch_conv(n_output_plane, 1, stride)(net) if n_input_plane != n_output_plane else net
        return layers.Add()([convs, shortcut])
    return f


def get_wide_resnet(image_size=ADAMATCH_SIZE, num_classes=10):
    n_stages = [8, 8, 16]
    inputs = layers.Input(shape=(image_size, image_size, 3))
    x = layers.Rescaling(scale=1.0 / 255)(inputs)
    x = adamatch_conv(n_stages[0], 3)(x)
    x = wide_basic(n_stages[0], n_stages[1], 1)(x)
    x = wide_basic(n_stages[1], n_stages[2], 2)(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, kernel_regularizer=keras.regularizers.l2(ADAMATCH_WEIGHT_DECAY))(x)
    return keras.Model(inputs, outputs, name="wide_resnet")


def make_adamatch():
    keras.utils.set_random_seed(SEED)
    reduce_lr = keras.optimizers.schedules.CosineDecay(0.03, ADAMATCH_TOTAL_STEPS, 0.25)
    trainer = AdaMatch(get_wide_resnet())
    trainer.compile(optimizer=keras.optimizers.Adam(reduce_lr))
    return trainer


def adamatch_images(n, offset, target):
    """0-255 RGB images, flipped (weak) and also brightened and contrasted
    (strong), with their one-hot labels; the target domain's tinted, inverted
    and shifted by a pixel."""
    images, labels = digits(n, offset)
    images = coloured(images, 1) * 255.0
    if target:
        images = np.roll(255.0 - images * np.array([0.9, 0.5, 0.7]), 1, axis=2)
    r = rng(40 + int(target))
    flip = r.random(n) < 0.5
    weak = np.where(flip[:, None, None, None], images[:, :, ::-1], images).astype("float32")
    strong = np.clip((weak - 128.0) * r.uniform(0.6, 1.4, (n, 1, 1, 1)) + 128.0 + r.uniform(-40, 40, (n, 1, 1, 1)),
                     0, 255).astype("float32")
    return weak, strong, keras.utils.to_categorical(labels, 10).astype("float32")


def _adamatch():
    n = ADAMATCH_SOURCE_BATCH * ADAMATCH_STEPS_PER_EPOCH
    source_w, source_s, source_labels = adamatch_images(n, 600, False)
    target_w, target_s, target_labels = adamatch_images(3 * n, 700, True)

    def zipped(weak, strong, labels, batch_size):
        return tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices((weak, labels)).batch(batch_size),
                                    tf.data.Dataset.from_tensor_slices((strong, labels)).batch(batch_size)))

    total_ds = tf.data.Dataset.zip((zipped(source_w, source_s, source_labels, ADAMATCH_SOURCE_BATCH),
                                    zipped(target_w, target_s, target_labels, ADAMATCH_TARGET_BATCH)))
    return (total_ds,), {"epochs": ADAMATCH_EPOCHS}, total_ds, None, ADAMATCH_TOTAL_STEPS


# =================================================================================
# The examples, their runs and the checks of test_keras_io_guides.py.
# =================================================================================

EXAMPLES = {
    # Unseeded tf.random draws: no replay after a rewind, and a later plain
    # fit() draws otherwise after the lab's (its own xfail test below).
    "ddim": Guide(make_ddim, _ddim, own=("n_loss", "i_loss"), replay=False, later_fit=False),
    "semisupervised_simclr": Guide(make_contrastive_model, _simclr, own=("c_loss", "c_acc", "p_loss", "p_acc")),
    "gradient_centralization": Guide(gc_maker("get_gradients"), _gc, own=("loss", "accuracy")),
    "gradient_centralization/apply": Guide(gc_maker("apply"), _gc, own=("loss", "accuracy")),
    "gradient_centralization/update_step": Guide(gc_maker("update_step"), _gc, own=("loss", "accuracy")),
    "masked_language_modeling": Guide(make_masked_language_model, _masked_language_model, own=("loss",)),
    "masked_language_modeling/train_step": Guide(make_masked_language_model_step, _masked_language_model,
                                                 own=("loss",)),
    "supervised_contrastive/pretraining": Guide(make_supcon_pretraining, _supcon_pretraining, own=("loss",)),
    "supervised_contrastive/frozen_classifier": Guide(make_supcon_classifier, _supcon_classifier,
                                                      own=("loss", "sparse_categorical_accuracy")),
    "lstm_seq2seq": Guide(make_seq2seq, _seq2seq, own=("loss", "accuracy")),
    "real_nvp": Guide(make_real_nvp, _real_nvp, own=("loss",)),
    # An unseeded tf.random.uniform: as DDIM's.
    "adamatch": Guide(make_adamatch, _adamatch, own=("loss",), replay=False, later_fit=False),
}

_RUNS = {}


def runs_of(name):
    if name not in _RUNS:
        example = EXAMPLES[name]
        args, kwargs, _, _, _ = example.data()
        t = fit_three(example.make, *args, oracle=example.oracle, **kwargs)
        # Bare fit() is reproducible: the oracle's weights are the bare ones
        # (fit_three checks it); so are its optimizers' states.
        assert_same_optimizer_state(optimizer_state(t.oracle), optimizer_state(t.bare))
        # Later checks fit the bare and lab models again: their weights right after this fit.
        t.fitted = {"bare": weights(t.bare), "lab": weights(t.lab)}
        t.fitted_seeds = {"bare": seed_states(t.bare), "lab": seed_states(t.lab)}
        _RUNS[name] = t
    return _RUNS[name]


def fitted(t, which, variables):
    """The arrays `variables` (of model `which`, "bare" or "lab") held right after its fit()."""
    model = getattr(t, which)
    position = {id(v): i for i, v in enumerate(model.weights)}
    return [t.fitted[which][position[id(v)]] for v in variables]


def seed_states(model):
    return [np.array(v.numpy()) for v in model.variables if "seed_generator_state" in v.path]


def ema_network_keys(t):
    return keys_of(t, t.lab.ema_network.trainable_variables)


def gradient_keys(t):
    """The keys of the variables the example's optimizers update."""
    if isinstance(t.lab, DiffusionModel):
        return keys_of(t, t.lab.network.trainable_variables)
    return variable_keys(t.lab.trainable_variables)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_fit_weights_optimizer_and_history_are_unchanged(name):
    t = runs_of(name)
    check_weights(t)
    check_optimizer(t)
    check_history(t, EXAMPLES[name].racy)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_rows_hold_each_batch_own_values(name):
    example, t = EXAMPLES[name], runs_of(name)
    check_batch_values(t, example.own, own=True)
    if example.running:
        check_batch_values(t, example.running, own=False)


@pytest.mark.parametrize("name", [n for n in EXAMPLES if n != "ddim"])
def test_gradient_columns_for_every_updated_variable(name):
    check_gradient_columns(runs_of(name))


@pytest.mark.parametrize("name", [n for n in EXAMPLES if n != "ddim"])
def test_stepper_matches_fit_and_rewinds_exactly(name):
    example, t = EXAMPLES[name], runs_of(name)
    _, _, data, batch_size, steps = example.data()
    check_stepper(t, data, batch_size, steps, replay=example.replay)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_lab_leaves_no_trace(name, tmp_path):
    example, t = EXAMPLES[name], runs_of(name)
    args, kwargs, _, _, _ = example.data()
    kwargs["epochs"] = 1
    check_no_trace(t, tmp_path, more=(args, kwargs) if example.later_fit else None)


# ---- DDIM: the EMA network, tf.random draws ------------------------------------------


def test_ddim_run_says_its_tf_random_draws_start_again_with_each_trace():
    t = runs_of("ddim")
    warnings = " ".join(t.rec.run.events().query("kind == 'warning'")["detail"])
    assert RANDOM_NOTE.split("(")[0] in warnings, warnings
    assert "RandomStandardNormal" in warnings and "RandomUniform" in warnings


@pytest.mark.xfail(strict=True, reason=RETRACE_AFTER_FIT)
def test_ddim_a_later_plain_fit_trains_as_after_the_bare_run(tmp_path):
    example, t = EXAMPLES["ddim"], runs_of("ddim")
    args, kwargs, _, _, _ = example.data()
    kwargs["epochs"] = 1
    check_no_trace(t, tmp_path, more=(args, kwargs))


def test_ddim_ema_network_is_fits_average_and_has_no_gradient_columns():
    t = runs_of("ddim")
    ema_lab = fitted(t, "lab", t.lab.ema_network.weights)
    assert_same_arrays(ema_lab, fitted(t, "bare", t.bare.ema_network.weights),
                       "the EMA network's weights, lab against bare fit()")
    # The EMA weights moved (they are trainable variables no gradient reaches)
    # and are not the network's: the assign in train_step ran each step.
    start = make_ddim()
    moved = [not np.array_equal(a, b.numpy()) for a, b in zip(ema_lab, start.ema_network.weights)]
    assert sum(moved) > len(moved) // 2, f"only {sum(moved)} of {len(moved)} EMA weights moved"
    assert not np.array_equal(ema_lab[0], fitted(t, "lab", t.lab.network.weights[:1])[0])
    # Normalization was adapted once, before fit(): fit() leaves its statistics.
    assert_same_arrays(fitted(t, "lab", t.lab.normalizer.variables), [v.numpy() for v in start.normalizer.variables],
                       "normalizer statistics")
    check_columns_for(t, gradient_keys(t), without_gradient=ema_network_keys(t))
    # The validation pass ran the test_step's reverse diffusion for KID.
    assert len(t.history_lab["val_kid"]) == 2 and np.isfinite(t.history_lab["val_kid"]).all()


def test_ddim_stepper_matches_fit_and_rewind_puts_the_ema_network_back():
    example, t = EXAMPLES["ddim"], runs_of("ddim")
    _, _, data, batch_size, steps = example.data()
    model = example.make()
    keras.utils.set_random_seed(SEED + 1)
    stepper = lab.Stepper(model, data, batch_size=batch_size, shuffle=False, mode="graph")
    half = steps // 2
    stepped(stepper, half)
    # The first step's gradients are of the network only, with fit()'s norms.
    trace, row = stepper.traces[0], t.rows.iloc[0]
    keys = dict(zip(variable_keys(model.trainable_variables), variable_keys(t.lab.trainable_variables)))
    assert {keys[k] for k in trace.gradients} == set(gradient_keys(t))
    for key, gradient in trace.gradients.items():
        np.testing.assert_allclose(np.linalg.norm(np.asarray(gradient, np.float64)), row[f"grad_norm/{keys[key]}"],
                                   rtol=1e-5, err_msg=f"stepper gradient of {key} against the recorded grad_norm")
    middle_ema = [v.numpy() for v in model.ema_network.weights]
    middle_w, middle_o = weights(model), optimizer_state(model)
    stepped(stepper, steps - half)
    # fit() ran a validation pass (its draws come between the epochs'), the
    # Stepper none: its weights are those of a fit() without validation.
    args, kwargs, _, _, _ = example.data()
    del kwargs["validation_data"]
    reference = example.make()
    keras.utils.set_random_seed(SEED + 1)
    reference.fit(*args, shuffle=False, verbose=0, **kwargs)
    assert_same_arrays(weights(model), weights(reference), "weights after stepping (EMA network's too), against fit()")
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(reference))
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(middle_ema, model.ema_network.weights))
    stepper.rewind(steps - half)
    assert_same_arrays([v.numpy() for v in model.ema_network.weights], middle_ema, "EMA weights after rewind")
    assert_same_arrays(weights(model), middle_w, "weights after rewind")
    assert_same_optimizer_state(optimizer_state(model), middle_o)


# ---- SimCLR: two optimizers, augmenters' draws -------------------------------------


def test_simclr_encoder_columns_are_the_contrastive_gradients_and_the_probes_the_probe_loss():
    t = runs_of("semisupervised_simclr")
    (train,), _, _, _, _ = EXAMPLES["semisupervised_simclr"].data()
    (unlabeled_images, _), (labeled_images, labels) = next(iter(train))
    model = make_contrastive_model()
    # The first step, eagerly on a clean copy: the augmenters draw from the
    # same seed states as fit()'s first step.
    view_1, view_2 = model.contrastive_views(unlabeled_images, labeled_images)
    contrastive = model.encoder.trainable_weights + model.projection_head.trainable_weights
    with tf.GradientTape() as tape:
        loss = model.contrastive_loss(model.projection_head(model.encoder(view_1, training=True)),
                                      model.projection_head(model.encoder(view_2, training=True)))
    contrastive_grads = tape.gradient(loss, contrastive)
    model.contrastive_optimizer.apply_gradients(zip(contrastive_grads, contrastive))
    weak = model.classification_augmenter(labeled_images, training=True)
    with tf.GradientTape() as tape:
        probe_loss = model.probe_loss(labels, model.linear_probe(model.encoder(weak, training=False)))
    probe_grads = tape.gradient(probe_loss, model.linear_probe.trainable_weights)
    row = t.rows.iloc[0]
    np.testing.assert_allclose(row["c_loss"], float(ops.mean(loss)), rtol=1e-5)
    np.testing.assert_allclose(row["p_loss"], float(probe_loss), rtol=1e-5)
    expected = dict(zip(keys_of(t, t.lab.encoder.trainable_weights + t.lab.projection_head.trainable_weights),
                        contrastive_grads))
    expected.update(zip(keys_of(t, t.lab.linear_probe.trainable_weights), probe_grads))
    assert len(expected) == len(t.lab.trainable_variables)
    for key, grad in expected.items():
        np.testing.assert_allclose(row[f"grad_norm/{key}"], np.linalg.norm(grad.numpy()), rtol=1e-5,
                                   err_msg=f"grad_norm/{key} against the tape's gradient")
    # A learning-rate column for each of the two optimizers; none for Keras'
    # own `optimizer`, which compile() left at its default and nothing applies.
    rates = sorted(c for c in t.rows.columns if c.startswith("learning_rate"))
    assert rates == ["learning_rate/contrastive_optimizer", "learning_rate/probe_optimizer"], rates
    np.testing.assert_allclose(t.rows[rates].to_numpy(), 1e-3, rtol=1e-6)


def test_simclr_augmenters_draw_as_fit_and_a_rewind_replays_them():
    example, t = EXAMPLES["semisupervised_simclr"], runs_of("semisupervised_simclr")
    _, _, data, batch_size, steps = example.data()
    model = example.make()
    initial = seed_states(model)
    # RandomFlip, RandomTranslation, RandomZoom and RandomColorAffine in each of the two augmenters.
    assert len(initial) == 8
    keras.utils.set_random_seed(SEED + 1)
    stepper = lab.Stepper(model, data, batch_size=batch_size, shuffle=False, mode="graph")
    stepped(stepper, steps)
    final = seed_states(model)
    assert all(not np.array_equal(a, b) for a, b in zip(final, initial)), "an augmenter drew no random numbers"
    assert_same_arrays(final, t.fitted_seeds["lab"], "seed states after stepping, against fit() with the lab")
    assert_same_arrays(t.fitted_seeds["bare"], t.fitted_seeds["lab"], "seed states, lab against bare fit()")
    stepper.rewind(2)
    stepped(stepper, 2)
    assert_same_arrays(seed_states(model), final, "seed states after a rewind and replay")
    assert_same_arrays(weights(model), t.fitted["lab"], "weights after a rewind and replay")
    # Keras' SeedGenerators go on across traces: the run has nothing to say of these draws.
    assert not t.rec.run.events()["detail"].str.contains(RANDOM_NOTE.split("(")[0], regex=False).any()


# ---- Gradient centralization --------------------------------------------------------


def first_batch_gradients(optimizer):
    """The first batch's gradients by a tape on a clean copy (Dropout draws
    from the same seed states as fit()'s first step), raw and centralized."""
    x, y = gc_data()
    model = make_gc_convnet(optimizer)
    with tf.GradientTape() as tape:
        loss = keras.losses.BinaryCrossentropy()(y[:16], model(x[:16], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [g.numpy() for g in grads], [centralized(g).numpy() for g in grads]


def test_the_examples_get_gradients_override_is_never_called_and_trains_as_rmsprop():
    t = runs_of("gradient_centralization")
    GCRMSprop.calls = 0
    plain = make_gc_convnet("RMSprop")
    (x, y), kwargs, _, _, _ = _gc()
    keras.utils.set_random_seed(SEED + 1)
    plain.fit(x, y, shuffle=False, verbose=0, **kwargs)
    assert_same_arrays(t.fitted["bare"], weights(plain), "GCRMSprop's bare fit() against plain RMSprop's")
    assert GCRMSprop.calls == 0
    # So the columns hold the gradients as the tape made them, uncentralized:
    # those the update used.
    loss, raw, centred = first_batch_gradients("get_gradients")
    row = t.rows.iloc[0]
    np.testing.assert_allclose(row["loss"], loss, rtol=1e-5)
    keys = variable_keys(t.lab.trainable_variables)
    np.testing.assert_allclose([row[f"grad_norm/{k}"] for k in keys], [np.linalg.norm(g) for g in raw], rtol=1e-5)
    assert not np.isclose(np.linalg.norm(raw[0]), np.linalg.norm(centred[0]), rtol=1e-3)
    # And the run names the override that never runs.
    warnings = " ".join(t.rec.run.events().query("kind == 'warning'")["detail"])
    assert "GCRMSprop.get_gradients" in warnings and "never call" in warnings, warnings


def test_centralized_in_apply_the_columns_hold_the_centralized_gradients():
    t = runs_of("gradient_centralization/apply")
    assert not np.array_equal(t.fitted["lab"][0], runs_of("gradient_centralization").fitted["lab"][0])
    _, raw, centred = first_batch_gradients("apply")
    row = t.rows.iloc[0]
    keys = variable_keys(t.lab.trainable_variables)
    np.testing.assert_allclose([row[f"grad_norm/{k}"] for k in keys], [np.linalg.norm(g) for g in centred],
                               rtol=1e-5, err_msg="the columns against the centralized gradients")
    events = t.rec.run.events()
    assert not events["detail"].str.contains("update_step").any()


def test_centralized_in_update_step_the_columns_hold_the_gradients_before_and_the_run_says_so():
    t = runs_of("gradient_centralization/update_step")
    # The update used the centralized gradients: it trains as the apply() variant.
    assert_same_arrays(t.fitted["lab"], runs_of("gradient_centralization/apply").fitted["lab"],
                       "update_step-centralized training against apply-centralized training")
    _, raw, _ = first_batch_gradients("update_step")
    row = t.rows.iloc[0]
    keys = variable_keys(t.lab.trainable_variables)
    np.testing.assert_allclose([row[f"grad_norm/{k}"] for k in keys], [np.linalg.norm(g) for g in raw], rtol=1e-5,
                               err_msg="the columns against the gradients handed to update_step")
    warnings = " ".join(t.rec.run.events().query("kind == 'warning'")["detail"])
    expected = UPDATE_STEP_NOTE.split("{variables}")[1][:60]
    assert expected in warnings and "UpdateStepCentralizedRMSprop" in warnings, warnings


# ---- Masked language modeling: the sample weights of the masked tokens ---------------


def mlm_first_step():
    """The first batch's token losses, sample weights and gradients, by a tape
    on a clean copy (its Dropouts draw from the same seed states as fit()'s
    first step)."""
    (dataset,), _, _, _, _ = _masked_language_model()
    features, labels, sample_weight = next(iter(dataset))
    model = make_masked_language_model()
    with tf.GradientTape() as tape:
        loss = model.loss_fn(labels, model(features, training=True), sample_weight=sample_weight)
    grads = tape.gradient(loss, model.trainable_variables)
    return loss.numpy(), sample_weight.numpy(), [tf.convert_to_tensor(g).numpy() for g in grads]


@pytest.mark.parametrize("name", ["masked_language_modeling", "masked_language_modeling/train_step"])
def test_mlm_gradient_columns_are_those_of_the_masked_tokens_summed_loss(name):
    t = runs_of(name)
    loss, sample_weight, grads = mlm_first_step()
    # The loss is a (batch, length) tensor, 0 where the token is not masked:
    # both versions apply the gradient of its sum.
    assert loss.shape == (MLM_BATCH, MLM_LENGTH) and (loss[sample_weight == 0] == 0).all()
    row = t.rows.iloc[0]
    keys = variable_keys(t.lab.trainable_variables)
    # (atol: the attention's key bias has a gradient of 0 but for rounding, 2e-8.)
    np.testing.assert_allclose([row[f"grad_norm/{k}"] for k in keys], [np.linalg.norm(g) for g in grads], rtol=1e-5,
                               atol=1e-6, err_msg="the columns against the gradients of the summed token losses")


@pytest.mark.parametrize("name", ["masked_language_modeling", "masked_language_modeling/train_step"])
def test_mlm_rows_hold_the_masked_tokens_mean_loss_as_keras_logs_it(name):
    # The Keras 3 version's compute_loss returns the tokens' summed loss and
    # feeds their mean to the model's own "loss" tracker, which Keras logs:
    # the Recorder's and the Stepper's rows held the sum, unsaid.
    t = runs_of(name)
    loss, sample_weight, _ = mlm_first_step()
    # The tracker's weighted mean over the masked tokens (the weights are 0 or 1).
    mean = loss.sum() / sample_weight.sum()
    np.testing.assert_allclose(t.rows["loss"].iloc[0], mean, rtol=1e-6)
    (dataset,), _, _, _, _ = _masked_language_model()
    stepper = lab.Stepper(EXAMPLES[name].make(), dataset, mode="graph")
    np.testing.assert_allclose(stepper.step().loss, mean, rtol=1e-6)
    # Each batch holds another number of masked tokens: a sum would not be a mean.
    weights = [w.numpy().sum() for _, _, w in _masked_language_model()[0][0]]
    assert len(set(weights)) > 1


# ---- Supervised contrastive learning: two phases, the encoder frozen ----------------


def supcon_both_phases(recorders=(None, None)):
    """The example's experiment 2 from one seed: the encoder pretrained under
    its projection head, then frozen under a classifier and fit again."""
    (x, y), kwargs, _, _, _ = _supcon_pretraining()
    (xc, yc), kwargs_c, _, _, _ = _supcon_classifier()
    callbacks = [[r] if r is not None else [] for r in recorders]
    pretraining = make_supcon_pretraining()
    keras.utils.set_random_seed(SEED + 1)
    first = pretraining.fit(x, y, verbose=0, shuffle=False, callbacks=callbacks[0], **kwargs).history
    encoder = pretraining.get_layer("encoder")
    pretrained = [v.numpy() for v in encoder.weights]
    encoder_keys = keys_of_model(pretraining, encoder.trainable_variables)
    keras.utils.set_random_seed(SEED + 2)
    classifier = create_classifier(encoder, trainable=False)
    keras.utils.set_random_seed(SEED + 3)
    second = classifier.fit(xc, yc, verbose=0, shuffle=False, callbacks=callbacks[1], **kwargs_c).history
    return pretraining, classifier, first, second, (pretrained, encoder_keys)


_SUPCON_BARE = []


def supcon_bare():
    """Both phases bare (run once)."""
    if not _SUPCON_BARE:
        _SUPCON_BARE.append(supcon_both_phases())
    return _SUPCON_BARE[0]


def keys_of_model(model, variables):
    """`model`'s keys of `variables`, among its trainable variables."""
    ids = {id(v) for v in variables}
    return [k for k, v in zip(variable_keys(model.trainable_variables), model.trainable_variables) if id(v) in ids]


def test_supcon_both_phases_with_a_recorder_each_train_as_bare_and_the_frozen_encoder_has_no_columns():
    bare, bare_classifier, first, second, _ = supcon_bare()
    recorders = (lab.Recorder(gradients=True), lab.Recorder(gradients=True))
    pretraining, classifier, first_l, second_l, (pretrained, encoder_keys) = supcon_both_phases(recorders)
    assert first_l == first and second_l == second
    for model, reference in ((pretraining, bare), (classifier, bare_classifier)):
        assert_same_arrays(weights(model), weights(reference), f"{model.name}'s weights, lab against bare")
        assert_same_optimizer_state(optimizer_state(model), optimizer_state(reference))
        assert lab_traces(model) == []
    encoder = classifier.get_layer("encoder")
    # Frozen (every layer of it, BatchNormalization's statistics too): the
    # second phase leaves the pretrained encoder as it was.
    assert encoder.trainable_variables == []
    assert_same_arrays([v.numpy() for v in encoder.weights], pretrained, "the frozen encoder's weights")
    first_rows, second_rows = recorders[0].run.batches(), recorders[1].run.batches()
    assert len(first_rows) == len(second_rows) == 6
    # The first run has a column for each of the encoder's trainable variables
    # (convolutions, BatchNormalization's gamma and beta) and the head's.
    assert len(encoder_keys) == 8
    pretrained_keys = variable_keys(pretraining.trainable_variables)
    assert all(np.isfinite(first_rows[f"grad_norm/{k}"]).all() for k in pretrained_keys)
    # The second, for the classifier's two Dense layers only: none for the frozen encoder.
    head_keys = variable_keys(classifier.trainable_variables)
    assert len(head_keys) == 4 and not set(head_keys) & set(encoder_keys)
    columns = sorted(c[len("grad_norm/"):] for c in second_rows.columns if c.startswith("grad_norm/"))
    assert columns == sorted(head_keys), f"the second run's gradient columns: {columns}"
    # Frozen before compile() is no stale trainable set: the run has nothing to warn of.
    assert recorders[1].run.events().query("kind == 'warning'").empty
    # The classifier's epoch table holds its validation.
    epochs = recorders[1].run.epochs()
    assert epochs["val_sparse_categorical_accuracy"].tolist() == second["val_sparse_categorical_accuracy"]


def test_supcon_one_recorder_for_both_phases_refuses_the_second_model_and_leaves_it_bare():
    _, bare_classifier, _, second, _ = supcon_bare()
    rec = lab.Recorder(gradients=True)
    (x, y), kwargs, _, _, _ = _supcon_pretraining()
    (xc, yc), kwargs_c, _, _, _ = _supcon_classifier()
    pretraining = make_supcon_pretraining()
    keras.utils.set_random_seed(SEED + 1)
    pretraining.fit(x, y, verbose=0, shuffle=False, callbacks=[rec], **kwargs)
    keras.utils.set_random_seed(SEED + 2)
    classifier = create_classifier(pretraining.get_layer("encoder"), trainable=False)
    # One run records one model: the classifier's fit() is refused before any step.
    keras.utils.set_random_seed(SEED + 3)
    with pytest.raises(ValueError, match="one run records one model"):
        classifier.fit(xc, yc, verbose=0, shuffle=False, callbacks=[rec], **kwargs_c)
    assert len(rec.run.batches()) == 6 and lab_traces(classifier) == []
    assert int(classifier.optimizer.iterations.numpy()) == 0
    # With a Recorder of its own, as the message says, it trains as bare.
    keras.utils.set_random_seed(SEED + 3)
    second_l = classifier.fit(xc, yc, verbose=0, shuffle=False, callbacks=[lab.Recorder(gradients=True)],
                              **kwargs_c).history
    assert second_l == second
    assert_same_arrays(weights(classifier), weights(bare_classifier), "the classifier's weights after the refusal")


# ---- LSTM seq2seq: two inputs, validation_split ------------------------------------


def test_seq2seq_rows_are_the_training_split_and_the_epochs_hold_the_validation():
    t = runs_of("lstm_seq2seq")
    # validation_split=0.2 keeps 32 of the 40 pairs for training: 4 batches an epoch.
    assert len(t.rows) == 2 * 4
    epochs = t.rec.run.epochs()
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert epochs[key].tolist() == t.history_bare[key], key
    # Both LSTMs train: the encoder's through the states it hands the decoder.
    keys = variable_keys(t.lab.trainable_variables)
    lstm_keys = [k for k in keys if "lstm" in k]
    assert len(lstm_keys) == 6 and all((t.rows[f"grad_norm/{k}"] > 0).all() for k in lstm_keys)


# ---- Real NVP: the log-likelihood loss, its test_step ---------------------------------


def test_real_nvp_rows_hold_the_negative_log_likelihood_without_the_l2_penalties():
    t = runs_of("real_nvp")
    x = moons()
    model = make_real_nvp()
    loss = float(model.log_loss(x[:16]))
    penalties = float(ops.sum(ops.stack(model.losses)))
    assert penalties > 0
    # The step's loss leaves the kernels' l2 penalties out (the example's
    # train_step never adds self.losses): so does the run.
    np.testing.assert_allclose(t.rows["loss"].iloc[0], loss, rtol=1e-6)
    assert not np.isclose(t.rows["loss"].iloc[0], loss + penalties, rtol=1e-3)
    # The test_step's val_loss: of the 16 points validation_split held out.
    epochs = t.rec.run.epochs()
    assert epochs["val_loss"].tolist() == t.history_bare["val_loss"]
    for variable, value in zip(model.weights, t.fitted["lab"]):
        variable.assign(value)
    np.testing.assert_allclose(t.history_lab["val_loss"][-1], float(model.log_loss(x[64:])), rtol=1e-6)


def test_real_nvp_named_where_names_sort_out_of_order_trains_under_the_lab_as_bare():
    # Grappler sums the parts of a gradient (an AddN) in the order of their
    # nodes' names. A coupling whose first Dense layers are dense_95 and
    # dense_100 sums its input's gradient with dense_100's part first
    # ("dense_100" sorts before "dense_95"), where one named from dense_115
    # sums them in the order the layers were made. The harness named the
    # lab's model after the bare one's, so once the examples before Real NVP
    # in this file had taken the names up to there, its lab run ended an ulp
    # away in 8 biases, with nothing the lab did: the runs compared are now
    # named alike (named_alike).
    name_counters()["dense"] = 75  # named_alike first makes a model of 20 to throw away
    args, kwargs, _, _, _ = _real_nvp()
    t = fit_three(named_alike(make_real_nvp), *args, oracle=False, **kwargs)
    dense = [layer.name for layer in t.bare.layers_list[0].layers if isinstance(layer, layers.Dense)]
    assert {"dense_95", "dense_100"} <= set(dense), dense
    check_weights(t)
    check_optimizer(t)


# ---- AdaMatch: the warm-up's step counter, unseeded draws ---------------------------


def test_adamatch_step_counter_counts_as_bare_and_a_rewind_puts_it_back():
    example, t = EXAMPLES["adamatch"], runs_of("adamatch")
    # The warm-up reads a tf.Variable of the trainer's own, outside its
    # weights, which the step counts up: the lab's fit() counted as the bare one.
    assert all(v is not t.lab.current_step for v in t.lab.variables)
    assert int(t.lab.current_step.numpy()) == int(t.bare.current_step.numpy()) == ADAMATCH_TOTAL_STEPS
    _, _, data, batch_size, steps = example.data()
    model = example.make()
    keras.utils.set_random_seed(SEED + 1)
    stepper = lab.Stepper(model, data, batch_size=batch_size, shuffle=False, mode="graph")
    stepped(stepper, steps)
    assert int(model.current_step.numpy()) == steps
    stepper.rewind(3)
    assert int(model.current_step.numpy()) == steps - 3
    # The columns are the Wide-ResNet's, every trainable variable of it.
    check_columns_for(t, keys_of(t, t.lab.model.trainable_variables))
    warnings = " ".join(t.rec.run.events().query("kind == 'warning'")["detail"])
    assert RANDOM_NOTE.split("(")[0] in warnings and "RandomUniform" in warnings, warnings
