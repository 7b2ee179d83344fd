"""GPU test suite (``make gpu-test``): a package, so its modules import as ``gpu.*`` in spawned workers."""
