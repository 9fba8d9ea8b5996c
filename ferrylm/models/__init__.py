"""Model families as pure torch modules (tensors in, tensors out) and the registry that picks one."""
