"""Data: synthetic tasks, WMT14 preprocessing, tokenizer, datasets, sampler, CIFAR-10.

``paratrain.data.loader`` turns a config into this rank's batches; the package
itself imports nothing heavy, so command-line tools that only parse stay fast.
"""
