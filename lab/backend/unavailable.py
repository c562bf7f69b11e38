"""Placeholders for public names a backend does not have yet.

`lab.Stepper` on a backend without a stepper is a class that cannot be
made: using it raises `NotImplementedError` naming the feature, the backend
it is missing on and the backends that have it, at the point of use (not at
`import lab`, so everything the backend has works).
"""

_HAVE = "it runs on Keras' {have} backend"


def _message(public, backend, have):
    return (f"lab.{public} does not run on Keras' {backend} backend yet ({_HAVE.format(have=have)}). "
            "lab.backend.NAME says which backend Keras runs on; the README's \"Backends\" table "
            "lists what runs on each.")


class _Refusing(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(cls._lab_message)


def placeholder(public, backend, have="TensorFlow"):
    """A stand-in for `lab.<public>` that raises NotImplementedError when used."""
    message = _message(public, backend, have)

    def refuse(*args, **kwargs):
        raise NotImplementedError(message)

    return _Refusing(public, (), {"__new__": refuse, "_lab_message": message, "__doc__": message,
                                  "__module__": "lab"})


def module_placeholder(public, backend, have="TensorFlow"):
    """A stand-in for a module `lab.<public>` whose attributes raise NotImplementedError."""
    return placeholder(public, backend, have)
