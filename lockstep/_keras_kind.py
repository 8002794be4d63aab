"""Whether an object is Keras': its class, or a class it derives from, is defined in Keras (a
user's subclass of `keras.Model`, `keras.losses.Loss` or a Keras optimizer is Keras' too)."""

from __future__ import annotations

from typing import Any


def defined_in_keras(cls: type) -> bool:
    """Whether the class `cls` itself is defined in Keras (not a user's subclass of Keras').

    >>> defined_in_keras(dict)
    False
    """
    return cls.__module__.split(".")[0] == "keras"


def is_keras(obj: Any) -> bool:
    """Whether `obj`'s class or one of its bases comes from Keras.

    >>> class Mine(dict): ...
    >>> is_keras(Mine()), is_keras(1)
    (False, False)
    """
    return any(map(defined_in_keras, type(obj).__mro__))
