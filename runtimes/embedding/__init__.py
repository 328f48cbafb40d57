"""Encoder models with dynamic batching: the runtime behind `type: embedding` replicas."""
