"""The plain torch modules both faces compose: the built-in models (``paratrain.models``) and MindSpore's named
blocks (``paratrain.nn``, thin adapters over them). No collectives; each module declares its tensor-parallel
split with ``parallel_plan()`` (the kinds: ``paratrain.parallel.tensor``)."""
