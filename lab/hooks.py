"""The instrumentation layer: every hook the lab puts on Keras objects.

Each model has one `Hooks`. Everything the lab changes on the model, its
optimizers, its metrics, its train function and the CallbackList of a running
`fit()` is a *wrapper* registered here by an *owner* (a Recorder's probe, a
`watch` block, a stepper's capture, a mode guard, a batch keeper, a failure
guard). For each patched attribute the layer keeps Keras' own value and the
stack of wrappers, and composes them in one explicit order (`ROLES`,
innermost first), so owners may come and go in any order without unwrapping
one another. `release(owner)` takes off everything that owner put on and
never raises; `release_all(model)` takes off everything.

Nothing is marked on the wrapped functions or on the model: who wrapped what
is known here only. One hook is not the model's and not here: under a
distribution strategy a probe wraps Keras' two loss-scaling functions for
the length of one train_step call (`lab.compat.watch_loss_scaling`). Patches are instance attributes; releasing the last one
of an attribute deletes it (or puts back an instance attribute that was there
before), so `type(model).train_step` is what runs again.

The train function is special: Keras replaces it (`compile()`,
`make_train_function(force=True)`, a mode switch), and `fit()` looks it up on
every batch. `sync_train_function()` (called at batch begin) notices a
replacement, takes the new function as the base and wraps it again. A train
function traced while an owner's method patches were on carries those hooks
in its graph; it is dropped from the model when that owner is released, in
favour of a clean one made in its mode (not yet traced), so a later `fit()`
without the lab traces a clean one and runs it in the mode it would have.

The hooks on the optimizer's `apply` and on methods are backend-neutral
Python; what a wrapper computes on the device (the TensorFlow part) lives in
`lab.backend.tensorflow.probes` and `lab.backend.tensorflow.buffer`.
"""

import threading
import warnings
import weakref

# Wrapper roles, innermost first: on one attribute, a wrapper of an earlier
# role is called by those of later roles.
ROLES = (
    "capture",     # a Stepper's per-step capture (compute_loss, call, apply)
    "probe",       # a Recorder's or watch block's probe (train_step, compute_loss, optimizers, metrics)
    "counter",     # compare_modes' trace counter on train_step
    "keep_batch",  # BatchInFlight: the batch in flight and the state before it
    "guard",       # a Recorder's failure guard (train function, CallbackList)
)

_lock = threading.RLock()
_registry = weakref.WeakKeyDictionary()  # model -> Hooks


class AlreadyWatched(RuntimeError):
    """Another lab recorder holds the model's probe hooks."""


def hooks_for(model):
    """The model's `Hooks` (made on first use; kept off the model)."""
    with _lock:
        hooks = _registry.get(model)
        if hooks is None:
            hooks = _registry[model] = Hooks(model)
        return hooks


def attached(model):
    """Whether any lab hook is on `model` (its methods, optimizers, train function)."""
    with _lock:
        hooks = _registry.get(model)
    return hooks is not None and hooks.active


def release_all(model):
    """Takes every lab hook off `model`; returns the owners released."""
    with _lock:
        hooks = _registry.get(model)
    return hooks.release_all() if hooks is not None else []


class _Stack:
    """The wrappers on one attribute of one object, and what was there before."""

    def __init__(self, target, name):
        self.target = weakref.ref(target) if _weakrefable(target) else (lambda t=target: t)
        self.name = name
        self.had_own = name in getattr(target, "__dict__", {})
        self.own = target.__dict__.get(name) if self.had_own else None
        self.base = getattr(target, name)
        self.wrappers = []  # (role index, sequence, owner, factory)
        self.composed = None


def _weakrefable(value):
    try:
        weakref.ref(value)
        return True
    except TypeError:
        return False


