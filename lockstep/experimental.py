"""TF's `tf.distribute.experimental` names, so that ``tf.distribute.experimental.X`` ports as
``ls.experimental.X``.

`CentralStorageStrategy` keeps TF's variables on one device and computes on the others; here it
is `MirroredStrategy` (variables replicated on the compute devices): the same numbers, since
lockstep's steps equal one device's either way.

>>> import lockstep as ls
>>> ls.experimental.CentralStorageStrategy().num_replicas_in_sync == ls.MirroredStrategy().num_replicas_in_sync
True
"""

from .cluster._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from .distribute._cross_device_ops import CommunicationImplementation as CommunicationImplementation
from .distribute._cross_device_ops import CommunicationOptions as CommunicationOptions
from .distribute._strategy import CentralStorageStrategy as CentralStorageStrategy
from .distribute._tpu import TPUStrategy as TPUStrategy
from .keras import install

install()  # Keras follows these strategies' scopes, as it follows those `lockstep` gives

__all__ = ["CentralStorageStrategy", "CommunicationImplementation", "CommunicationOptions",
           "MultiWorkerMirroredStrategy", "TPUStrategy"]
