"""The ``torch.optim.Optimizer`` interface of a wrapper, delegated to the optimizer it wraps."""


class WrappedOptimizerMixin:
    """``param_groups``, ``state``, ``defaults``, ``add_param_group`` and the state dict are the
    wrapped ``self.original_optimizer``'s, so LR schedulers and checkpoints see the plain optimizer."""

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
