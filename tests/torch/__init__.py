"""normlab.torch and torch's machinery: the modules, torch.compile/export and transforms,
autograd through the core (validated and dispatched once; its edges), the torch backend's
backward in blocks, and tensors' version counters."""
