"""The ``torch.optim.Optimizer`` interface of a wrapper, delegated to the optimizer it wraps."""

from torch.optim import Optimizer


class WrappedOptimizer(Optimizer):
    """``param_groups``, ``state``, ``defaults``, ``add_param_group`` and the state dict are the
    wrapped ``original_optimizer``'s, so LR schedulers and checkpoints see the plain optimizer."""

    def __init__(self, optimizer: Optimizer):  # noqa: super().__init__ would replace param_groups
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):
            raise ValueError("optimizer is already a DPOptimizer: wrap the original optimizer")
        self.original_optimizer = optimizer
        self._inner_step = optimizer.step
        self._inner_zero_grad = optimizer.zero_grad

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.original_optimizer.add_param_group(param_group)

    def state_dict(self):
        """The wrapped optimizer's state dict (loadable into the plain optimizer)."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)
