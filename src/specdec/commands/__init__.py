"""The edge: the command line (``cli``, with ``clitools`` one floor below every command), ``bench``,
``demo``, the ``train`` and ``zoo`` commands, and the tools beside them (the registry ``sweep``, the
llama.cpp comparison, the GGUF exporter, the ``exactness`` counter, ``tiny`` random models).
The library never imports this package."""