class Hooks:
    """Every lab wrapper on one model and the objects it trains with.

    Args:
        model: keras.Model.

    Example:

    ```python
    hooks = lab.hooks.hooks_for(model)
    hooks.wrap(owner, model, "compute_loss", lambda inner: my_wrapper(inner), role="probe")
    ...
    hooks.release(owner)    # everything owner put on, off again
    ```
    """

    def __init__(self, model):
        self._model = weakref.ref(model)
        self._stacks = {}  # (id(target), name) -> _Stack
        self._roles = {}  # exclusive role -> owner
        self._sequence = 0
        self._tainted = set()  # probe owners: a train function traced meanwhile carries their hooks

    # ---- reading ------------------------------------------------------------

    @property
    def active(self):
        """Whether any wrapper is on."""
        return any(stack.wrappers for stack in self._stacks.values()) or bool(self._roles)

    def owners(self):
        """The owners with something on, in no particular order."""
        found = {id(o): o for s in self._stacks.values() for _, _, o, _ in s.wrappers}
        found.update({id(o): o for o in self._roles.values()})
        return list(found.values())

    def holder(self, role):
        """The owner holding an exclusive `role` ("probe"), or None."""
        return self._roles.get(role)

    def original(self, target, name):
        """`target.name` as it is without any lab wrapper."""
        stack = self._stacks.get((id(target), name))
        if stack is None or not stack.wrappers:
            return getattr(target, name)
        return stack.base

    # ---- claiming -------------------------------------------------------------

    def claim(self, role, owner, message):
        """Makes `owner` the only holder of `role`.

        When another owner holds it, that owner is released first unless it
        is training right now (`owner.is_training()` true), then
        `AlreadyWatched(message)` is raised either way: two holders at once
        are a mistake, and none of them is left half on. A holder whose
        fit() ended by an exception it never saw (`abandon_if_gone()` true)
        is no holder: it lets go and `owner` takes the role.
        """
        with _lock:
            current = self._roles.get(role)
            if current is None or current is owner:
                self._roles[role] = owner
                return
        gone = getattr(current, "abandon_if_gone", None)
        if callable(gone) and gone():
            # Its fit() ended by an exception none of its guards saw: it has
            # told its run and taken its hooks off; `owner` may hold the role.
            return self.claim(role, owner, message)
        busy = getattr(current, "is_training", None)
        if not (callable(busy) and busy()):
            release = getattr(current, "release_hooks", None)
            if callable(release):
                release()
            self.release(current)
        raise AlreadyWatched(message)

    # ---- wrapping -------------------------------------------------------------

    def wrap(self, owner, target, name, factory, role):
        """Wraps `target.name`: `factory(inner)` returns the wrapper that calls `inner`.

        Args:
            owner: object, who is responsible for the wrapper (what `release` takes).
            target: the object whose attribute is wrapped (model, optimizer,
                metric, CallbackList).
            name: str, the attribute.
            factory: callable `(inner) -> wrapper`; called again whenever the
                stack changes, so it must not keep state of its own.
            role: str, one of `ROLES`: the wrapper's place in the order.
        """
        if role not in ROLES:
            raise ValueError(f"Unknown hook role {role!r}; use one of {ROLES}.")
        with _lock:
            key = (id(target), name)
            stack = self._stacks.get(key)
            if stack is None or stack.target() is not target:
                stack = self._stacks[key] = _Stack(target, name)
            else:
                _adopt_replacement(stack, target)
            self._sequence += 1
            stack.wrappers.append((ROLES.index(role), self._sequence, owner, factory))
            stack.wrappers.sort(key=lambda w: (w[0], w[1]))
            if role == "probe" and name != "train_function":
                # fit() may trace its train function through these wrappers.
                self._tainted.add(id(owner))
            self._compose(stack)

    def unwrap(self, owner, target, name):
        """Takes off `owner`'s wrappers of `target.name` only."""
        with _lock:
            stack = self._stacks.get((id(target), name))
            if stack is None:
                return
            stack.wrappers = [w for w in stack.wrappers if w[2] is not owner]
            self._recompose(stack)

    def wrap_train_function(self, owner, factory, role):
        """Wraps the model's current train function (see `sync_train_function`)."""
        model = self._model()
        self.wrap(owner, model, "train_function", factory, role)

    def unwrap_train_function(self, owner):
        model = self._model()
        if model is not None:
            self.unwrap(owner, model, "train_function")

    def sync_train_function(self):
        """Re-wraps the train function when something replaced it; returns it.

        Cheap when nothing changed (one identity check); call it at every
        batch begin, before `fit()` calls the function.
        """
        model = self._model()
        stack = self._stacks.get((id(model), "train_function"))
        if stack is not None and stack.composed is not None and model.__dict__.get("train_function") is stack.composed:
            return stack.composed  # called every batch: nothing changed is the common case
        with _lock:
            stack = self._stacks.get((id(model), "train_function"))
            if stack is None or not stack.wrappers:
                return model.train_function
            current = model.__dict__.get("train_function")
            if current is stack.composed and current is not None:
                return current
            stack.base = current
            self._compose(stack)
            return model.train_function

    def train_function_base(self):
        """The train function under the lab's wrappers (Keras' own, or None)."""
        model = self._model()
        stack = self._stacks.get((id(model), "train_function"))
        if stack is None or not stack.wrappers:
            return model.train_function
        if model.__dict__.get("train_function") is not stack.composed:
            return model.train_function
        return stack.base

    def _recompose(self, stack):
        """Composes `stack` again after its wrappers changed, over what
        replaced the composed function meanwhile (`_adopt_replacement`)."""
        target = stack.target()
        if target is not None:
            _adopt_replacement(stack, target)
        self._compose(stack)

    def _compose(self, stack):
        target = stack.target()
        if target is None:
            return
        if not stack.wrappers:
            self._restore(stack, target)
            return
        if stack.name == "train_function" and stack.base is None:
            # Nothing to wrap yet: fit() builds the function after set_model.
            stack.composed = None
            object.__setattr__(target, stack.name, None)
            return
        function = stack.base
        for _, _, _, factory in stack.wrappers:
            function = factory(function)
        stack.composed = function
        object.__setattr__(target, stack.name, function)

    def _restore(self, stack, target):
        name = stack.name
        if name == "train_function":
            current = target.__dict__.get(name)
            if current is stack.composed and stack.composed is not None:
                object.__setattr__(target, name, stack.base)
        elif stack.had_own:
            object.__setattr__(target, name, stack.own)
        else:
            try:
                object.__delattr__(target, name)
            except AttributeError:
                pass
        stack.composed = None
        del self._stacks[(id(target), name)]

    # ---- releasing ------------------------------------------------------------

    def release(self, owner):
        """Takes off everything `owner` put on; raises only a Ctrl-C that
        came meanwhile, once everything is off.

        A train function traced while `owner`'s method wrappers were on is
        dropped from the model for a clean one, made in its mode and traced
        when next called.
        """
        errors, interrupts = [], []
        with _lock:
            for role, held in list(self._roles.items()):
                if held is owner:
                    del self._roles[role]
            for stack in list(self._stacks.values()):
                if any(w[2] is owner for w in stack.wrappers):
                    stack.wrappers = [w for w in stack.wrappers if w[2] is not owner]
                    self._settle(lambda: self._recompose(stack), errors, interrupts)
            if id(owner) in self._tainted:
                self._tainted.discard(id(owner))
                self._settle(self._drop_traced_function, errors, interrupts)
        for error in errors:
            warnings.warn(f"The lab could not take a hook off: {error}", RuntimeWarning, stacklevel=2)
        if interrupts:
            raise interrupts[0]

    @staticmethod
    def _settle(step, errors, interrupts):
        """Runs one part of a release. An error is kept for a warning; a
        Ctrl-C (or SystemExit) is kept and the part tried once more, so the
        rest of the hooks still come off before `release` raises it."""
        for _ in range(2):
            try:
                step()
                return
            except Exception as error:  # noqa: BLE001 - the rest must come off too
                errors.append(error)
                return
            except BaseException as interrupt:  # noqa: BLE001 - raised once all is off
                interrupts.append(interrupt)

    def release_all(self):
        """Takes off every owner's wrappers; returns the owners."""
        owners = self.owners()
        for owner in owners:
            release = getattr(owner, "release_hooks", None)
            if callable(release):
                try:
                    release()
                except Exception:  # noqa: BLE001 - the layer's own release follows
                    pass
            self.release(owner)
        return owners

    def _drop_traced_function(self):
        from lab.backend import modes  # the backend's modes builds on this module

        model = self._model()
        if model is None:
            return
        dropped = self.train_function_base()
        mode = modes.running_mode(model)
        stack = self._stacks.get((id(model), "train_function"))
        if stack is not None:
            stack.base = None
            self._compose(stack)
        else:
            model.train_function = None
        if dropped is None or model.__dict__.get("train_function") is not None:
            return
        # Keras keeps its train function when `run_eagerly` or `jit_compile`
        # is set by hand; one it makes at the next fit() follows the
        # attributes. So a clean one is made now, in the dropped one's mode:
        # the mode the next fit() runs in, as without the lab.
        try:
            with modes.made_in(model, mode):
                model.make_train_function(force=True)
        except Exception as error:  # noqa: BLE001 - releasing never raises
            model.train_function = None
            warnings.warn(f"The lab could not make a clean train function: {error}; the next fit() makes one "
                          "in the mode run_eagerly / jit_compile say.", RuntimeWarning, stacklevel=3)
        self.sync_train_function()


