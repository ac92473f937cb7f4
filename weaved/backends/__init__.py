"""Backends execute the model on a device; ``base.Backend`` states the contract."""
