"""The state an elastic job carries across a change of membership (Horovod's shape).

``commit()`` keeps an in-memory copy and lets waiting newcomers in; ``restore()``
returns to that copy; ``sync()`` makes every member's state rank 0's, bit for bit.
"""
import copy

import numpy as np

from .runtime import HostsUpdatedInterrupt, current


class State:
    """Base class: subclasses implement ``save``, ``restore`` and ``sync``."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) on every member after each change of membership,
        once the state is synced: rebuild what is bound to the old group there (DDP, a
        sampler's split)."""
        if callable(callbacks):
            callbacks = [callbacks]
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"reset callbacks must be callable, got {type(cb).__name__}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for cb in self._reset_callbacks:
            cb()

    def commit(self):
        """Keep the current state (what a failure returns to), then admit newcomers that
        wait: if any do, every member raises HostsUpdatedInterrupt here (``run``
        catches it and forms the next generation with them)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt on every member if newcomers wait (rank 0 looks at
        the store; the answer is broadcast, so all members agree)."""
        import collectives as api
        rt = current()
        flag = np.zeros(1, np.int64)
        if api.get_rank() == 0 and rt.newcomers_waiting():
            flag[0] = 1
        if api.get_world_size() > 1:
            api.broadcast(flag, 0)
        if flag[0]:
            raise HostsUpdatedInterrupt(f"newcomers wait for generation {rt.gen + 1}")

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Attributes of plain Python/NumPy values: ``ObjectState(epoch=0, w=np.zeros(4))``;
    ``state.epoch``, ``state.w`` read and write them. Copies are deep."""

    def __init__(self, **attrs):
        super().__init__()
        self._names = list(attrs)
        for k, v in attrs.items():
            setattr(self, k, v)
        self._saved = None
        self.save()

    def _attrs(self):
        return {k: getattr(self, k) for k in self._names}

    def _set_attrs(self, values):
        for k, v in values.items():
            setattr(self, k, v)

    def save(self):
        self._saved = copy.deepcopy(self._attrs())

    def restore(self):
        self._set_attrs(copy.deepcopy(self._saved))

    def sync(self):
        import collectives as api
        if api.get_world_size() > 1:
            box = [self._attrs()]
            api.broadcast_object_list(box, 0)
            self._set_attrs(box[0])
        self.save()


class TorchState(ObjectState):
    """A torch model and optimizer, and other attributes:
    ``TorchState(model, optimizer, epoch=0, batch=0)``.

    ``sync`` broadcasts the model's parameters and buffers in place (no pickling) and the
    optimizer's state and the attributes as objects (a newcomer's optimizer has no state yet).
    """

    def __init__(self, model=None, optimizer=None, **attrs):
        self.model = model
        self.optimizer = optimizer
        self._saved_model = self._saved_optim = None
        super().__init__(**attrs)

    def save(self):
        super().save()
        if self.model is not None:
            self._saved_model = {k: v.detach().clone()
                                 for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            self._saved_optim = copy.deepcopy(self.optimizer.state_dict())

    def restore(self):
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._saved_optim))

    def sync(self):
        import collectives as api
        if api.get_world_size() > 1:
            if self.model is not None:
                for t in self.model.state_dict().values():
                    api.broadcast(t, 0)  # state_dict's tensors share the parameters' storage
            box = [self._attrs(), None if self.optimizer is None else self.optimizer.state_dict()]
            api.broadcast_object_list(box, 0)
            self._set_attrs(box[0])
            if self.optimizer is not None and api.get_rank() != 0:
                self.optimizer.load_state_dict(box[1])
        self.save()