def _adopt_replacement(stack, target):
    """Takes what replaced the composed function meanwhile as the new base
    (Keras rebuilt the train function: a mode switch, `compile()`), so that
    composing again wraps it rather than putting the old one back: a switch
    to XLA that a wrapper's change undid ran the old graph function."""
    if stack.composed is not None and _current(target, stack.name) is not stack.composed:
        stack.base = _current(target, stack.name)


def _current(target, name):
    return target.__dict__.get(name) if name in getattr(target, "__dict__", {}) else getattr(target, name, None)


class CompiledState:
    """What a traced train function is valid for: the optimizer objects,
    loss, metrics, `steps_per_execution`, eager/graph/XLA and strategy.

    A recompile (new optimizer, loss or metrics) or a mode or
    `steps_per_execution` change gives a state that differs, so a train
    function traced with the lab's hooks for the old state is never reused.
    Objects compare by identity.
    """

    def __init__(self, model, mode=None):
        from lab.variables import find_optimizers  # imports Keras, which this module does not

        self._objects = (
            tuple(find_optimizers(model).values()),
            getattr(model, "_compile_loss", None),
            getattr(model, "_compile_metrics", None),
            getattr(model, "loss", None),
            getattr(model, "distribute_strategy", None),  # tf.distribute only
        )
        # `mode`: the mode of the function that runs, where it differs from
        # the attributes' (Keras keeps a function when they are set by hand).
        self.mode = mode or ("eager" if model.run_eagerly else "xla" if model.jit_compile is True else "graph")
        self._values = (int(model.steps_per_execution), getattr(model, "compiled", False))

    def __eq__(self, other):
        return self.same_compile(other) and self.mode == other.mode

    def same_compile(self, other):
        """Whether `other` is this compiled state, whatever the mode."""
        if not isinstance(other, CompiledState) or self._values != other._values:
            return False
        return _same(self._objects, other._objects)

    def __ne__(self, other):
        return not self == other

    __hash__ = None


def _same(a, b):
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b
